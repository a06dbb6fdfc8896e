"""The API server's objects, read through the operator's kubectl: `$KUBECTL_PATH` (what kubectl sets for
the plugins it runs: kubernetes/kubectl pkg/cmd/plugin.go pluginEnvironment), else `kubectl` on the PATH.
kubectl passes its plugins the environment (KUBECONFIG included) but not its own flags (flags before the
plugin's name are refused: HandlePluginCommand), so the connection flags the plugin takes are handed on.
What kubectl says when it fails becomes one error with gpud's exit codes (gpud/cli/output.py)."""

from __future__ import annotations

import os
import re
from gpud.base.bounded_json import loads
from gpud.base.child import run_sync
from gpud.cli.output import EXIT_PROBLEM, EXIT_UNREACHABLE, EXIT_USAGE, CliError

OUTPUT_CAP = 256 << 20  # a list of every pod of a large cluster: tens of MiB
RESOURCE_GROUP = "resource.k8s.io"
# kubectl's own words (k8s.io/client-go rest and transport, k8s.io/kubectl pkg/cmd/util/helpers.go
# StandardErrorMessage) for a server it could not reach or that did not answer
UNREACHABLE = re.compile(r"Unable to connect to the server|The connection to the server .* was refused|"
                         r"dial tcp|no such host|i/o timeout|Client\.Timeout|context deadline exceeded|"
                         r"connection reset by peer|TLS handshake timeout|Timeout exceeded")
KLOG = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d")  # klog's lines (-v=N, warnings): not kubectl's message
CONFIG = re.compile(r"error loading config file|invalid configuration|context .* (was )?not found|"
                    r"cluster .* not found|no configuration has been provided|unknown flag")


class Kubectl:
    """One kubectl with the connection flags to hand on (`--context=NAME` and the like)."""

    def __init__(self, flags: list[str], timeout_s: float):
        self.program = os.environ.get("KUBECTL_PATH") or "kubectl"
        self.flags = list(flags)
        self.timeout_s = timeout_s

    def run(self, *args: str) -> bytes:
        argv = [self.program, *self.flags, f"--request-timeout={self.timeout_s:g}s", *args]
        try:
            run = run_sync(argv, timeout_s=self.timeout_s + 10, output_cap=OUTPUT_CAP)
        except OSError as exc:
            raise CliError(EXIT_USAGE, "kubectl-not-found", f"cannot run {self.program}: {exc.strerror} (Debian: "
                           "apt-get install kubernetes-client; or set KUBECTL_PATH)") from None
        failure = run.failure(self.timeout_s + 10, OUTPUT_CAP)
        if failure:
            raise CliError(EXIT_UNREACHABLE if run.timed_out else EXIT_PROBLEM, "kubectl-failed", failure)
        if not run.ok:
            raise self._error(run.stderr.decode("utf-8", "replace") or run.stdout.decode("utf-8", "replace"),
                              " ".join(args[:2]))
        return run.stdout

    def _error(self, said: str, what: str) -> CliError:
        lines = [line.strip() for line in said.splitlines() if line.strip() and not KLOG.match(line)]
        message = (lines[-1] if lines else "kubectl exited with an error and said nothing")[:2000]
        if UNREACHABLE.search(said):
            return CliError(EXIT_UNREACHABLE, "api-unreachable", f"the API server is unreachable: {message}")
        if "(Forbidden)" in said or " is forbidden: " in said:
            return CliError(EXIT_PROBLEM, "forbidden", f"kubectl {what}: {message} (kubectl gpud inspect needs list "
                            "of nodes and pods, and of resourceslices and resourceclaims in resource.k8s.io)")
        if "(NotFound)" in said:  # a node named that does not exist: as gpud's CLI exits for a 404
            return CliError(EXIT_USAGE, "not-found", f"kubectl {what}: {message}")
        if "(Unauthorized)" in said:
            return CliError(EXIT_PROBLEM, "unauthorized", f"kubectl {what}: {message}")
        if CONFIG.search(said):
            return CliError(EXIT_USAGE, "kubeconfig", f"kubectl: {message}")
        return CliError(EXIT_PROBLEM, "kubectl-failed", f"kubectl {what}: {message}")

    def items(self, *args: str) -> list[dict]:
        """`kubectl get ... -o json`: the list's items."""
        raw = self.run("get", *args, "-o", "json")
        try:
            document = loads(raw, what="kubectl's answer")
        except ValueError as exc:
            raise CliError(EXIT_PROBLEM, "kubectl-answer", str(exc)) from None
        if isinstance(document, dict) and "items" not in document and isinstance(document.get("metadata"), dict):
            return [document]  # one object named: kubectl prints it, not a list
        items = document.get("items") if isinstance(document, dict) else None
        if not isinstance(items, list):
            raise CliError(EXIT_PROBLEM, "kubectl-answer", "kubectl's answer is not a list of objects")
        return [item for item in items if isinstance(item, dict)]

    def serves(self, resource: str, group: str) -> bool:
        """Whether discovery lists the resource in the group (`kubectl api-resources`)."""
        names = self.run("api-resources", f"--api-group={group}", "-o", "name").decode("utf-8", "replace").split()
        return f"{resource}.{group}" in names
