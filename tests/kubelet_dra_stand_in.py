"""The kubelet's side of Dynamic Resource Allocation (Kubernetes 1.34-1.36), for a DRA kubelet plugin.

No kubelet runs here, so this stands in for kubernetes/kubernetes pkg/kubelet/pluginmanager (the plugin
watcher and its reconciler) and pkg/kubelet/cm/dra (the DRA manager and its DRAPluginManager), on the
real protos (gpud/dra/*.proto). Each behaviour names the source it copies; none is kinder than the kubelet.

Plugin watcher (pkg/kubelet/pluginmanager):
- The directory is <kubelet_dir>/plugins_registry, created with mode 0755 (pluginwatcher/plugin_watcher.go
  Watcher.init: MkdirAll(path, 0755)). At start it walks the tree (traversePluginDir: subdirectories too);
  afterwards fsnotify events, here a poll every POLL_S. A socket whose name starts with "." and anything
  that is not a unix socket is ignored (handleCreateEvent); a socket re-created at the same path gets a new
  timestamp (handlePluginRegistration -> desiredStateOfWorld.AddOrUpdatePlugin); a removed one leaves the
  desired state (handleDeleteEvent).
- The reconciler runs every RECONCILE_PERIOD_S, 1 s (plugin_manager.go loopSleepDuration; reconciler.go
  reconcile): first it unregisters what left the desired state or changed its timestamp, then registers
  what is missing. One operation at a time per socket, and a failed one is retried only after an
  exponential backoff, 0.5 s doubling to 2 min 2 s (operationexecutor/operation_executor.go
  goroutinemap.NewGoRoutineMap(true); pkg/util/goroutinemap/exponentialbackoff initialDurationBeforeRetry,
  maxDurationBeforeRetry): a refused plugin hears about it again and again.
- Registration (operationexecutor/operation_generator.go GenerateRegisterPluginFunc): dial, blocking,
  10 s (dialTimeoutDuration); GetInfo with a 1 s deadline; a type without a handler (only "DRAPlugin"
  has one here) is refused "RegisterPlugin error -- no handler registered for plugin type: T at socket S";
  an empty endpoint is the registration socket itself; ValidatePlugin's error is sent as "RegisterPlugin
  error -- plugin validation failed with err: ..."; the plugin enters the actual state (AddPlugin) before
  RegisterPlugin, whose error is sent as "RegisterPlugin error -- plugin registration failed with err: ..."
  (and, being in the actual state already, is not retried); then NotifyRegistrationStatus(true) - each
  notification with a 5 s deadline (notifyPlugin, notifyTimeoutDuration). Unregistering
  (GenerateUnregisterPluginFunc) removes the plugin from the actual state, then DeRegisterPlugin(name,
  endpoint).
- Not modelled: pluginwatcher/monitor.go (newer kubelets: GetInfo every 10 s on registered sockets, and
  re-registration of sockets that come back without an fsnotify event).

DRA plugin manager (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, dra_plugin.go):
- ValidatePlugin / RegisterPlugin -> validateSupportedServices: an empty supported_versions is refused
  "empty list of supported gRPC services (aka supported versions)"; otherwise the FIRST entry of the
  plugin's list that the kubelet supports is chosen (servicesSupportedByKubelet: v1.DRAPlugin,
  v1beta1.DRAPlugin since 1.34), none: "none of services supported by the plugin (%q) are supported by the
  kubelet (%q)"; both wrapped "invalid supported gRPC versions of DRA driver plugin D at endpoint E: ...".
  The kubelet does not check the driver name; this stand-in also refuses one that is not a DNS subdomain of
  at most 63 characters (k8s.io/api resource/v1 DriverNameMaxLength; such a driver could never match a
  ResourceSlice), with a reason that starts "stand-in:".
- add(): an endpoint already registered for the driver is refused "endpoint E already registered for DRA
  driver plugin D"; else one gRPC connection to "unix:" + endpoint (grpc.NewClient, connected at once by
  conn.Connect) whose state is tracked (monitoredPlugin.HandleConn: ConnBegin = connected, ConnEnd = not;
  here READY = connected); plugins of a driver are kept in registration order and calls go to the newest
  connected one, else the newest (get). remove() closes the connection and cancels the health stream.
- sync(): when a driver has no connected plugin left, its ResourceSlices are wiped (wipe(node, driver))
  after wiping_delay_s (manager.go defaultWipingDelay, 30 s), unless a wipe is pending already; a
  connected plugin cancels the pending wipe. A wipe that ran leaves the queue (tainteviction/
  timed_workers.go getWrappedWorkerFunc). Stop() closes every connection and cancels pending wipes.
- NewDRAPluginManager (called from manager.go Start -> initDRAPluginManager) wipes every ResourceSlice of
  the node (wipe(node, None): field selector spec.nodeName only) in the background at each start, racing
  the plugins' registration; a failing wipe is retried with backoff 1 s x2, jitter 0.2, cap 5 min
  (wipeResourceSlices).
- Every call has a 45 s deadline (dra_plugin.go defaultClientCallTimeout) and goes to the chosen service:
  v1 or v1beta1 (the same messages under another package).

DRA manager (pkg/kubelet/cm/dra/manager.go):
- prepareResources: claims already prepared (claimInfo.isPrepared, kept in dra_manager_state, so also
  across restart()) are not sent again; a claim of the same namespace/name with another UID is refused
  "old ResourceClaim with same name N and different UID U still exists (previous pod force-deleted?!)";
  the others are recorded (unprepared) before one NodePrepareResources call per driver. The answer fails
  with "NodePrepareResources: <grpc error>", "NodePrepareResources returned result for unknown claim UID
  U", "NodePrepareResources failed for ResourceClaim N: <error>" or "NodePrepareResources skipped K
  ResourceClaims"; only when all is well are the claims marked prepared. PrepareResources wraps it as
  "prepare dynamic resources: ..." and the pod does not start.
- unprepareResources: only claims it holds; one NodeUnprepareResources per driver; the same checks
  ("NodeUnprepareResources ..."); on success the claims leave the state. A driver without a plugin:
  "DRA driver D is not registered" (DRAPluginManager.GetPlugin).

Health (KEP-4680; dra_plugin_manager.go add, manager.go HandleWatchResourcesStream, healthinfo.go):
- 1.34-1.36 open NodeWatchResources on every registered plugin when the ResourceHealthStatus gate is on,
  whatever the plugin advertises (the pickHealthService check on supported_versions is 1.37); a plugin
  that does not serve it fails the call. Attempts repeat 5 s after the previous one ended
  (wait.UntilWithContext(..., 5*time.Second)); the stream has no deadline; deregistration cancels it.
- Each message updates the driver's cache (updateHealthInfo): a device's last update is the time the
  kubelet received it (not the plugin's last_updated_time); its timeout is health_check_timeout_seconds
  when > 0, else health_timeout_s (DefaultHealthTimeout, 30 s); older than that it reads Unknown with no
  message (getHealthInfo). Messages are cut to 1024 bytes: 1021 and "..." (dra-health v1alpha1 api.proto
  DeviceHealth.message; k8s.io/api core/v1 ResourceHealthMessageMaxLength). When a stream ends the whole
  driver's cache is cleared (clearDriver). The cache outlives restart() (dra_health_state).

Not modelled: pods (tests ask prepare/unprepare as the last pod leaving would), the reconcile loop that
retries unprepare, CDI device lists per container, pod status, the Node lookup before a wipe, metrics.
"""

from __future__ import annotations

import random
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpud.dra.api import (PLUGIN_TYPE, health_pb, health_rpc, registration_pb, registration_rpc, v1_pb, v1_rpc,
                          v1beta1_pb, v1beta1_rpc)

POLL_S = 0.1  # stands in for fsnotify
RECONCILE_PERIOD_S = 1.0  # plugin_manager.go loopSleepDuration
DIAL_TIMEOUT_S = 10.0  # operation_generator.go dialTimeoutDuration
GET_INFO_TIMEOUT_S = 1.0  # operation_generator.go: context.WithTimeout(..., time.Second)
NOTIFY_TIMEOUT_S = 5.0  # operation_generator.go notifyTimeoutDuration
BACKOFF_INITIAL_S, BACKOFF_MAX_S = 0.5, 122.0  # goroutinemap/exponentialbackoff
CALL_TIMEOUT_S = 45.0  # dra_plugin.go defaultClientCallTimeout
HEALTH_RETRY_S = 5.0  # dra_plugin_manager.go add: wait.UntilWithContext(..., 5*time.Second)
HEALTH_MESSAGE_MAX = 1024  # k8s.io/api core/v1 ResourceHealthMessageMaxLength
DRIVER_NAME_MAX = 63  # k8s.io/api resource/v1 DriverNameMaxLength
V1, V1BETA1 = "v1.DRAPlugin", "v1beta1.DRAPlugin"
HEALTHY, UNHEALTHY, UNKNOWN = "Healthy", "Unhealthy", "Unknown"
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class KubeletDraError(Exception):
    """What the kubelet would log and put into the pod's events: the pod does not start (or stop)."""


@dataclass(frozen=True)
class Registration:
    socket: str
    name: str
    endpoint: str
    service: str  # the chosen DRAPlugin service
    versions: tuple[str, ...]  # PluginInfo.supported_versions as the plugin sent them
    at: float  # time.monotonic()


@dataclass(frozen=True)
class Rejection:
    socket: str
    reason: str  # what NotifyRegistrationStatus carried (or the dial / GetInfo error, when nothing was sent)
    at: float


@dataclass(frozen=True)
class HealthInfo:
    health: str  # Healthy, Unhealthy or Unknown
    message: str
    last_updated: float  # time.time() when the kubelet received it
    timeout_s: float


@dataclass(frozen=True)
class HealthMessage:
    driver: str
    endpoint: str
    at: float  # time.monotonic() at receipt
    wall: float  # time.time() at receipt
    # (pool, device, health, message, last_updated_time, health_check_timeout_seconds) as received
    devices: tuple[tuple[str, str, str, str, int, int], ...]


@dataclass
class PreparedClaim:
    namespace: str
    name: str
    uid: str
    driver: str
    prepared: bool = False
    devices: list = field(default_factory=list)  # the Device messages of the answer


@dataclass(eq=False)
class _Plugin:
    driver: str
    endpoint: str
    service: str
    versions: tuple[str, ...]
    channel: grpc.Channel
    registered_at: float  # time.monotonic()
    connected: bool = False
    closed: bool = False
    health_cancel: threading.Event = field(default_factory=threading.Event)
    health_call: object = None
    health_thread: threading.Thread | None = None


@dataclass
class _Asw:  # cache.PluginInfo of the actual state of world
    socket: str
    timestamp: tuple
    name: str
    endpoint: str


def go_quote_list(values) -> str:
    """fmt's %q of a []string: ["a" "b"]."""
    return "[" + " ".join('"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values) + "]"


def truncate_health_message(message: str) -> str:
    raw = message.encode()
    if len(raw) <= HEALTH_MESSAGE_MAX:
        return message
    return raw[:HEALTH_MESSAGE_MAX - 3].decode(errors="ignore") + "..."  # a cut rune is dropped


class DraKubelet:
    """The DRA side of one kubelet on node `node_name`. `wipe(node, driver)` stands in for deleting the
    node's ResourceSlices (driver None: all of them); an exception from it is a failed delete, retried.
    `supported_services`: the kubelet's servicesSupportedByKubelet; `resource_health_status`: its
    ResourceHealthStatus feature gate."""

    def __init__(self, kubelet_dir: Path, node_name: str, wipe: Callable[[str, str | None], None] | None = None,
                 supported_services=(V1, V1BETA1), wiping_delay_s: float = 30.0, health_timeout_s: float = 30.0,
                 resource_health_status: bool = True):
        self.kubelet_dir = Path(kubelet_dir)
        self.registry = self.kubelet_dir / "plugins_registry"
        self.node_name = node_name
        self._wipe = wipe
        self.supported_services = tuple(supported_services)
        self.wiping_delay_s = wiping_delay_s
        self.health_timeout_s = health_timeout_s
        self.resource_health_status = resource_health_status
        self._cond = threading.Condition()
        # what tests read
        self.attempts: list[tuple[str, float]] = []  # (socket, time.monotonic()) of each registration attempt
        self.registrations: list[Registration] = []
        self.rejections: list[Rejection] = []
        self.deregistrations: list[tuple[str, str, float]] = []  # (driver, endpoint, time.monotonic())
        self.wipes: list[tuple[str | None, float]] = []  # (driver or None, time.monotonic()) of each done wipe
        self.health_messages: list[HealthMessage] = []
        self.health_stream_errors: list[tuple[str, str, float]] = []  # (driver, error, time.monotonic())
        self.calls: list[tuple[str, str, float | None]] = []  # (method, service, deadline sent)
        self.claims: dict[str, PreparedClaim] = {}  # dra_manager_state: uid -> claim; outlives restart()
        self._health: dict[str, dict[str, HealthInfo]] = {}  # dra_health_state: driver -> pool/device -> info
        self._running = False
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._stopping = threading.Event()
        self._dsw: dict[str, tuple] = {}  # socket -> timestamp (here: the socket file's identity, not chmod's)
        self._asw: dict[str, _Asw] = {}
        self._pending: set[str] = set()  # sockets with an operation running
        self._backoff: dict[str, tuple[float, float]] = {}  # socket -> (last error at, duration before retry)
        self._store: dict[str, list[_Plugin]] = {}
        self._wipe_timers: dict[str, threading.Timer] = {}
        self._threads: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> DraKubelet:
        with self._cond:
            if self._running:
                raise RuntimeError("the DRA kubelet stand-in runs already")
            self._reset_runtime()
            self._running = True
        self.registry.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._spawn(self._startup_wipe, "dra-kubelet-startup-wipe")
        self._scan()  # traversePluginDir before the watcher goroutine starts
        self._spawn(self._watch, "dra-kubelet-watcher")
        return self

    def stop(self) -> None:
        with self._cond:
            if not self._running:
                return
            self._running = False
            self._stopping.set()
            timers, self._wipe_timers = list(self._wipe_timers.values()), {}
            plugins = [p for ps in self._store.values() for p in ps]
            self._store = {}
            for plugin in plugins:
                plugin.closed = True
                plugin.health_cancel.set()
            self._cond.notify_all()
        for timer in timers:  # DRAPluginManager.Stop: cancel pending wipes, close every connection
            timer.cancel()
        for plugin in plugins:
            self._close(plugin)
        for thread in self._threads:
            thread.join(DIAL_TIMEOUT_S + NOTIFY_TIMEOUT_S)
        for plugin in plugins:
            if plugin.health_thread is not None:
                plugin.health_thread.join(5.0)
        for timer in timers:
            timer.join(5.0)

    def restart(self) -> None:
        """The kubelet stops and starts again: connections go, prepared claims and health cache stay."""
        self.stop()
        self.start()

    def __enter__(self) -> DraKubelet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, target, name: str, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._cond:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()
        return thread

    # -- wiping ResourceSlices -------------------------------------------------------------------

    def _startup_wipe(self) -> None:
        stopping = self._stopping
        delay = 1.0
        for _ in range(100):  # wait.Backoff{Duration: 1 s, Factor: 2, Jitter: 0.2, Cap: 5 min, Steps: 100}
            if stopping.is_set() or self._do_wipe(None):
                return
            if stopping.wait(delay * (1 + 0.2 * random.random())):
                return
            delay = min(delay * 2, 300.0)

    def _do_wipe(self, driver: str | None) -> bool:
        try:
            if self._wipe is not None:
                self._wipe(self.node_name, driver)
        except Exception:  # noqa: BLE001 - a failed DeleteCollection: retried
            return False
        with self._cond:
            self.wipes.append((driver, time.monotonic()))
            self._cond.notify_all()
        return True

    def _sync(self, driver: str) -> None:
        """dra_plugin_manager.go sync; the lock is held."""
        if self._stopping.is_set():
            return
        if any(p.connected for p in self._store.get(driver, [])):
            timer = self._wipe_timers.pop(driver, None)
            if timer is not None:
                timer.cancel()
            return
        if driver in self._wipe_timers:
            return
        stopping = self._stopping

        def fire():
            with self._cond:
                if self._wipe_timers.get(driver) is not timer or stopping.is_set():
                    return
            self._wipe_driver(driver, stopping)
            with self._cond:
                if self._wipe_timers.get(driver) is timer:
                    del self._wipe_timers[driver]

        timer = threading.Timer(self.wiping_delay_s, fire)
        timer.daemon = True
        self._wipe_timers[driver] = timer
        timer.start()

    def _wipe_driver(self, driver: str, stopping: threading.Event) -> None:
        delay = 1.0
        for _ in range(100):
            if stopping.is_set() or self._do_wipe(driver):
                return
            if stopping.wait(delay * (1 + 0.2 * random.random())):
                return
            delay = min(delay * 2, 300.0)

    # -- plugin watcher and reconciler -----------------------------------------------------------

    def _scan(self) -> None:
        found: dict[str, tuple] = {}

        def walk(directory: Path) -> None:
            try:
                entries = list(directory.iterdir())
            except OSError:
                return
            for entry in entries:
                try:
                    st = entry.lstat()
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    walk(entry)
                elif stat.S_ISSOCK(st.st_mode) and not entry.name.startswith("."):
                    found[str(entry)] = (st.st_dev, st.st_ino, st.st_mtime_ns)  # a new socket: new identity

        walk(self.registry)
        with self._cond:
            if self._dsw != found:
                self._dsw = found
                self._cond.notify_all()

    def _watch(self) -> None:
        stopping = self._stopping
        next_reconcile = time.monotonic()
        while not stopping.is_set():
            self._scan()
            if time.monotonic() >= next_reconcile:
                self._reconcile()
                next_reconcile = time.monotonic() + RECONCILE_PERIOD_S
            stopping.wait(POLL_S)

    def _may_run(self, socket: str) -> bool:
        """goroutinemap.Run: one operation per socket, none before its backoff passed; lock held."""
        if socket in self._pending:
            return False
        last = self._backoff.get(socket)
        if last is not None and time.monotonic() - last[0] <= last[1]:
            return False
        self._pending.add(socket)
        return True

    def _done(self, socket: str, failed: bool) -> None:
        with self._cond:
            self._pending.discard(socket)
            if failed:
                last = self._backoff.get(socket)
                duration = BACKOFF_INITIAL_S if last is None else min(2 * last[1], BACKOFF_MAX_S)
                self._backoff[socket] = (time.monotonic(), duration)
            else:
                self._backoff.pop(socket, None)
            self._cond.notify_all()

    def _reconcile(self) -> None:
        with self._cond:
            if self._stopping.is_set():
                return
            leaving = [a for a in self._asw.values()
                       if a.socket not in self._dsw or self._dsw[a.socket] != a.timestamp]
            leaving = [a for a in leaving if self._may_run(a.socket)]
        for info in leaving:
            self._unregister(info)
        with self._cond:
            coming = [(s, ts) for s, ts in self._dsw.items()
                      if not (s in self._asw and self._asw[s].timestamp == ts) and self._may_run(s)]
        for socket, timestamp in coming:
            self._spawn(self._register, "dra-kubelet-register", socket, timestamp)

    def _unregister(self, info: _Asw) -> None:
        with self._cond:
            self._asw.pop(info.socket, None)
        self._deregister_plugin(info.name, info.endpoint)
        self._done(info.socket, failed=False)

    def _register(self, socket: str, timestamp: tuple) -> None:
        failed = True
        try:
            failed = not self._register_plugin(socket, timestamp)
        finally:
            self._done(socket, failed)

    def _reject(self, socket: str, reason: str) -> None:
        with self._cond:
            self.rejections.append(Rejection(socket, reason, time.monotonic()))
            self._cond.notify_all()

    def _register_plugin(self, socket: str, timestamp: tuple) -> bool:
        with self._cond:
            self.attempts.append((socket, time.monotonic()))
            self._cond.notify_all()
        channel = grpc.insecure_channel(f"unix:{socket}")
        try:
            ready = grpc.channel_ready_future(channel)
            deadline = time.monotonic() + DIAL_TIMEOUT_S
            while True:
                try:
                    ready.result(timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))
                    break
                except grpc.FutureTimeoutError:
                    if self._stopping.is_set() or time.monotonic() >= deadline:
                        ready.cancel()
                        self._reject(socket, f"RegisterPlugin error -- dial failed at socket {socket}, err: "
                                             "context deadline exceeded")
                        return False
            client = registration_rpc.RegistrationStub(channel)
            try:
                info = client.GetInfo(registration_pb.InfoRequest(), timeout=GET_INFO_TIMEOUT_S)
            except grpc.RpcError as exc:
                self._reject(socket, "RegisterPlugin error -- failed to get plugin info using RPC GetInfo at "
                                     f"socket {socket}, err: {_status(exc)}")
                return False

            def notify(registered: bool, error: str) -> bool:
                try:
                    client.NotifyRegistrationStatus(registration_pb.RegistrationStatus(
                        plugin_registered=registered, error=error), timeout=NOTIFY_TIMEOUT_S)
                    return True
                except grpc.RpcError:
                    return False

            if info.type != PLUGIN_TYPE:
                reason = (f"RegisterPlugin error -- no handler registered for plugin type: {info.type} at socket "
                          f"{socket}")
                notify(False, reason)
                self._reject(socket, reason)
                return False
            endpoint = info.endpoint or socket
            versions = tuple(info.supported_versions)
            service, error = self._validate(info.name, endpoint, versions)
            if error:
                reason = f"RegisterPlugin error -- plugin validation failed with err: {error}"
                notify(False, reason)
                self._reject(socket, reason)
                return False
            with self._cond:  # AddPlugin before RegisterPlugin
                if self._stopping.is_set():
                    return False
                self._asw[socket] = _Asw(socket, timestamp, info.name, endpoint)
            error = self._add(socket, info.name, endpoint, service, versions)
            if error:
                reason = f"RegisterPlugin error -- plugin registration failed with err: {error}"
                notify(False, reason)
                self._reject(socket, reason)
                return False
            return notify(True, "")
        finally:
            channel.close()

    def _validate(self, driver: str, endpoint: str, versions: tuple[str, ...]) -> tuple[str, str]:
        """validateSupportedServices, and this stand-in's driver name check."""
        prefix = f"invalid supported gRPC versions of DRA driver plugin {driver} at endpoint {endpoint}: "
        if not versions:
            return "", prefix + "empty list of supported gRPC services (aka supported versions)"
        chosen = next((v for v in versions if v in self.supported_services), "")
        if not chosen:
            return "", prefix + (f"none of services supported by the plugin ({go_quote_list(versions)}) are "
                                 f"supported by the kubelet ({go_quote_list(self.supported_services)})")
        if len(driver) > DRIVER_NAME_MAX or not _DNS_SUBDOMAIN.fullmatch(driver):
            return "", (f"stand-in: driver name {driver!r} is not a DNS subdomain of at most {DRIVER_NAME_MAX} "
                        "characters (no ResourceSlice could name it)")
        return chosen, ""

    def _add(self, socket: str, driver: str, endpoint: str, service: str, versions: tuple[str, ...]) -> str:
        with self._cond:
            if self._stopping.is_set():
                return "the kubelet is stopping"
            if any(p.endpoint == endpoint for p in self._store.get(driver, [])):
                return f"endpoint {endpoint} already registered for DRA driver plugin {driver}"
            plugin = _Plugin(driver, endpoint, service, versions, grpc.insecure_channel(f"unix:{endpoint}"),
                             time.monotonic())
            self._store.setdefault(driver, []).append(plugin)
            self.registrations.append(Registration(socket, driver, endpoint, service, versions, plugin.registered_at))
            self._sync(driver)
            self._cond.notify_all()

        def on_state(state: grpc.ChannelConnectivity) -> None:  # monitoredPlugin.HandleConn
            connected = state == grpc.ChannelConnectivity.READY
            with self._cond:
                if plugin.closed or plugin.connected == connected:
                    return
                plugin.connected = connected
                self._sync(driver)
                self._cond.notify_all()

        plugin.channel.subscribe(on_state, try_to_connect=True)
        if self.resource_health_status:
            plugin.health_thread = threading.Thread(target=self._health_loop, args=(plugin,),
                                                    name="dra-kubelet-health", daemon=True)
            plugin.health_thread.start()
        return ""

    def _deregister_plugin(self, driver: str, endpoint: str) -> None:
        """dra_plugin_manager.go remove."""
        with self._cond:
            plugins = self._store.get(driver, [])
            plugin = next((p for p in plugins if p.endpoint == endpoint), None)
            if plugin is None:
                return
            plugins.remove(plugin)
            if not plugins:
                del self._store[driver]
            plugin.closed = True
            plugin.health_cancel.set()
            self.deregistrations.append((driver, endpoint, time.monotonic()))
            self._sync(driver)
            self._cond.notify_all()
        self._close(plugin)

    @staticmethod
    def _close(plugin: _Plugin) -> None:
        call = plugin.health_call
        if call is not None:
            call.cancel()
        plugin.channel.close()

    # -- health ----------------------------------------------------------------------------------

    def _health_loop(self, plugin: _Plugin) -> None:
        stub = health_rpc.DRAResourceHealthStub(plugin.channel)
        while not plugin.health_cancel.is_set():
            try:
                call = stub.NodeWatchResources(health_pb.NodeWatchResourcesRequest())
                plugin.health_call = call
                if plugin.health_cancel.is_set():
                    call.cancel()
                for answer in call:
                    self._health_update(plugin, answer)
                error = "EOF"
            except (grpc.RpcError, ValueError) as exc:
                error = _status(exc) if isinstance(exc, grpc.RpcError) else repr(exc)
            finally:
                plugin.health_call = None
            with self._cond:  # HandleWatchResourcesStream's deferred clearDriver
                self._health.pop(plugin.driver, None)
                self.health_stream_errors.append((plugin.driver, error, time.monotonic()))
                self._cond.notify_all()
            plugin.health_cancel.wait(HEALTH_RETRY_S)

    def _health_update(self, plugin: _Plugin, answer) -> None:
        """HandleWatchResourcesStream and healthInfoCache.updateHealthInfo."""
        now, wall = time.monotonic(), time.time()
        names = {health_pb.HEALTHY: HEALTHY, health_pb.UNHEALTHY: UNHEALTHY}
        devices = []
        with self._cond:
            cache = self._health.setdefault(plugin.driver, {})
            reported = set()
            for d in answer.devices:
                timeout = float(d.health_check_timeout_seconds) if d.health_check_timeout_seconds > 0 \
                    else self.health_timeout_s
                health = names.get(d.health, UNKNOWN)
                message = truncate_health_message(d.message)
                key = f"{d.device.pool_name}/{d.device.device_name}"
                reported.add(key)
                cache[key] = HealthInfo(health, message, wall, timeout)
                devices.append((d.device.pool_name, d.device.device_name, health, message, d.last_updated_time,
                                d.health_check_timeout_seconds))
            for key, info in list(cache.items()):  # phase 2: unreported and timed out -> Unknown
                if key not in reported and info.health != UNKNOWN and wall - info.last_updated > info.timeout_s:
                    cache[key] = HealthInfo(UNKNOWN, "", wall, info.timeout_s)
            self.health_messages.append(HealthMessage(plugin.driver, plugin.endpoint, now, wall, tuple(devices)))
            self._cond.notify_all()

    def health_info(self, pool: str, device: str, driver: str | None = None) -> HealthInfo:
        """healthInfoCache.getHealthInfo: Unknown when not known or older than its timeout."""
        with self._cond:
            drivers = [driver] if driver is not None else list(self._health)
            for name in drivers:
                info = self._health.get(name, {}).get(f"{pool}/{device}")
                if info is None:
                    continue
                if time.time() - info.last_updated > info.timeout_s:
                    return HealthInfo(UNKNOWN, "", info.last_updated, info.timeout_s)
                return info
            return HealthInfo(UNKNOWN, "", 0.0, self.health_timeout_s)

    def health(self, pool: str, device: str, driver: str | None = None) -> str:
        return self.health_info(pool, device, driver).health

    # -- prepare / unprepare ---------------------------------------------------------------------

    def _plugin(self, driver: str | None) -> _Plugin:
        """DRAPluginManager.GetPlugin: the newest connected plugin of the driver, else the newest."""
        with self._cond:
            if driver is None:
                if len(self._store) != 1:
                    raise KubeletDraError(f"name the driver: registered are {sorted(self._store)}")
                driver = next(iter(self._store))
            plugins = self._store.get(driver)
            if not driver:
                raise KubeletDraError("DRA driver name is empty")
            if not plugins:
                raise KubeletDraError(f"DRA driver {driver} is not registered")
            return next((p for p in reversed(plugins) if p.connected), plugins[-1])

    def _call(self, plugin: _Plugin, method: str, claims: list[tuple[str, str, str]]):
        pb, rpc = (v1_pb, v1_rpc) if plugin.service == V1 else (v1beta1_pb, v1beta1_rpc)
        stub = rpc.DRAPluginStub(plugin.channel)
        wire = [pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        with self._cond:
            self.calls.append((method, plugin.service, CALL_TIMEOUT_S))
        if method == "NodePrepareResources":
            return stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=wire), timeout=CALL_TIMEOUT_S)
        return stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=wire), timeout=CALL_TIMEOUT_S)

    def _answered(self, plugin: _Plugin, method: str, claims: list[tuple[str, str, str]]):
        """The call's answer, refused as the kubelet refuses it: a gRPC error, a result for a claim it did not
        send, a claim's error (manager.go prepareResources / unprepareResources)."""
        try:
            answer = self._call(plugin, method, claims)
        except grpc.RpcError as exc:
            raise KubeletDraError(f"{method}: {_status(exc)}") from exc
        sent = {uid: name for _, name, uid in claims}
        for uid, result in answer.claims.items():
            if uid not in sent:
                raise KubeletDraError(f"{method} returned result for unknown claim UID {uid}")
            if result.error:
                raise KubeletDraError(f"{method} failed for ResourceClaim {sent[uid]}: {result.error}")
        return answer

    def prepare(self, claims: list[tuple[str, str, str]], driver: str | None = None) -> dict:
        """prepareResources for claims (namespace, name, uid) of one driver: the answer's map (uid ->
        NodePrepareResourceResponse) of the claims sent; those prepared before are not sent. Raises
        KubeletDraError as the kubelet fails the pod's start."""
        try:
            plugin = self._plugin(driver)
            with self._cond:
                send = []
                for namespace, name, uid in claims:
                    held = next((c for c in self.claims.values() if (c.namespace, c.name) == (namespace, name)),
                                None)
                    if held is not None and held.uid != uid:
                        raise KubeletDraError(f"old ResourceClaim with same name {name} and different UID "
                                              f"{held.uid} still exists (previous pod force-deleted?!)")
                    if held is None:
                        self.claims[uid] = PreparedClaim(namespace, name, uid, plugin.driver)
                    elif held.prepared:
                        continue
                    send.append((namespace, name, uid))
            if not send:
                return {}
            answer = self._answered(plugin, "NodePrepareResources", send)
            sent = {uid for _, _, uid in send}
            with self._cond:
                for uid, result in answer.claims.items():
                    self.claims[uid].devices.extend(result.devices)
            if len(send) != len(answer.claims):
                raise KubeletDraError(f"NodePrepareResources skipped {len(send) - len(answer.claims)} "
                                      "ResourceClaims")
            with self._cond:
                for uid in sent:
                    self.claims[uid].prepared = True
                self._cond.notify_all()
            return dict(answer.claims)
        except KubeletDraError as exc:
            raise KubeletDraError(f"prepare dynamic resources: {exc}") from exc

    def unprepare(self, claims: list[tuple[str, str, str]]) -> dict:
        """unprepareResources for claims (namespace, name, uid) whose last pod left: those the kubelet
        holds, one call per driver; they leave the state on success. Returns the answers' maps."""
        try:
            with self._cond:
                batches: dict[str, list[tuple[str, str, str]]] = {}
                for namespace, name, _ in claims:
                    held = next((c for c in self.claims.values() if (c.namespace, c.name) == (namespace, name)),
                                None)
                    if held is not None:
                        batches.setdefault(held.driver, []).append((held.namespace, held.name, held.uid))
            answers = {}
            for driver, batch in batches.items():
                plugin = self._plugin(driver)
                answer = self._answered(plugin, "NodeUnprepareResources", batch)
                if len(batch) != len(answer.claims):
                    raise KubeletDraError(f"NodeUnprepareResources skipped {len(batch) - len(answer.claims)} "
                                          "ResourceClaims")
                answers.update(answer.claims)
            with self._cond:
                for batch in batches.values():
                    for _, _, uid in batch:
                        self.claims.pop(uid, None)
                self._cond.notify_all()
            return answers
        except KubeletDraError as exc:
            raise KubeletDraError(f"unprepare dynamic resources: {exc}") from exc

    # -- what tests ask --------------------------------------------------------------------------

    def registered(self, driver: str) -> list[tuple[str, str, bool]]:
        """The driver's plugins now: (endpoint, chosen service, connected), oldest first."""
        with self._cond:
            return [(p.endpoint, p.service, p.connected) for p in self._store.get(driver, [])]

    def connected(self, driver: str, since: float = float("-inf")) -> bool:
        """Whether a plugin of driver that registered at or after since (time.monotonic()) is connected. A
        test that (re)starts a plugin passes when it did: a killed plugin stays registered until its
        successor's registration replaces it, and its channel can read READY for a while after the kill."""
        with self._cond:
            return any(p.connected and p.registered_at >= since for p in self._store.get(driver, []))

    def wipe_pending(self, driver: str) -> bool:
        with self._cond:
            return driver in self._wipe_timers

    def prepared(self, uid: str) -> bool:
        with self._cond:
            claim = self.claims.get(uid)
            return claim is not None and claim.prepared

    def wait(self, predicate, timeout: float = 10.0, what: str = "condition"):
        with self._cond:
            if not self._cond.wait_for(predicate, timeout):
                raise AssertionError(
                    f"DRA kubelet stand-in: timed out waiting for {what}; registrations "
                    f"{[(r.name, r.service) for r in self.registrations]}, rejections "
                    f"{[r.reason for r in self.rejections[-3:]]}, plugins "
                    f"{ {d: [(p.endpoint, p.connected) for p in ps] for d, ps in self._store.items()} }, "
                    f"wipes {self.wipes}")
            return predicate()


def _status(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"rpc error: code = {code.name.title().replace('_', '') if code else 'Unknown'} desc = {details}"
