"""`kubectl gpud`: a kubectl plugin (the executable kubectl-gpud, which kubectl finds on the PATH and runs
for `kubectl gpud ...`: kubernetes/kubectl pkg/cmd/plugin.go HandlePluginCommand, DefaultPluginHandler)
with one command, `kubectl gpud inspect`: per node the GPUs, MIG devices and GPU memory allocated of
total, and the cluster's totals, as Alibaba's `kubectl inspect cgpu` shows its GPU memory.

It reads the cluster through the operator's own kubectl (`$KUBECTL_PATH`, which kubectl sets for its
plugins, else `kubectl` on the PATH), so the kubeconfig, contexts and credentials are exactly kubectl's;
nothing of gpud runs on the nodes for it. Like the device plugin and the DRA plugin it is a client that
knows the GPUs only from outside (here: the Node objects, the pods, the ResourceSlices and the
ResourceClaims). It starts fast: standard library and gpud's base only.
"""
