"""The node agent: its Node's labels drive gpud, gpud's health goes back to its Node.

Tasks, each on its own so that one waiting (a MIG apply takes minutes, an API server may be down)
holds up none of the others:
- the Node: one GET, then a watch resumed from the last resourceVersion; labels it carries are handed
  to the MIG and sharing tasks, which act only when a value changes;
- MIG: one apply at a time through gpud (PUT /v1/mig?wait=true); a label changed mid-apply waits for
  that apply to end, then the latest value is applied (never two interleaved);
- sharing: the named config chosen through gpud (PUT /v1/sharing/config);
- health: gpud's watch stream says when health changed; the condition GPUHealthy (and the opt-in
  taint) are written only when what they say changes;
- gpud's watch stream itself (a thread), and the agent's own status, sent to gpud (PUT
  /v1/kubernetes/agent) so that `gpud kubernetes` shows what the agent could not do and why.
Kubernetes being unreachable or refusing (403) never touches gpud: the agent retries, with a jittered
backoff, and says so.
"""

from __future__ import annotations

import asyncio
import copy
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

from gpud.base.logs import get_logger
from gpud.base.loops import within
from gpud.client import ApiFailure, Client, DaemonUnreachable, follow_stream
from gpud.kubernetes import (CONDITION_TYPE, MIG_CONFIG_LABEL, MIG_STATE_LABEL, SHARING_CONFIG_LABEL, TAINT_EFFECT,
                             TAINT_KEY, TAINT_VALUE)
from gpud.kubernetes.health import Verdict, unknown, verdict
from gpud.kubernetes.node_api import KubeError, NodeApi, now_rfc3339
from gpud.kubernetes.remediation import Remediation

log = get_logger("k8s_agent")

GPUD_TIMEOUT_S = 10.0
MIG_APPLY_TIMEOUT_S = 3600.0  # PUT /v1/mig?wait=true answers when the apply ends: minutes on 8 GPUs
WATCH_FROM_THE_START = "/v1/watch?since=0&epoch=gpud-k8s-agent"  # as the device plugin's: a `gap` line first
GPUD_UNREACHABLE_GRACE_S = 30.0  # then GPUHealthy says Unknown: a gpud restart takes seconds
BACKOFF_S = (1.0, 60.0)  # first and longest wait before retrying a failed call to the API server
SHORT_WATCH_S = 1.0  # client-go's reflector: a watch ended sooner with no event is a failure
MIG_RETRY_S = 10.0  # while MIG devices are busy, or gpud is in another apply
HEALTH_COALESCE_S = 0.05  # a burst of health events (an XID on 8 GPUs) becomes one read and one patch
STATUS_EVERY_S = 1.0  # the agent's status goes to gpud at most this often
STATUS_HEARTBEAT_S = 60.0  # and at least this often
TAINT_ATTEMPTS = 5  # 409 Conflicts in a row before a taint change waits for the next health change
# gpud's refusals that mean "not now": MIG devices or GPUs in use, a reset another process blocks
MIG_BUSY = frozenset({"instances-in-use", "gpu-in-use", "reset-blocked"})
MIG_LATER = frozenset({"apply-in-progress", "nvml-unavailable"})  # gpud is busy or has no NVML yet
# A label value (k8s.io/apimachinery validation.IsValidLabelValue): the API server refuses anything
# else, so any other value did not come through it.
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_VALUE_MAX = 63
DEFAULT_SETTINGS = {"taint_unhealthy": False, "mig_busy_timeout_s": 3600.0}
_UNSEEN = object()  # the sharing label before the Node was first read


class Backoff:
    """Exponential, with jitter: a fleet's agents that lost the API server together do not all come
    back in the same second (half to the whole of each step, as client-go's jittered backoff)."""

    def __init__(self, first: float = BACKOFF_S[0], most: float = BACKOFF_S[1]):
        self.first, self.most, self.step = first, most, first

    def next(self) -> float:
        wait = self.step * random.uniform(0.5, 1.0)
        self.step = min(self.step * 2, self.most)
        return wait

    def reset(self) -> None:
        self.step = self.first


def label_value_problem(value: str) -> str | None:
    """Why a label value cannot name a layout or a config, or None."""
    if len(value) > LABEL_VALUE_MAX:
        return f"is {len(value)} characters long; a label value has at most {LABEL_VALUE_MAX}"
    if not LABEL_VALUE.fullmatch(value):
        return "is not a label value (letters, digits, '-', '_', '.', starting and ending with a letter or digit)"
    return None


def _labels(node: dict | None) -> dict:
    return (node or {}).get("metadata", {}).get("labels") or {}


def _condition(node: dict | None) -> dict | None:
    for condition in (node or {}).get("status", {}).get("conditions") or []:
        if condition.get("type") == CONDITION_TYPE:
            return condition
    return None


def _short(value: str | None, limit: int = 80) -> str | None:
    """A label value as logs and the status show it: a value no API server would pass can be huge."""
    return value if value is None or len(value) <= limit else value[:limit] + "…"


def _quote(value: str | None) -> str:
    return repr(_short(value))


class Agent:
    def __init__(self, api: NodeApi, gpud_socket: Path | None):
        self.api = api
        self.node_name = api.node_name
        self.gpud = Client(gpud_socket, timeout=GPUD_TIMEOUT_S)
        self.gpud_apply = Client(self.gpud.socket_path, timeout=MIG_APPLY_TIMEOUT_S)
        self.node: dict | None = None  # the Node as last seen
        self.settings = dict(DEFAULT_SETTINGS)
        self._mig_wanted: str | None = None
        self._mig_done: str | None = None  # the label value whose outcome the state label shows
        self._mig_changed = asyncio.Event()
        self._sharing_wanted: str | None = None
        self._sharing_done: object = _UNSEEN
        self._sharing_changed = asyncio.Event()
        self._health_dirty = asyncio.Event()
        self._settings_stale = True  # GET /v1/kubernetes before the next health read
        self._published: Verdict | None = None  # what GPUHealthy says as the agent last wrote it
        self._gpud_epoch: str | None = None
        self._gpud_unreachable_since: float | None = time.monotonic()  # until gpud first answers
        self._status_dirty = asyncio.Event()
        self._sending = asyncio.Lock()
        self.status: dict[str, Any] = {
            "node": self.node_name, "running": True, "started_at": time.time(),
            "kubernetes": {"ok": None, "error": None, "since": None},
            "gpud": {"ok": None, "error": None}, "watch": {"resource_version": None, "restarts": 0},
            "mig": {"label": None, "state": None, "detail": None},
            "sharing": {"label": None, "outcome": None},
            "health": {"condition": None, "reason": None, "taint": False},
            "remediation": {"enabled": False, "step": None},
            "requests": {}, "problems": {},
        }
        self._publishing = asyncio.Lock()  # the health loop and the remediation loop both publish
        self.remediation = Remediation(self)

    # -- running -----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=follow_stream, name="gpud-watch", daemon=True,
                         args=(self.gpud, WATCH_FROM_THE_START, loop, self._on_gpud_event,
                               self._on_gpud_disconnect)).start()
        tasks = [asyncio.create_task(coro) for coro in (
            self._follow_node(), self._mig_loop(), self._sharing_loop(), self._health_loop(),
            self._gpud_grace_loop(), self._status_loop(), self.remediation.run())]
        log.info("k8s_agent_starting", node=self.node_name, gpud_socket=str(self.gpud.socket_path),
                 api_server=self.api.client.configuration.host)
        try:
            waiting = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([waiting, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not waiting:
                    task.result()  # a task that ended is a bug: raise it
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.status["running"] = False
            await self._send_status()
            log.info("k8s_agent_stopped", node=self.node_name, requests=dict(self.api.requests))

    # -- status ------------------------------------------------------------------------------------

    def _note(self, section: str, **values: Any) -> None:
        if any(self.status[section].get(k) != v for k, v in values.items()):
            self.status[section].update(values)
            self._status_dirty.set()

    def _problem(self, what: str, why: str | None) -> None:
        """A standing problem (None: solved), shown until solved in the agent's status."""
        problems = self.status["problems"]
        if why is None:
            if problems.pop(what, None) is not None:
                log.info("k8s_agent_problem_solved", node=self.node_name, what=what)
                self._status_dirty.set()
        elif problems.get(what, {}).get("why") != why:
            problems[what] = {"why": why, "since": problems.get(what, {}).get("since", time.time())}
            self._status_dirty.set()

    def _kube_failed(self, what: str, exc: KubeError) -> None:
        """`what` the agent could not do (one of a few kinds: "read node", "write labels", …), and why."""
        hint = (" (RBAC: the ClusterRole gpud-k8s-agent in deploy/kubernetes/rbac.yaml grants what the agent "
                "needs)" if exc.status == 403 else "")
        log.warning("kubernetes_call_failed", node=self.node_name, could_not=what, status=exc.status,
                    error=str(exc), hint=hint.strip(" ()") or None)
        self._note("kubernetes", ok=False, error=f"{exc}{hint}", since=time.time())
        self._problem(what, f"{exc}{hint}")

    def _kube_ok(self, what: str) -> None:
        if self.status["kubernetes"]["ok"] is not True:
            self._note("kubernetes", ok=True, error=None, since=time.time())
        self._problem(what, None)

    async def _status_loop(self) -> None:
        """Sends the status on each change, at most every STATUS_EVERY_S, and at least every
        STATUS_HEARTBEAT_S (gpud's socket, not the API server): `gpud kubernetes` tells a stale one."""
        while True:
            try:
                await within(self._status_dirty.wait(), STATUS_HEARTBEAT_S)
            except asyncio.TimeoutError:
                pass
            self._status_dirty.clear()
            await asyncio.shield(self._send_status())  # a stop waits for it: the last word is the stop's
            await asyncio.sleep(STATUS_EVERY_S)

    async def _send_status(self) -> None:
        async with self._sending:  # one at a time, in order
            self.status["requests"] = dict(self.api.requests)
            snapshot = copy.deepcopy(self.status)  # the thread encodes it while the loop changes the status
            try:
                await asyncio.to_thread(self.gpud.request, "PUT", "/v1/kubernetes/agent", snapshot)
            except (DaemonUnreachable, ApiFailure) as exc:
                log.debug("k8s_agent_status_not_sent", error=str(exc))

    async def _gpud(self, method: str, path: str, body: Any = None, client: Client | None = None) -> Any:
        status, document = await asyncio.to_thread((client or self.gpud).request, method, path, body)
        return document

    async def _event(self, event_type: str, reason: str, message: str) -> None:
        """Records an Event on the Node; a refused one is logged and noted, never retried (Events are
        best-effort in Kubernetes too: client-go's recorder drops what it cannot write)."""
        log.info("node_event", node=self.node_name, type=event_type, reason=reason, message=message)
        try:
            await self.api.create_event(self.node or {}, event_type, reason, message)
            self._kube_ok("create events")
        except KubeError as exc:
            self._kube_failed("create events", exc)

    # -- the Node ----------------------------------------------------------------------------------

    async def _follow_node(self) -> None:
        """The Node, read once, then watched from where the last event or bookmark left off. After a
        410 (the version fell out of the server's window) the Node is read again and watched without
        a resourceVersion: the watch then starts at the most recent one, with the Node as it is (an
        ADDED event). A GET answers the Node's own resourceVersion, which can be as old as its last
        change, and so already out of that window: watching from it would only meet 410 again."""
        backoff, expired = Backoff(), Backoff(BACKOFF_S[0], BACKOFF_S[1])
        resource_version: str | None = None
        from_now = False  # the next watch starts at the most recent resourceVersion
        while True:
            try:
                if resource_version is None:
                    self._on_node(await self.api.read_node())
                    resource_version = self.node["metadata"]["resourceVersion"]
                    self._kube_ok("read node")
                watched, events = time.monotonic(), 0
                async for kind, obj in self.api.watch(None if from_now else resource_version):
                    events += 1
                    resource_version = obj.get("metadata", {}).get("resourceVersion") or resource_version
                    from_now = False
                    expired.reset()
                    if kind in ("ADDED", "MODIFIED"):
                        self._on_node(obj)
                    elif kind == "DELETED":
                        log.warning("node_deleted", node=self.node_name)
                        self.node, resource_version = None, None
                        break
                    self._note("watch", resource_version=resource_version)
                lasted = time.monotonic() - watched
                if lasted < SHORT_WATCH_S and not events:
                    # client-go's reflector: a watch the server ends within a second with no event is an
                    # error ("very short watch", tools/cache/reflector.go watchHandler), retried with its
                    # backoff (800 ms doubling to 30 s), not at once: an API server (or a proxy) that
                    # answers every watch with an empty 200 made the agent spin a core.
                    raise KubeError(f"watch node {self.node_name}", None, "very short watch: the API server "
                                    f"ended it after {lasted:.2f} s with no event")
                self._kube_ok("watch node")
                if lasted < SHORT_WATCH_S:  # events (a bookmark), but ended at once again: waited on as a failure
                    await asyncio.sleep(backoff.next())
                else:
                    backoff.reset()
            except KubeError as exc:
                if exc.status == 410:
                    log.info("node_watch_expired", node=self.node_name, resource_version=resource_version)
                    self.status["watch"]["restarts"] += 1
                    if from_now:  # expired even from the most recent version: not this agent's doing
                        await asyncio.sleep(expired.next())
                    resource_version, from_now = None, True
                    continue
                self._kube_failed("read node" if resource_version is None else "watch node", exc)
                if exc.status == 404:
                    resource_version = None
                await asyncio.sleep(backoff.next())

    def _on_node(self, node: dict) -> None:
        self.node = node
        labels = _labels(node)
        mig = labels.get(MIG_CONFIG_LABEL)
        if mig != self._mig_wanted:
            log.info("mig_label_seen", node=self.node_name, value=_short(mig), previous=_short(self._mig_wanted))
            self._mig_wanted = mig
            self._note("mig", label=_short(mig))
            self._mig_changed.set()
        sharing = labels.get(SHARING_CONFIG_LABEL)
        if sharing != self._sharing_wanted or self._sharing_done is _UNSEEN:
            self._sharing_wanted = sharing
            self._note("sharing", label=_short(sharing))
            self._sharing_changed.set()
        if self._published is not None and self._published.differs_from(_condition(node)):
            self._health_dirty.set()  # someone else wrote our condition: write it back
        if self._taint_wrong(node):
            self._health_dirty.set()

    async def _set_state(self, state: str) -> None:
        """Writes nvidia.com/mig.config.state (mig-manager's values), unless the Node already says it."""
        self._note("mig", state=state)
        if _labels(self.node).get(MIG_STATE_LABEL) == state:
            return
        backoff = Backoff()
        while True:
            try:
                self.node = await self.api.patch_labels({MIG_STATE_LABEL: state})
                self._kube_ok("write labels")
                return
            except KubeError as exc:
                self._kube_failed("write labels", exc)
                await asyncio.sleep(backoff.next())

    # -- MIG from the label --------------------------------------------------------------------------

    async def _mig_loop(self) -> None:
        while True:
            await self._mig_changed.wait()
            self._mig_changed.clear()
            while (value := self._mig_wanted) is not None:  # no label: nothing changes (as mig-manager)
                if value != self._mig_done:
                    await self._apply_mig(value)
                elif _labels(self.node).get(MIG_STATE_LABEL) == "rebooting":
                    await self._mig_in_force(value)  # has the reset or reboot it waited for happened?
                if self._mig_wanted == value:
                    break  # else the label changed meanwhile: the latest value next

    async def _apply_mig(self, value: str) -> None:
        problem = label_value_problem(value)
        if problem is not None or "/" in value:
            await self._mig_outcome(value, "failed", "Warning", "MigConfigInvalid",
                                    f"{MIG_CONFIG_LABEL}={_quote(value)} {problem or 'is a path, not a layout name'}; "
                                    "nothing was changed")
            return
        if await self._mig_in_force(value):
            return
        await self._set_state("pending")
        waiting_since, announced, backoff = None, None, Backoff()
        while self._mig_wanted == value:
            try:
                view = await self._gpud("PUT", "/v1/mig?wait=true", {"layout": value}, self.gpud_apply)
            except DaemonUnreachable as exc:
                self._note("mig", detail=f"gpud unreachable: {exc}")
                await self._mig_pause(backoff.next())
                continue
            except ApiFailure as exc:
                if self._mig_wanted != value:
                    break
                if exc.code in MIG_BUSY:
                    waiting_since = waiting_since or time.monotonic()
                    limit = float(self.settings["mig_busy_timeout_s"])
                    if time.monotonic() - waiting_since >= limit:
                        await self._mig_outcome(value, "failed", "Warning", "MigConfigFailed",
                                                f"layout {value} not applied: still refused after {limit:g} s "
                                                f"(kubernetes.mig_busy_timeout_s): {exc}")
                        return
                    if exc.error.get("busy", exc.error.get("blockers")) != announced:
                        announced = exc.error.get("busy", exc.error.get("blockers"))
                        self._note("mig", detail=str(exc))
                        await self._event("Warning", "MigConfigWaiting",
                                          f"layout {value} waits: {exc}. It is applied once they end, or fails "
                                          f"after {limit:g} s (kubernetes.mig_busy_timeout_s)")
                    await self._mig_pause(min(MIG_RETRY_S, waiting_since + limit - time.monotonic()))
                    continue
                if exc.code in MIG_LATER or exc.status == 503:
                    self._note("mig", detail=str(exc))
                    await self._mig_pause(MIG_RETRY_S)
                    continue
                if exc.code == "reset-required":
                    gpus = [g["index"] for g in (exc.error.get("mig") or {}).get("gpus", [])
                            if g.get("state") == "reset-required"]
                    await self._mig_outcome(value, "rebooting", "Warning", "MigConfigNeedsReboot",
                                            f"layout {value}: GPUs {', '.join(map(str, gpus)) or '?'} change MIG mode "
                                            f"at their next reset or reboot: {exc}")
                    return
                await self._mig_outcome(value, "failed", "Warning", "MigConfigFailed", f"layout {value}: {exc}")
                return
            if self._mig_wanted != value:
                break
            changed = [str(g["index"]) for g in view.get("gpus", []) if g.get("state") == "done"]
            await self._mig_outcome(value, "success", "Normal", "MigConfigApplied",
                                    f"layout {value} applied: " + (f"GPUs {', '.join(changed)} changed" if changed
                                                                   else "no GPU needed a change"))
            return
        log.info("mig_label_superseded", node=self.node_name, value=_short(value), now=_short(self._mig_wanted))

    async def _mig_pause(self, seconds: float) -> None:
        """Waits, or less when the label changes meanwhile (the new value is then applied instead) or
        gpud's GPUs change (the processes in the way may have ended)."""
        try:
            await within(self._mig_changed.wait(), max(seconds, 0.0))
        except asyncio.TimeoutError:
            pass
        self._mig_changed.clear()

    async def _mig_in_force(self, value: str) -> bool:
        """Whether gpud already has this layout, in sync (an agent restart, a reboot that finished a
        mode change): then its state is success without applying anything."""
        try:
            mig = await self._gpud("GET", "/v1/mig")
        except (DaemonUnreachable, ApiFailure):
            return False
        if mig.get("layout") == value and mig.get("in_sync") and mig.get("state") in ("success", "reset-required"):
            rebooted = _labels(self.node).get(MIG_STATE_LABEL) == "rebooting"
            self._mig_done = value
            if _labels(self.node).get(MIG_STATE_LABEL) != "success":
                await self._set_state("success")
                await self._event("Normal", "MigConfigApplied", f"layout {value} in force"
                                  + (" after the reset or reboot it waited for" if rebooted else ""))
            self._note("mig", state="success", detail=None)
            return True
        return False

    async def _mig_outcome(self, value: str, state: str, event_type: str, reason: str, message: str) -> None:
        log.info("mig_label_outcome", node=self.node_name, value=_short(value), state=state, reason=reason,
                 message=message)
        self._mig_done = value
        self._note("mig", detail=message)
        await self._set_state(state)
        await self._event(event_type, reason, message)

    # -- sharing from the label ----------------------------------------------------------------------

    async def _sharing_loop(self) -> None:
        backoff = Backoff()
        while True:
            await self._sharing_changed.wait()
            self._sharing_changed.clear()
            value = self._sharing_wanted
            if value == self._sharing_done:
                continue
            try:
                await self._choose_sharing(value)
                backoff.reset()
            except DaemonUnreachable as exc:
                self._note("sharing", outcome=f"gpud unreachable: {exc}")
                await asyncio.sleep(backoff.next())
                self._sharing_changed.set()
                continue
            except ApiFailure as exc:  # e.g. the agent is not gpud's admin (403): said, not retried
                log.error("sharing_not_chosen", node=self.node_name, label=_short(value), error=str(exc))
                self._note("sharing", outcome=str(exc))
                self._problem("choose sharing config", str(exc))
            self._sharing_done = value

    async def _choose_sharing(self, value: str | None) -> None:
        current = (await self._gpud("GET", "/v1/sharing")).get("config") or {}
        if current.get("chosen") == value:
            self._note("sharing", outcome=current.get("why"))
            return
        reason = f"node label {SHARING_CONFIG_LABEL}=" + value if value is not None else \
            f"node label {SHARING_CONFIG_LABEL} is not set"
        problem = label_value_problem(value) if value is not None else None
        if problem is not None:  # never sent to gpud: what no API server passes is no config name
            await self._sharing_refused(current, "SharingConfigInvalid",
                                        f"{SHARING_CONFIG_LABEL}={_quote(value)} {problem}")
            return
        try:
            chosen = await self._gpud("PUT", "/v1/sharing/config", {"name": value, "reason": reason})
        except ApiFailure as exc:
            if exc.code == "sharing-config-not-found" or exc.status == 422:
                await self._sharing_refused(current, "SharingConfigNotFound" if exc.status == 404
                                            else "SharingConfigInvalid", str(exc))
            else:
                self._note("sharing", outcome=str(exc))
                await self._event("Warning", "SharingConfigRefused", f"sharing config {_quote(value)}: {exc}")
            return
        self._note("sharing", outcome=chosen.get("why"))
        sharing = await self._gpud("GET", "/v1/sharing")
        resources = ", ".join(f"{r['name']}: {r['count']}" for r in sharing.get("resources", []))
        await self._event("Normal", "SharingConfigApplied",
                          f"sharing config {chosen.get('name')!r} in force ({chosen.get('why')}); {resources}")

    async def _sharing_refused(self, current: dict, reason: str, why: str) -> None:
        """A name that cannot be used: the default config is the one in force (a name chosen earlier is
        let go), and an Event says why and which config that is."""
        self._note("sharing", outcome=why)
        if current.get("chosen") is not None:
            await self._gpud("PUT", "/v1/sharing/config",
                             {"name": None, "reason": "the name the node label asks for cannot be used"})
        kept = f"the default config {current.get('default')!r} is in force" if current.get("default") else \
            "no default config (sharing.default_config): gpud's sharing.file is in force"
        await self._event("Warning", reason, f"{why}; {kept}")

    # -- health --------------------------------------------------------------------------------------

    def _on_gpud_event(self, event: dict) -> None:
        kind = event.get("type")
        if event.get("epoch") != self._gpud_epoch:  # connected, or gpud restarted: read everything again
            log.info("gpud_connected", node=self.node_name, epoch=event.get("epoch"), previous=self._gpud_epoch)
            self._gpud_epoch = event.get("epoch")
            self._gpud_unreachable_since = None
            self._note("gpud", ok=True, error=None)
            self._settings_stale = True
            self._health_dirty.set()
            self._mig_changed.set()  # a reboot may have finished a change that waited for it
            self._status_dirty.set()
            self.remediation.wake.set()
        if kind in ("health", "inventory"):
            self._health_dirty.set()
            self.remediation.wake.set()
        elif kind == "kubernetes":
            self._apply_settings(event.get("data") or {})
        if kind in ("mig", "inventory") and self.status["mig"]["state"] in ("rebooting", "pending"):
            self._mig_changed.set()  # a reset may have finished a change, processes may have ended

    def _on_gpud_disconnect(self, reason: str, retry_in_s: float) -> None:
        if self._gpud_unreachable_since is None:
            self._gpud_unreachable_since = time.monotonic()
            log.warning("gpud_unreachable", node=self.node_name, reason=reason)
        self._gpud_epoch = None
        self._note("gpud", ok=False, error=reason)

    async def _read_settings(self) -> None:
        try:
            document = await self._gpud("GET", "/v1/kubernetes")
        except (DaemonUnreachable, ApiFailure) as exc:
            log.warning("kubernetes_settings_not_read", node=self.node_name, error=str(exc),
                        using=self.settings)
            return
        self._apply_settings(document.get("settings") or {})

    def _apply_settings(self, settings: dict) -> None:
        merged = {**self.settings, **{k: v for k, v in settings.items() if k in DEFAULT_SETTINGS}}
        if merged != self.settings:
            log.info("kubernetes_settings", node=self.node_name, settings=merged, previous=self.settings)
            self.settings = merged
            self._health_dirty.set()

    async def _gpud_grace_loop(self) -> None:
        """Once gpud has been unreachable past the grace, GPUHealthy turns Unknown."""
        while True:
            await asyncio.sleep(GPUD_UNREACHABLE_GRACE_S / 4)
            since = self._gpud_unreachable_since
            if since is not None and time.monotonic() - since >= GPUD_UNREACHABLE_GRACE_S:
                self._health_dirty.set()

    async def _health_loop(self) -> None:
        backoff = Backoff()
        while True:
            await self._health_dirty.wait()
            await asyncio.sleep(HEALTH_COALESCE_S)
            self._health_dirty.clear()
            if self._settings_stale:
                self._settings_stale = False
                await self._read_settings()
            if self.node is None:
                continue  # set again once the Node is read
            try:
                await self._publish_health()
                backoff.reset()
            except DaemonUnreachable:
                continue  # the grace loop sets the flag again
            except KubeError as exc:
                self._kube_failed("write condition or taint", exc)
                await asyncio.sleep(backoff.next())
                self._health_dirty.set()

    async def _publish_health(self) -> None:
        """gpud's health, as a remediation under way says it, onto the Node: condition and taint."""
        async with self._publishing:
            seen = self.remediation.condition(await self._gpud_verdict())
            await self._publish(seen)

    async def _gpud_verdict(self) -> Verdict:
        try:
            return verdict(await self._gpud("GET", "/v1/health"))
        except (DaemonUnreachable, ApiFailure) as exc:
            since = self._gpud_unreachable_since
            if since is not None and time.monotonic() - since >= GPUD_UNREACHABLE_GRACE_S:
                return unknown(f"gpud has not answered for {time.monotonic() - since:.0f} s: {exc}")
            raise DaemonUnreachable(str(exc)) from None

    async def _publish(self, seen: Verdict) -> None:
        current = _condition(self.node)
        if seen.differs_from(current):
            self.node = await self.api.patch_condition(seen.condition(now_rfc3339(), current))
            self._kube_ok("write condition or taint")
            log.info("gpu_condition", node=self.node_name, status=seen.status, reason=seen.reason,
                     message=seen.message)
            before = self._published or (Verdict(current["status"], current.get("reason", ""), "", False)
                                         if current else None)
            if before is None or (before.status, before.reason) != (seen.status, seen.reason):
                await self._event("Normal" if seen.status == "True" else "Warning",
                                  "GPUsHealthy" if seen.status == "True" else seen.reason, seen.message)
        self._published = seen
        self._note("health", condition=seen.status, reason=seen.reason)
        await self._reconcile_taint(self._taint_wanted())

    # -- the taint -----------------------------------------------------------------------------------

    def _taint_wanted(self) -> bool:
        """The opt-in taint while a GPU needs a person or a reset; always while a remediation holds the node."""
        return bool(self._published and self._published.taint
                    and (self.settings["taint_unhealthy"] or self.remediation.holds_taint()))

    def _taint_wrong(self, node: dict) -> bool:
        if self._published is None:
            return False
        return self._taint_change(node, self._taint_wanted()) is not None

    @staticmethod
    def _taint_change(node: dict, wanted: bool) -> list[dict] | None:
        """The Node's new taint list, or None when it needs no change. Only the agent's own taint
        (TAINT_VALUE) is ever removed; one of the same key and effect set by someone else counts as
        present and stays (two taints of one key and effect are refused: validateNodeTaints)."""
        taints = (node.get("spec") or {}).get("taints") or []
        same = [t for t in taints if t.get("key") == TAINT_KEY and t.get("effect") == TAINT_EFFECT]
        ours = [t for t in same if t.get("value") == TAINT_VALUE]
        if wanted and not same:
            return taints + [{"key": TAINT_KEY, "value": TAINT_VALUE, "effect": TAINT_EFFECT}]
        if not wanted and ours:
            return [t for t in taints if t not in ours]
        return None

    async def _reconcile_taint(self, wanted: bool) -> None:
        for _attempt in range(TAINT_ATTEMPTS):
            node = self.node or {}
            taints = self._taint_change(node, wanted)
            if taints is None:
                self._note("health", taint=wanted)
                return
            try:
                self.node = await self.api.replace_taints(taints, node["metadata"]["resourceVersion"])
            except KubeError as exc:
                if exc.status != 409:
                    raise
                log.info("taint_conflict", node=self.node_name, retrying="with the Node read again")
                self.node = await self.api.read_node()
                await asyncio.sleep(random.uniform(0.05, 0.2))
                continue
            self._kube_ok("write condition or taint")
            self._note("health", taint=wanted)
            await self._event("Warning" if wanted else "Normal", "GPUTaintAdded" if wanted else "GPUTaintRemoved",
                              f"{TAINT_KEY}={TAINT_VALUE}:{TAINT_EFFECT} "
                              + ("added: " + (self._published.message if self._published else "")
                                 if wanted else "removed: the GPUs recovered or kubernetes.taint_unhealthy is off"))
            return
        raise KubeError("patch node taints", 409, f"conflicts {TAINT_ATTEMPTS} times in a row")



async def serve(kubeconfig: Path | None, node_name: str, gpud_socket: Path | None) -> int:
    """Runs the agent until SIGTERM or SIGINT. Exit 2 when no cluster is configured."""
    import signal

    from kubernetes_asyncio.config import ConfigException

    from gpud.kubernetes.node_api import api_client

    try:
        client = await api_client(kubeconfig)
    except (ConfigException, OSError, ValueError) as exc:
        log.error("kubernetes_config_unusable", error=str(exc))
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await Agent(NodeApi(client, node_name), gpud_socket).run(stop)
    finally:
        await client.close()
    return 0
