"""What several test modules share: the repository, gpud run in-process or as a real process, the CLI,
config writers for simulated nodes, users for access tests, MPS daemons. Fixtures are in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import inspect
import json
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp

from gpud.client import Client, DaemonUnreachable
from gpud.config import Config
from gpud.daemon import Daemon
from gpud.mps.control import MpsControl, MpsDirectories

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI") == "true"
SHARED = REPO.parent / "shared"  # NVIDIA's real components and the reference notes; CI always has it
MOCK_NVML_CONFIGS = SHARED / "nvidia-mock-nvml" / "src" / "pkg" / "gpu" / "mocknvml" / "configs"
SYSTEM_PATH = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # useradd, nsenter… live in the sbin directories
MPS_CONTROL = shutil.which("nvidia-cuda-mps-control")
# Tests run in parallel processes (pytest-xdist): user and group changes take turns, because
# useradd/groupadd refuse to run while another one holds /etc/passwd.
ACCOUNTS_LOCK = Path("/tmp/gpud-tests-accounts.lock")


@contextlib.contextmanager
def accounts_lock():
    with ACCOUNTS_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# -- deadlines: every wait of a test ends, and says what it waited for ---------------------------


def until(predicate, timeout: float = 5.0, what: str = "condition", interval: float = 0.01):
    """predicate()'s first truthy answer, asked every interval; fails the test after timeout seconds,
    naming what it waited for and the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        time.sleep(interval)


async def until_async(check, timeout: float = 5.0, what: str = "condition", interval: float = 0.02):
    """until() on the event loop: check() may answer directly or with an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval)


def asleep_in(thread: threading.Thread, function: str) -> bool:
    """Whether thread sleeps on a lock or a condition (its innermost Python frame is threading's wait)
    inside a call of function: the state to wait for before a test wakes it, observed, not guessed."""
    frame, names = sys._current_frames().get(thread.ident), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return bool(names) and names[0] == "wait" and function in names


class Lines:
    """A child's output stream (text or bytes), read on a thread of its own so that every read has a
    deadline: a line that never comes fails the test, saying what was awaited and what came before."""

    def __init__(self, stream, name: str = "output"):
        self.name = name
        self.seen: list = []
        self._empty = stream.read(0)  # "" or b"": what the stream's lines are made of
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), name=f"lines of {name}", daemon=True).start()

    def _pump(self, stream) -> None:
        try:
            for line in stream:
                self._lines.put(line)
        except ValueError:  # the stream was closed under the reader
            pass
        finally:
            self._lines.put(None)  # the end of the stream

    def _take(self, deadline: float, what: str):
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"{self.name}: no {what} in time; the last lines: {self.seen[-5:]!r}") from None
        if line is not None:
            self.seen.append(line)
        else:
            self._lines.put(None)  # it stays ended for the next read
        return line

    def next(self, what: str = "line", timeout: float = 10.0):
        """The next line, within timeout seconds."""
        line = self._take(time.monotonic() + timeout, what)
        if line is None:
            raise AssertionError(f"{self.name} ended before its {what}; the last lines: {self.seen[-5:]!r}")
        return line

    def until(self, wanted, what: str, timeout: float = 10.0):
        """The first line from here on for which wanted(line) holds, within timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            line = self._take(deadline, what)
            if line is None:
                raise AssertionError(f"{self.name} ended before {what}; the last lines: {self.seen[-5:]!r}")
            if wanted(line):
                return line

    def rest(self, timeout: float = 10.0):
        """Every line still to come, up to the end of the stream, within timeout seconds."""
        deadline, lines = time.monotonic() + timeout, []
        while (line := self._take(deadline, "end of the stream")) is not None:
            lines.append(line)
        return self._empty.join(lines)


def need(condition: bool, why: str) -> None:
    """Skips the test where what it needs is missing (a clone without ../shared, no root); under
    CI=true, which always has it, fails it instead."""
    import pytest
    if not condition:
        if IN_CI:
            pytest.fail(f"CI has it, but: {why}")
        pytest.skip(why)


def mock_nvml_library() -> Path:
    """NVIDIA's mock libnvidia-ml (../shared/nvidia-mock-nvml), built once for every test that loads it
    (about 2 minutes the first time; the build script keeps what it built). Parallel test processes take
    turns: two builds into one folder would race."""
    build = SHARED / "nvidia-mock-nvml" / "build"
    need(build.exists(), f"{build} is absent")
    out = Path("/tmp/gpud-tests-mock-nvml")
    with open(f"{out}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = subprocess.run([str(build), str(out)], capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stdout + built.stderr
    return out


def mock_nvml_config(name: str) -> dict:
    """One of NVIDIA's mock NVML configs (`mock-nvml-config-<name>.yaml`), as a document to change."""
    import yaml

    path = MOCK_NVML_CONFIGS / f"mock-nvml-config-{name}.yaml"
    need(path.exists(), f"NVIDIA's mock NVML ({path}) is absent")
    return yaml.safe_load(path.read_text())


def run_on_mock_nvml(script: str, config: dict, tmp_path: Path):
    """`script` (Python printing one JSON document last) run with the real pynvml on NVIDIA's mock library and
    `config`, in a subprocess (the library reads its config once, at load); what it printed."""
    import yaml

    library = mock_nvml_library()
    path = tmp_path / "mock-config.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "LD_LIBRARY_PATH": str(library),
                                         "MOCK_NVML_CONFIG": str(path), "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def real_nvml_library_present() -> bool:
    """NVIDIA's real libnvidia-ml loads here (Debian's libnvidia-ml1: NVML without a driver)."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


# -- gpud as a real process and its CLI ----------------------------------------------------------


def json_lines(text: str) -> list[dict]:
    """The JSON lines of a log (gpud's with --log-format json), other lines left out."""
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events


class GpudProcess:
    """`gpud serve` as a child process, with its JSON log lines collected in a file."""

    def __init__(self, workdir: Path, *args: str, env: dict | None = None, run_as: tuple[str, ...] = ()):
        self.workdir = workdir
        self.socket = workdir / "gpud.sock"
        self.log_path = workdir / f"gpud-{time.monotonic_ns()}.log"
        cmd = [*run_as, sys.executable, "-m", "gpud", "serve", "--socket", str(self.socket), "--log-format", "json",
               "--state-dir", str(workdir / "state"), *args]
        self._log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=REPO)
        self.client = Client(self.socket, timeout=10)

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gpud exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                last = predicate()
                if last:
                    return last
            except DaemonUnreachable as exc:
                last = exc
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what} (last: {last!r}):\n{self.log_text()}")

    def wait_healthy(self, timeout: float = 20.0):
        return self.wait_for(lambda: self.client.request("GET", "/healthz", ok_statuses=(503,))[0] == 200,
                             timeout, "healthz 200")

    def log_text(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log_path.read_text()

    def log_events(self) -> list[dict]:
        return json_lines(self.log_text())

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log_file.close()


def cli(*args: str, socket=None) -> subprocess.CompletedProcess:
    extra = ["--socket", str(socket)] if socket else []
    return subprocess.run([sys.executable, "-m", "gpud", *args, *extra], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


# -- gpud in-process on a simulated node ---------------------------------------------------------


def sim_config(tmp: Path, preset: str) -> Config:
    """A simulated node with its socket and state under tmp; the inventory is not re-read on a timer
    during a test."""
    return Config().with_overrides(**{"api.socket": str(tmp / "g.sock"), "simulate": preset,
                                      "sim_state": str(tmp / "sim.json"), "state_dir": str(tmp / "state"),
                                      "inventory.refresh_interval_s": 3600.0})


def mig_config(tmp, preset, layouts_text=None, **mig) -> Config:
    config = sim_config(tmp, preset)
    if layouts_text is not None:
        (tmp / "layouts.yaml").write_text(layouts_text)
        config = config.with_overrides(**{"mig.layouts_file": str(tmp / "layouts.yaml")})
    else:
        config = config.with_overrides(**{"mig.layouts_file": str(tmp / "absent.yaml")})  # shipped layouts
    for key, value in mig.items():
        config = config.with_overrides(**{f"mig.{key}": value})
    return config


def sharing_config(tmp, preset, text, **mig):
    (tmp / "sharing.yaml").write_text(text)
    return mig_config(tmp, preset, **mig).with_overrides(**{"sharing.file": str(tmp / "sharing.yaml")})


class Running:
    def __init__(self, daemon: Daemon, http: aiohttp.ClientSession):
        self.daemon, self.http = daemon, http

    async def get(self, path: str):
        async with self.http.get(f"http://localhost{path}") as response:
            return response.status, await response.json()

    async def post(self, path: str, body=None, data=None):
        kwargs = {"json": body} if data is None else {"data": data}
        async with self.http.post(f"http://localhost{path}", **kwargs) as response:
            return response.status, await response.json()


async def start_daemon(config: Config, *, healthy: bool = True, prepare=lambda daemon: None) -> Running:
    """An in-process gpud serving its socket; with healthy, once /healthz answers 200. prepare(daemon)
    runs before it starts (to set a fault on the simulated node before NVML comes up)."""
    daemon = Daemon(config)
    prepare(daemon)
    await daemon.start()
    http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(config.socket_path)))
    running = Running(daemon, http)
    if not healthy:
        return running
    await answer_until(running, "/healthz", lambda status, _: status == 200, timeout=4.0)
    return running


async def answer_until(running: Running, path: str, wanted, timeout: float = 4.0) -> tuple[int, dict]:
    """GET path until wanted(status, body) holds; the last answer."""
    for _ in range(int(timeout / 0.01)):
        status, body = await running.get(path)
        if wanted(status, body):
            return status, body
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} never answered as wanted: {status} {body}")


async def mig_settled(running: Running, timeout: float = 10.0) -> dict:
    """/v1/mig once start-up convergence is over: until then a change is refused as an apply in progress."""
    for _ in range(int(timeout / 0.02)):
        _, mig = await running.get("/v1/mig")
        if mig["state"] not in ("pending", "applying"):
            return mig
        await asyncio.sleep(0.02)
    raise AssertionError(f"MIG start-up convergence did not finish: {mig}")


async def stop_daemon(running: Running) -> None:
    await running.http.close()
    await running.daemon.stop()


async def put_layout(node, layout, **options):
    async with node.http.put("http://localhost/v1/mig?wait=true", json={"layout": layout, **options}) as response:
        return response.status, await response.json()


# -- other users on the socket -------------------------------------------------------------------

READERS, ADMINS = "gpudt-readers", "gpudt-admins"
USERS = {"gpudt-reader": [READERS], "gpudt-admin": [READERS, ADMINS], "gpudt-other": []}


def gpud_for_users(run_gpud, tmp: Path):
    """A simulated one-GPU gpud the test users can reach: READERS read, ADMINS change."""
    tmp.chmod(0o755)  # let the test users reach the socket; the socket's own mode decides
    config = tmp / "gpud.yaml"
    config.write_text(f"api:\n  group: {READERS}\n  admin_group: {ADMINS}\n"
                      f"mig:\n  layouts_file: {tmp / 'none.yaml'}\n")
    gpud = run_gpud("--simulate", "A100-SXM4-40GB:1", "--sim-state", str(tmp / "sim.json"), "--config", str(config))
    gpud.wait_healthy()
    return gpud


def curl_as(user: str, socket_path, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    command = [shutil.which("runuser", path=SYSTEM_PATH), "-u", user, "--", "curl", "-s", "-o", "-", "-w",
               "\n%{http_code}", "--unix-socket", str(socket_path), "-X", method, f"http://localhost{path}"]
    if body is not None:
        command += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    text, _, code = result.stdout.rpartition("\n")
    return int(code or 0), text


# -- MPS -----------------------------------------------------------------------------------------


def kill_mps_under(root: Path) -> None:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"CUDA_MPS_PIPE_DIRECTORY={root}".encode() in (entry / "environ").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def running_daemons(gpud, count: int, timeout: float = 20.0) -> list[dict]:
    def ready():
        daemons = gpud.client.get("/v1/mps")["daemons"]
        return daemons if len(daemons) == count and all(d["state"] == "running" for d in daemons) else None
    return gpud.wait_for(ready, timeout, f"{count} running MPS daemons")


def read_back(daemon: dict) -> tuple[float, dict]:
    control = MpsControl(MPS_CONTROL, MpsDirectories(Path(daemon["pipe_directory"]),
                                                     Path(daemon["log_directory"])), tuple(daemon["devices"]))
    return asyncio.run(control.limits())


# -- real containers (podman) --------------------------------------------------------------------


def minimal_rootfs(root: Path, *programs: str) -> Path:
    """A root filesystem holding the programs (by name, found on PATH) and the libraries they load,
    for `podman run --rootfs`; each program is also at /bin/<name>."""
    for program in programs:
        binary = Path(shutil.which(program)).resolve()
        # "not a dynamic executable" for a static one: no libraries
        ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=120).stdout
        libraries = [word for word in ldd.split() if word.startswith("/") and ".so" in word]
        for source in [binary, *map(Path, libraries)]:
            target = root / str(source).lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source.resolve(), target)
        (root / "bin").mkdir(exist_ok=True)
        if not (root / "bin" / program).exists():
            shutil.copy2(binary, root / "bin" / program)
    for directory in ("proc", "sys", "dev", "etc", "tmp", "run"):
        (root / directory).mkdir(exist_ok=True)
    return root


def hybrid_cgroup2_with_controllers() -> bool:
    """crun refuses "cgroups in hybrid mode" while the cgroup2 mount beside v1 holds controllers, as
    in some VM sandboxes (cgroup v1 with a cgroup2 at /sys/fs/cgroup/unified holding hugetlb)."""
    controllers = Path("/sys/fs/cgroup/unified/cgroup.controllers")
    return controllers.exists() and bool(controllers.read_text().strip())


def podman(*args: str) -> subprocess.CompletedProcess:
    command = [shutil.which("podman"), "--cgroup-manager", "cgroupfs", *args]
    if hybrid_cgroup2_with_controllers():
        # In a private mount namespace without the cgroup2 mount, crun sees plain cgroup v1: the host's
        # mounts are untouched, and the container's cgroups are the host's real ones.
        command = ["unshare", "--mount", "sh", "-c", 'umount /sys/fs/cgroup/unified && exec "$@"', "sh", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


# Lower limits than podman's defaults: raising RLIMIT_NOFILE/NPROC is refused in some sandboxes.
PODMAN_RUN = ("run", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")


def need_podman_as_root() -> None:
    """Skips a test without root or podman; under CI=true fails it (scripts/test-all installs podman)."""
    import pytest
    if shutil.which("podman") is None or os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root with Debian's podman (scripts/test-all installs it)")
        pytest.skip("needs root and podman")


def stand_in_nodes(root: Path, gpus: int, control=("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")) -> Path:
    """Character devices under root/dev standing in for the driver's: /dev/nvidia<minor> for each GPU,
    the control nodes, and every MIG capability node of those GPUs (minors from the driver's table).
    They are /dev/null's numbers (1, 3), harmless to open. Needs root (mknod)."""
    import pytest

    from gpud.cdi.spec import parse_mig_minors
    from gpud.nvml.sim.mig_minors import mig_minors_text

    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root")
        pytest.skip("needs root to make device nodes")
    (root / "dev" / "nvidia-caps").mkdir(parents=True, exist_ok=True)
    names = [f"dev/nvidia{minor}" for minor in range(gpus)] + [f"dev/{name}" for name in control]
    minors = parse_mig_minors(mig_minors_text())
    names += [f"dev/nvidia-caps/nvidia-cap{minor}" for cap, minor in minors.items()
              if cap.startswith("gpu") and int(cap[3:cap.index("/")]) < gpus]
    for name in names:
        os.mknod(root / name, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return root
