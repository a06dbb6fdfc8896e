"""A real one-node Slurm cluster (Debian's slurmctld, slurmd and munged) in a temporary directory, for
tests of gpud's Slurm integration. Nothing is installed and nothing outside the directory is changed:
munged has its own key and socket, slurmctld and slurmd their own ports, state and logs, and slurmd
runs in a private mount namespace whose /dev is a tmpfs holding stand-in NVIDIA device nodes (slurmd
stats every gres.conf File= path; the host's /dev is never written).

    cluster = SlurmCluster(gres="gpu:8", gres_conf="Name=gpu File=/dev/nvidia[0-7]\\n")
    cluster.scontrol("show", "node", cluster.node)
    cluster.stop()

Needs root, slurmctld, slurmd, munged and unshare; `need_slurm()` skips a test without them (fails it
under CI=true)."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from helpers import Lines, need, until

SLURMCTLD, SLURMD, MUNGED = "/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged"
START_TIMEOUT_S = 30.0

# Run by `unshare -m` as: sh mkdev.sh DEVDIR PROGRAM ARGS...: a fake /dev for slurmd, then slurmd.
MKDEV = r"""set -e
dev=$1; shift
mount -t tmpfs -o mode=0755 tmpfs "$dev"
cd "$dev"
mknod -m 666 null c 1 3; mknod -m 666 zero c 1 5; mknod -m 666 full c 1 7
mknod -m 666 random c 1 8; mknod -m 666 urandom c 1 9; mknod -m 666 tty c 5 0
ln -s /proc/self/fd fd; mkdir pts shm nvidia-caps
for n in 0 1 2 3 4 5 6 7; do mknod -m 666 nvidia$n c 195 $n; done
mknod -m 666 nvidiactl c 195 255
n=1; while [ $n -le 40 ]; do mknod -m 444 nvidia-caps/nvidia-cap$n c 236 $n; n=$((n+1)); done
mount --bind "$dev" /dev
exec "$@"
"""

# slurm.conf's plugins for a Slurm that runs where it cannot have cgroups delegated or PMIx (a test
# directory, a container): no cgroup confinement, no accounting, cons_tres for shard and mps (gres.conf(5)).
CONTAINED_PLUGINS = """\
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu,shard,mps
ReturnToService=2
MpiDefault=none
"""


def need_slurm() -> None:
    """Skips (fails under CI=true) where a real cluster cannot be started here."""
    need(os.geteuid() == 0, "a real Slurm cluster needs root (munged, slurmd, mount namespaces)")
    missing = [path for path in (SLURMCTLD, SLURMD, MUNGED) if not os.access(path, os.X_OK)]
    missing += [name for name in ("scontrol", "sinfo", "unshare") if shutil.which(name) is None]
    need(not missing, f"Slurm or munge is not installed: no {', '.join(missing)}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SlurmCluster:
    """slurmctld and one slurmd (this host, short name) with a partition `gpu`. `extra_conf` lines are
    appended to slurm.conf (HealthCheckProgram=, Prolog=...)."""

    def __init__(self, gres: str = "gpu:8", gres_conf: str = "Name=gpu File=/dev/nvidia[0-7]\n",
                 extra_conf: str = ""):
        self.dir = Path(tempfile.mkdtemp(prefix="gsl-", dir="/tmp"))  # short: munge's socket path
        self.conf_dir = self.dir
        self.node = socket.gethostname().split(".")[0]
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}
        self._procs: list[tuple[str, subprocess.Popen, Lines]] = []
        self.extra_conf = extra_conf
        self.node_gres = gres
        try:
            self._start_munge()
            (self.dir / "gres.conf").write_text(gres_conf)
            self._ports = (_free_port(), _free_port())
            self._write_conf()
            self._spawn("slurmctld", [SLURMCTLD, "-D", "-i"])
            (self.dir / "mkdev.sh").write_text(MKDEV)
            (self.dir / "dev").mkdir()
            self._spawn("slurmd", ["unshare", "-m", "--propagation", "private", "sh", str(self.dir / "mkdev.sh"),
                                   str(self.dir / "dev"), SLURMD, "-D"])
            until(lambda: self.node_state().split("+")[0] in ("IDLE", "MIXED", "ALLOCATED"), START_TIMEOUT_S,
                  f"node {self.node} to register with slurmctld ({self.logs()})", interval=0.2)
        except BaseException:
            self.stop()
            raise

    # -- what tests use ----------------------------------------------------------------------------

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(["scontrol", *args], capture_output=True, text=True, env=self.env, timeout=30)
        if check and result.returncode != 0:
            raise AssertionError(f"scontrol {' '.join(args)}: rc {result.returncode}: {result.stderr.strip()}")
        return result

    def show_node(self) -> str:
        return self.scontrol("show", "node", "-o", self.node).stdout

    def node_state(self) -> str:
        """State= of the node, e.g. IDLE, IDLE+DRAIN; "" while slurmctld does not answer."""
        result = self.scontrol("show", "node", "-o", self.node, check=False)
        for word in result.stdout.split():
            if word.startswith("State="):
                return word.removeprefix("State=")
        return ""

    def node_reason(self) -> str | None:
        """The node's Reason= without the " [user@time]" Slurm appends; None without one."""
        line = self.show_node()
        if " Reason=" not in line:
            return None
        reason = line.split(" Reason=", 1)[1].rstrip("\n")
        return reason.rsplit(" [", 1)[0] if reason.endswith("]") else reason

    def write_gres(self, text: str, node_gres: str) -> None:
        """A new gres.conf and node Gres=, taken in by `scontrol reconfigure`."""
        (self.dir / "gres.conf").write_text(text)
        self.node_gres = node_gres
        self._write_conf()
        self.reconfigure()

    def set_extra_conf(self, extra_conf: str) -> None:
        self.extra_conf = extra_conf
        self._write_conf()
        self.reconfigure()

    def reconfigure(self) -> None:
        self.scontrol("reconfigure")

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "; ".join(f"{name}: {self.log(name)[-800:]!r}" for name in ("slurmctld", "slurmd"))

    def stop(self) -> None:
        for _name, proc, _lines in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self._procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- start-up ----------------------------------------------------------------------------------

    def _start_munge(self) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.munge_socket = munge / "m.sock"
        self._spawn("munged", [MUNGED, "-F", "-f", f"--key-file={key}", f"--socket={self.munge_socket}",
                               f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                               f"--seed-file={munge / 'seed'}"])
        until(self.munge_socket.exists, 10, "munged's socket", interval=0.05)

    def _write_conf(self) -> None:
        d = self.dir
        ctld_port, slurmd_port = self._ports
        (d / "state").mkdir(exist_ok=True)
        (d / "spool").mkdir(exist_ok=True)
        (d / "slurm.conf").write_text(f"""ClusterName=gpudtest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd.log'}
SlurmdDebug=debug
{CONTAINED_PLUGINS}{self.extra_conf}
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} Gres={self.node_gres} State=UNKNOWN
PartitionName=gpu Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, command: list[str]) -> None:
        proc = subprocess.Popen(command, env=self.env, cwd=self.dir, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._procs.append((name, proc, Lines(proc.stdout, name)))
