"""At most N nodes of a pool remediate at once: N Leases (coordination.k8s.io/v1) named
`gpud-remediation-<pool>-<i>`, each a slot one node holds. No controller of gpud's runs in the cluster;
the API server's compare-and-swap on resourceVersion settles two nodes that take one slot together.

A holder renews its slot's renewTime; another node takes a slot over only once it has seen the same
record, unchanged, for the lease's whole duration on its own clock, as client-go's leader election judges
expiry (k8s.io/client-go tools/leaderelection/leaderelection.go tryAcquireOrRenew: observedTime, not the
holder's renewTime, so clocks need not agree). A node that dies holding a slot so loses it a lease
duration after the others first saw its last renewal. Releasing empties holderIdentity and shortens the
duration to 1 s, as client-go's release does.
"""

from __future__ import annotations

import datetime
import hashlib
import re
import time

from gpud.kubernetes.node_api import KubeError, NodeApi

PREFIX = "gpud-remediation"
WHOLE_CLUSTER = "cluster"  # the pool's name in the slots' names when no pool label is set
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def micro_time() -> str:
    """metav1.MicroTime as the API server writes it (RFC 3339 with microseconds, UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def pool_part(pool: str) -> str:
    """The pool as part of a Lease name (a DNS subdomain): a label value lowercased when that is a DNS
    label, else a digest of it (a label value may hold '_', '.' and capitals; two pools must not meet)."""
    lowered = pool.lower()
    if lowered == pool and _DNS_LABEL.fullmatch(pool) and len(pool) <= 40:
        return pool
    return "h" + hashlib.sha256(pool.encode()).hexdigest()[:16]


class LeaseSlots:
    def __init__(self, api: NodeApi, namespace: str, pool: str, slots: int, duration_s: int):
        self.api, self.namespace, self.slots, self.duration_s = api, namespace, slots, duration_s
        self.pool = pool
        self.holder = api.node_name
        self.names = [f"{PREFIX}-{pool_part(pool)}-{index}" for index in range(slots)]
        # slot -> (what its record said, when this agent first saw it say that): expiry on our own clock
        self._observed: dict[str, tuple[tuple, float]] = {}

    def _expired(self, name: str, spec: dict) -> bool:
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        seen = self._observed.get(name)
        now = time.monotonic()
        if seen is None or seen[0] != record:
            self._observed[name] = (record, now)
            return False
        return now - seen[1] >= float(spec.get("leaseDurationSeconds") or self.duration_s)

    def _spec(self, transitions: int, acquired: str | None = None) -> dict:
        now = micro_time()
        return {"holderIdentity": self.holder, "leaseDurationSeconds": self.duration_s,
                "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}

    async def take_a_slot(self, held: str | None = None) -> str | None:
        """The slot this node now holds (`held` first, renewed), or None when every slot is another live
        node's. KubeError when the API server cannot be asked."""
        for name in ([held] if held in self.names else []) + [n for n in self.names if n != held]:
            if await self._take(name):
                return name
        return None

    async def renew(self, name: str) -> bool:
        """False when the slot is no longer this node's (it expired and another node took it)."""
        return await self._take(name)

    async def _take(self, name: str) -> bool:
        try:
            lease = await self.api.read_lease(self.namespace, name)
        except KubeError as exc:
            if exc.status != 404:
                raise
            try:
                await self.api.create_lease(self.namespace, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "namespace": self.namespace,
                                 "labels": {"app.kubernetes.io/managed-by": "gpud"}},
                    "spec": self._spec(0)})
                return True
            except KubeError as created:
                if created.status == 409:  # another node created it first
                    return False
                raise
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        mine = holder == self.holder
        if not mine and holder and not self._expired(name, spec):
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        lease["spec"] = self._spec(transitions, spec.get("acquireTime") if mine else None)
        try:
            await self.api.replace_lease(self.namespace, lease)
        except KubeError as exc:
            if exc.status == 409:  # another node took or renewed it meanwhile
                return False
            raise
        return True

    async def release(self, name: str) -> None:
        try:
            lease = await self.api.read_lease(self.namespace, name)
        except KubeError as exc:
            if exc.status == 404:
                return
            raise
        spec = lease.get("spec") or {}
        if spec.get("holderIdentity") != self.holder:
            return
        now = micro_time()
        lease["spec"] = {"leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
                         "leaseTransitions": int(spec.get("leaseTransitions") or 0)}
        try:
            await self.api.replace_lease(self.namespace, lease)
        except KubeError as exc:
            if exc.status != 409:  # 409: it moved on without us
                raise
