"""Keeps the device plugin's NodeState current from gpud's socket.

/v1/watch says when something changed (any event: health, mig, mps, sharing, inventory); each change
re-reads /v1/sharing, /v1/cdi and the MPS client environments, coalescing bursts into one read. Every
(re)connect re-reads too, so nothing is missed across a gpud restart (a new event epoch). While gpud
is unreachable the last state stays; past `unreachable_grace_s` its devices are reported Unhealthy,
since nothing then vouches for them, and they come back with gpud.

The stream is read by the standard-library client in a thread of its own (only gpud/api speaks
HTTP through aiohttp): it stays blocked in a read, so it is a daemon thread, not the loop's executor.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpud.base.logs import get_logger
from gpud.client import ApiFailure, Client, DaemonUnreachable, follow_stream
from gpud.device_plugin.state import (NodeState, claimed_devices, counted_shares, mps_client, nvlink_peers,
                                      resources_from_sharing, without_claimed)

log = get_logger("device_plugin")

REQUEST_TIMEOUT_S = 10.0
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.2, 5.0
# While gpud's CDI spec lacks some of the devices read, they are read again after this, then twice as
# long each time up to BACKOFF_MAX_S: the spec follows its change within a second (gpud/kept_writer.py).
CDI_CATCH_UP_S = 0.25
# An epoch that is no gpud run's: gpud answers with a `gap` line at once, then every event of its run
# it still holds. So each (re)connect gets a first line that starts a read, and misses nothing.
WATCH_FROM_THE_START = "/v1/watch?since=0&epoch=gpud-device-plugin"
DEFAULT_UNREACHABLE_GRACE_S = 30.0  # a gpud restart (systemd) takes seconds: no need to fence the node for it


class GpudFollower:
    ignored_events = frozenset({"heartbeat"})  # events that change nothing the follower reads

    def __init__(self, socket_path: Path | None, publish: Callable[[NodeState], Awaitable[None]],
                 unreachable_grace_s: float = DEFAULT_UNREACHABLE_GRACE_S):
        self.client = Client(socket_path, timeout=REQUEST_TIMEOUT_S)
        self._publish = publish
        self.unreachable_grace_s = unreachable_grace_s
        self.state: NodeState | None = None
        self.epoch: str | None = None
        self._stale = asyncio.Event()  # something changed since the last read
        self._unreachable_since: float | None = None  # since when gpud has not answered
        self._fenced = False  # the last published state is the all-Unhealthy one
        self._cdi_catch_up_s = CDI_CATCH_UP_S

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=follow_stream, name="gpud-watch", daemon=True,
                         args=(self.client, WATCH_FROM_THE_START, loop, self._on_event, self._on_disconnect,
                               (BACKOFF_FIRST_S, BACKOFF_MAX_S))).start()
        await asyncio.gather(self._refresh_loop(), self._fence_loop())

    # -- the watch stream (read in a thread: gpud.client.follow_stream) ---------------------------

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("epoch") != self.epoch:
            log.info("gpud_connected" if self.epoch is None else "gpud_restarted",
                     socket=str(self.client.socket_path), old_epoch=self.epoch, epoch=event.get("epoch"))
            self.epoch = event.get("epoch")
        if event.get("type") not in self.ignored_events:
            self._stale.set()

    def _on_disconnect(self, reason: str, retry_in_s: float) -> None:
        if self._unreachable_since is None:
            self._unreachable_since = time.monotonic()
            log.warning("gpud_unreachable", socket=str(self.client.socket_path), reason=reason,
                        keeping="the last device list", unhealthy_after_s=self.unreachable_grace_s)
        else:
            log.debug("gpud_still_unreachable", reason=reason, retry_in_s=retry_in_s)

    # -- reading the state -----------------------------------------------------------------------

    async def _refresh_loop(self) -> None:
        while True:
            await self._stale.wait()
            self._stale.clear()
            try:
                state = await asyncio.to_thread(self.read_state)
            except (DaemonUnreachable, ApiFailure, KeyError, TypeError, ValueError) as exc:
                log.warning("gpud_state_not_read", reason=str(exc), keeping="the last device list")
                continue  # the stream breaks off too, and its reconnect asks again
            if self._unreachable_since is not None:
                log.info("gpud_reachable", after_s=round(time.monotonic() - self._unreachable_since, 1),
                         devices=state.device_count())
                self._unreachable_since = None
            self._fenced = False
            self.state = state
            await self._publish(state)
            self._catch_up_with_cdi(state)

    def lags(self, state: NodeState) -> bool:
        """Whether what was read lags gpud, so a read is due soon: the CDI spec the devices are named by."""
        return state.cdi_behind()

    def _catch_up_with_cdi(self, state: NodeState) -> None:
        """Reads again while the CDI spec lags the devices, or an allocation naming them by CDI is refused
        until some unrelated event comes (tests/test_device_plugin.py, replicas of MIG devices)."""
        if not self.lags(state):
            self._cdi_catch_up_s = CDI_CATCH_UP_S
            return
        asyncio.get_running_loop().call_later(self._cdi_catch_up_s, self._stale.set)
        self._cdi_catch_up_s = min(self._cdi_catch_up_s * 2, BACKOFF_MAX_S)

    def read_state(self) -> NodeState:
        sharing = self.client.get("/v1/sharing")
        gpus = self.client.get("/v1/gpus")
        status, claims = self.client.request("GET", "/v1/claims", ok_statuses=(404,))  # 404: a gpud without DRA holds
        claimed = claimed_devices(claims) if status == 200 else {}
        counted = counted_shares(claims) if status == 200 else frozenset()
        resources = without_claimed(resources_from_sharing(sharing, gpus), claimed, counted)
        status, cdi = self.client.request("GET", "/v1/cdi", ok_statuses=(404, 503))  # 404: a gpud without CDI
        written = status == 200 and cdi["enabled"] and cdi["written_at"] is not None
        pending = status == 200 and cdi["enabled"] and not written
        cdi_kind, cdi_names = (cdi["kind"], frozenset(cdi["devices"])) if written else (None, frozenset())
        mps_clients = {}
        if any(r.served_by_mps for r in resources.values()):
            for daemon in self.client.get("/v1/mps")["daemons"]:
                client = mps_client(self.client.get(f"/v1/mps/{urllib.parse.quote(daemon['name'])}/client-env"))
                mps_clients.update({uuid: client for uuid in daemon["devices"]})
        return NodeState(resources, cdi_kind, cdi_names, mps_clients, sharing.get("error"), nvlink_peers(gpus), claimed,
                         counted, cdi_pending=pending)

    async def _fence_loop(self) -> None:
        """Reports every device Unhealthy once gpud has been unreachable past the grace period."""
        while True:
            await asyncio.sleep(min(1.0, self.unreachable_grace_s / 4 or 0.05))
            since = self._unreachable_since
            if (since is not None and not self._fenced and self.state is not None
                    and time.monotonic() - since >= self.unreachable_grace_s):
                self._fenced = True
                log.error("devices_unhealthy_gpud_unreachable", unreachable_s=round(time.monotonic() - since, 1),
                          devices=self.state.device_count())
                await self._publish(self.state.all_unhealthy())
