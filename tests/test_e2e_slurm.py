"""Slurm on gpud, end to end, with real Slurm: Debian 12's slurmctld, slurmd and munge (Slurm 22.05), then
Debian 13's (24.11), each in a booted nspawn root, one controller and one node, gpud installed there from its .deb on a simulated node of two
A100-40GB, and the NVIDIA device nodes made there as the driver makes them. What docs/slurm.md walks an
operator through: gres.conf from gpud accepted, a job placed on two MIG devices, gpud's health program
(slurmd's HealthCheckProgram and Prolog) draining the node on an XID with gpud's reason and resuming it
after a clear while leaving an operator's drain alone, with gpud's remediation on a GPU asking a reset reset,
checked and the node resumed once its job ended (an operator's drain still left alone), and a MIG layout change
reflected in the GRES."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import SYSTEM_PATH
from nspawn_root import Container, apt_mirror
from slurm_cluster import CONTAINED_PLUGINS

# The .deb comes from the session's build (conftest `release`), which test_e2e_systemd also uses.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packages")]
PACKAGES = "systemd,systemd-sysv,dbus,python3,curl,passwd,munge,slurmctld,slurmd,slurm-client"
HEALTH_CHECK_INTERVAL_S = 2
# Debian 12's Slurm 22.05 and Debian 13's 24.11, one root after the other.
DISTRIBUTIONS = ("bookworm", "trixie")
# Debian's units and directories (slurmctld.service, slurmd.service; /var/lib/slurm, /var/log/slurm);
# the plugins that need no cgroup delegation or PMIx in a container. gpud's health program and prolog
# are the package's wrappers: slurmd runs both without arguments.
SLURM_CONF = """\
ClusterName=gpud
SlurmctldHost={host}(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
{plugins}HealthCheckProgram=/usr/lib/gpud/slurm/health-check
HealthCheckInterval={interval}
Prolog=/usr/lib/gpud/slurm/prolog
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} {gres} State=UNKNOWN
PartitionName=gpu Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""
GPUD_YAML = """\
simulate: A100-SXM4-40GB:2
health:
  check_interval_s: 0.5
slurm:
  gres_file: /etc/slurm/gres.conf
  reconfigure: true
"""
NVIDIA_MAJOR = 195  # /dev/nvidia<minor> and /dev/nvidiactl (255): the driver's fixed major (devices.txt)
CAPS_MAJOR = 236  # nvidia-caps: the driver takes a dynamic major (/proc/devices); any one does here


class SlurmNode:
    def __init__(self, box: Container):
        self.box = box
        self.host = box.run("hostname", "-s", check=True).stdout.strip()
        self.cpus = int(box.run("nproc", check=True).stdout)

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        done = self.box.run(*command)
        assert not check or done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
        return done

    def node(self) -> dict[str, str]:
        """`scontrol show node -o`'s fields; Reason= runs to the end of the line (it holds spaces)."""
        line = self.run("scontrol", "show", "node", "-o", self.host).stdout.strip()
        line, _, reason = line.partition(" Reason=")
        fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
        return fields | ({"Reason": reason} if reason else {})

    def gres_file(self) -> list[str]:
        """The records of the gres.conf gpud keeps; none before gpud wrote it."""
        path = self.box.root / "etc/slurm/gres.conf"
        text = path.read_text() if path.exists() else ""
        return [line for line in text.splitlines() if line and not line.startswith("#")]

    def make_device_nodes(self) -> None:
        """What the driver does on a real node (and nvidia-modprobe for the MIG capabilities): every
        device file gres.conf names exists, as slurmd stats each one ("fatal: can't stat gres.conf file")."""
        paths = set(re.findall(r"/dev/[\w/-]+", "\n".join(self.gres_file()))) | {"/dev/nvidiactl"}
        for path in sorted(paths):
            if self.box.run("test", "-e", path).returncode == 0:
                continue
            minor = "255" if path == "/dev/nvidiactl" else re.search(r"(\d+)$", path)[1]
            major = CAPS_MAJOR if "/nvidia-caps/" in path else NVIDIA_MAJOR
            self.run("mkdir", "-p", str(Path(path).parent))
            self.run("mknod", "-m", "444" if major == CAPS_MAJOR else "666", path, "c", str(major), minor)

    def configure_slurm(self) -> str:
        """slurm.conf with the node's Gres= as `gpud slurm gres --node-line` prints it; returns that."""
        gres = self.run("gpud", "slurm", "gres", "--node-line").stdout.strip()
        assert gres.startswith("Gres="), gres
        (self.box.root / "etc/slurm/slurm.conf").write_text(SLURM_CONF.format(
            host=self.host, cpus=self.cpus, gres=gres, interval=HEALTH_CHECK_INTERVAL_S, plugins=CONTAINED_PLUGINS))
        return gres

    def srun(self, gres: str, *extra: str) -> subprocess.CompletedProcess:
        return self.box.run("timeout", "60", "srun", f"--gres={gres}", *extra, "sh", "-c",
                            "echo gpus=$SLURM_STEP_GPUS")

    def wait_state(self, what: str, check, timeout: float = 60.0) -> dict[str, str]:
        seen: list[dict] = []

        def ok() -> bool:
            seen[:] = [self.node()]
            return check(seen[0])
        try:
            self.box.wait_for(ok, what, timeout)
        except AssertionError as exc:
            logs = self.run("tail", "-n", "30", "/var/log/slurm/slurmd.log", "/var/log/slurm/slurmctld.log").stdout
            # Slurm's side first: CI shows a long failure's beginning and end, and gpud's journal is long
            raise AssertionError(f"{what}: node: {seen[-1] if seen else None}\n{logs}\n{exc}") from None
        return seen[0]

    def slurm_view(self) -> dict:
        status, text = self.box.curl("/v1/slurm/gres")
        assert status == 200, text
        return json.loads(text)


def _add_address(box: Container) -> None:
    """--private-network leaves only loopback, and Slurm's address lookups of even "127.0.0.1" fail then
    ("Unable to resolve", as glibc's AI_ADDRCONFIG counts no loopback address): a veth pair inside the
    container's own network namespace gives it one address more, and still no way out."""
    ip = shutil.which("ip", path=SYSTEM_PATH)
    enter = [shutil.which("nsenter", path=SYSTEM_PATH), "-t", str(box.init), "-n", ip]
    for command in (["link", "add", "gpud0", "type", "veth", "peer", "name", "gpud1"],
                    ["addr", "add", "10.254.0.1/24", "dev", "gpud0"], ["link", "set", "gpud0", "up"],
                    ["link", "set", "gpud1", "up"]):
        subprocess.run(enter + command, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module", params=DISTRIBUTIONS)
def slurm(request, release, tmp_path_factory):
    """Booted Debian root with Slurm and gpud installed, gpud on its simulated node with the MIG
    layout all-1g.5gb (14 MIG devices), Slurm not started yet (no slurm.conf)."""
    if shutil.which("ip", path=SYSTEM_PATH) is None:
        pytest.fail("scripts/test-all installs iproute2")
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o755)
    subprocess.run([shutil.which("debootstrap", path=SYSTEM_PATH), "--variant=minbase", "--components=main",
                    f"--include={PACKAGES}", request.param, str(root), apt_mirror()],
                   check=True, capture_output=True, timeout=1200)
    shutil.copy(release.deb, root / "root" / "gpud.deb")
    box = Container.__new__(Container)
    try:
        box.__init__(root)
        _add_address(box)
        node = SlurmNode(box)
        node.run("dpkg", "-i", "/root/gpud.deb")
        (root / "etc/gpud/gpud.yaml").write_text(GPUD_YAML)
        node.run("systemctl", "restart", "gpud")
        box.wait_for(lambda: box.show("ActiveState") == "active" and "GPUs" in box.show("StatusText"), "gpud")
        assert "layout all-1g.5gb: success" in node.run("gpud", "mig", "apply", "all-1g.5gb").stdout
        yield node
    finally:
        if getattr(box, "boot", None):
            box.stop()


def test_gres_from_gpud_is_accepted_and_a_job_is_placed_on_two_mig_devices(slurm):
    # gpud keeps /etc/slurm/gres.conf written (slurm.gres_file): one record per MIG device, typed by
    # its profile, with its parent's device node and its two capability nodes, as Slurm's NVML
    # autodetection would describe it.
    slurm.box.wait_for(lambda: len(slurm.gres_file()) == 14, "gres.conf with the 14 MIG devices")
    records = slurm.gres_file()
    assert all(re.fullmatch(r"Name=gpu Type=1g\.5gb MultipleFiles=/dev/nvidia[01],/dev/nvidia-caps/nvidia-cap\d+,"
                            r"/dev/nvidia-caps/nvidia-cap\d+( Cores=\S+)?", record) for record in records), records
    assert slurm.slurm_view()["text"].splitlines()[-14:] == records
    slurm.make_device_nodes()
    assert slurm.configure_slurm() == "Gres=gpu:1g.5gb:14"
    slurm.run("systemctl", "restart", "munge", "slurmctld", "slurmd")

    node = slurm.wait_state("the node idle", lambda node: node.get("State") == "IDLE")
    assert node["Gres"] == "gpu:1g.5gb:14" and "Reason" not in node, node
    assert slurm.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split() == [slurm.host, "idle"]
    job = slurm.srun("gpu:1g.5gb:2")
    assert job.returncode == 0, job.stdout + job.stderr
    gpus = job.stdout.strip().removeprefix("gpus=").split(",")
    assert len(gpus) == 2 and len(set(gpus)) == 2, job.stdout


def test_an_xid_drains_the_node_with_gpuds_reason_and_a_clear_resumes_it(slurm):
    slurm.run("gpud", "sim", "xid", "1", "79")
    # slurmd's own HealthCheckProgram run (every HealthCheckInterval) drains it, naming GPU and XID
    node = slurm.wait_state("gpud's drain", lambda node: "DRAIN" in node.get("State", ""))
    assert node["Reason"].startswith("gpud: GPU 1 XID 79"), node
    assert "(reboot)" in node["Reason"], node
    # a drained node takes no job
    refused = slurm.srun("gpu:1g.5gb:1", "--immediate=5")
    assert refused.returncode != 0, refused.stdout

    slurm.run("gpud", "sim", "recover", "1")
    slurm.run("gpud", "health", "clear", "1")
    node = slurm.wait_state("the resume", lambda node: node.get("State") == "IDLE")
    # 22.05 drops the reason with the drain; 24.11 goes on showing the last one on the resumed node
    assert "Reason" not in node or node["Reason"].startswith("gpud: GPU 1 XID 79"), node
    assert slurm.srun("gpu:1g.5gb:1").returncode == 0

    # An operator's drain is the operator's: a healthy node stays drained through several checks.
    slurm.run("scontrol", "update", f"nodename={slurm.host}", "state=drain", "reason=maintenance")
    time.sleep(2.5 * HEALTH_CHECK_INTERVAL_S)  # fixed time: slurmd's checks that leave a node alone leave no trace
    health = slurm.run("/usr/lib/gpud/slurm/health-check", check=False)
    assert health.returncode == 0, health.stdout + health.stderr
    assert slurm.node()["Reason"].startswith("maintenance"), slurm.node()
    slurm.run("gpud", "sim", "xid", "0", "79")
    slurm.run("/usr/lib/gpud/slurm/health-check", check=False)
    assert slurm.node()["Reason"].startswith("maintenance"), slurm.node()  # not replaced by gpud's
    slurm.run("gpud", "sim", "recover", "0")
    slurm.run("gpud", "health", "clear", "0")
    slurm.run("scontrol", "update", f"nodename={slurm.host}", "state=resume")
    slurm.wait_state("the node idle again", lambda node: node.get("State") == "IDLE")


def _remediated(slurm: SlurmNode) -> dict:
    status, text = slurm.box.curl("/v1/remediation")
    assert status == 200, text
    return json.loads(text)["results"]


def _restart_gpud(slurm: SlurmNode, yaml: str) -> None:
    """gpud with another gpud.yaml; the simulated node's state (its MIG layout) is kept in /run/gpud,
    which the unit keeps across restarts (RuntimeDirectoryPreserve=yes)."""
    (slurm.box.root / "etc/gpud/gpud.yaml").write_text(yaml)
    slurm.run("systemctl", "restart", "gpud")
    slurm.box.wait_for(lambda: slurm.box.show("ActiveState") == "active" and "GPUs" in slurm.box.show("StatusText"),
                       "gpud restarted")


def test_a_gpu_asking_a_reset_is_remediated_once_its_job_ends_and_the_node_takes_the_next(slurm):
    # gpud.yaml's remediation on: slurmd's own health check runs (every HealthCheckInterval) do it all
    _restart_gpud(slurm, GPUD_YAML + "remediation:\n  enabled: true\n")
    try:
        job = slurm.run("sbatch", "--parsable", "--gres=gpu:1g.5gb:1", "-o", "/dev/null", "--wrap", "sleep 300")
        slurm.wait_state("the job running", lambda node: node["State"].split("+")[0] in ("MIXED", "ALLOCATED"))
        before, gres_written = _remediated(slurm), slurm.slurm_view()["written_at"]
        slurm.run("gpud", "sim", "xid", "1", "95")  # xids.yaml: uncontained memory error, reset-gpu
        node = slurm.wait_state("gpud's drain while the job runs", lambda node: "DRAIN" in node["State"])
        assert node["Reason"].startswith("gpud: GPU 1 XID 95 (reset-gpu)"), node
        time.sleep(2.5 * HEALTH_CHECK_INTERVAL_S)  # fixed time: health checks that wait for the job leave no trace
        node = slurm.node()
        assert node["State"].split("+")[0] in ("MIXED", "ALLOCATED") and "DRAIN" in node["State"], node
        assert _remediated(slurm) == before  # a draining node is not reset under its job

        slurm.run("scancel", job.stdout.strip().split(";")[0])
        # the job gone, the next check resets GPU 1 through gpud, checks it and resumes the node
        node = slurm.wait_state("the remediation's resume", lambda node: node["State"] == "IDLE")
        assert _remediated(slurm)["passed"] == before["passed"] + 1, _remediated(slurm)
        # The reset destroyed GPU 1's MIG instances and gpud made them again: gres.conf waited, so slurmd
        # never re-read it with fewer records (and never registered a lower count with slurmctld).
        assert slurm.slurm_view()["written_at"] == gres_written
        status, text = slurm.box.curl("/v1/health")
        assert json.loads(text)["gpus"][1]["state"] == "healthy", text
        placed = slurm.srun("gpu:1g.5gb:1")
        assert placed.returncode == 0 and placed.stdout.startswith("gpus="), placed.stdout + placed.stderr

        # An operator's drain: an XID asking a reset on an empty node drained by someone else is left alone.
        slurm.run("scontrol", "update", f"nodename={slurm.host}", "state=drain", "reason=maintenance")
        slurm.run("gpud", "sim", "xid", "0", "95")
        time.sleep(2.5 * HEALTH_CHECK_INTERVAL_S)  # fixed time: slurmd's checks that leave a node alone leave no trace
        health = slurm.run("/usr/lib/gpud/slurm/health-check", check=False)
        assert health.returncode == 0 and "remediation" not in health.stdout, health.stdout + health.stderr
        assert slurm.node()["Reason"].startswith("maintenance"), slurm.node()
        assert _remediated(slurm)["passed"] == before["passed"] + 1
        status, text = slurm.box.curl("/v1/health")
        assert json.loads(text)["gpus"][0]["state"] == "unhealthy", text
    finally:
        slurm.run("scancel", "-u", "root", check=False)
        slurm.run("gpud", "health", "clear", "0", check=False)
        slurm.run("scontrol", "update", f"nodename={slurm.host}", "state=resume", check=False)
        _restart_gpud(slurm, GPUD_YAML)
    slurm.wait_state("the node idle again", lambda node: node.get("State") == "IDLE")


def test_a_mig_layout_change_is_reflected_in_the_gres(slurm):
    # gres.conf(5): drain a node before changing the count of records with File/MultipleFiles; the
    # controller refuses a changed count on reconfigure and takes it on its restart.
    slurm.run("scontrol", "update", f"nodename={slurm.host}", "state=drain", "reason=mig change")
    assert "layout all-3g.20gb: success" in slurm.run("gpud", "mig", "apply", "all-3g.20gb").stdout
    slurm.box.wait_for(lambda: len(slurm.gres_file()) == 4, "gres.conf rewritten with the 4 MIG devices")
    assert all(" Type=3g.20gb " in record for record in slurm.gres_file()), slurm.gres_file()
    # gpud ran `scontrol reconfigure` after its write (slurm.reconfigure): slurmd re-read gres.conf
    slurm.box.wait_for(lambda: (slurm.slurm_view()["reconfigure"]["last"] or {}).get("returncode") == 0,
                       "gpud's scontrol reconfigure")
    slurm.make_device_nodes()
    assert slurm.configure_slurm() == "Gres=gpu:3g.20gb:4"
    # slurmd stopped first: one still running from before holds the GRES it read earlier and registers them
    # with the new controller, whose first registration with the count it expects sets the node's types for
    # good, as a registration of an unchanged count rebuilds nothing (slurm src/common/gres.c
    # _node_config_validate, `if (!updated_config) return rc;`): the new slurmd then left Gres=gpu:1g.5gb:21
    # and a job asking 3g.20gb was refused. Then the controller, which reads the new count, then slurmd.
    slurm.run("systemctl", "stop", "slurmd")
    slurm.run("systemctl", "restart", "slurmctld")  # returns once the old controller stopped
    slurm.box.wait_for(lambda: slurm.run("scontrol", "show", "config", check=False).returncode == 0,
                       "the new controller")
    slurm.run("systemctl", "start", "slurmd")
    node = slurm.wait_state("slurmd's registration", lambda node: node.get("SlurmdStartTime", "None") != "None"
                            and "INVALID_REG" not in node["State"] and "NOT_RESPONDING" not in node["State"])
    assert node["Gres"] == "gpu:3g.20gb:4", f"{node}"  # whole: pytest cuts a dict short
    # Still drained: by the operator, or (24.11, whose reconfigure restarts slurmd) by slurmctld's own
    # check of the count slurmd registered on gpud's reconfigure, which replaced the operator's reason.
    print("reason after the restarts:", node.get("Reason"))
    assert node["State"] == "IDLE+DRAIN", (node["State"], node.get("Reason"))
    slurm.run("scontrol", "update", f"nodename={slurm.host}", "state=resume")
    slurm.wait_state("the node idle", lambda node: node.get("State") == "IDLE")
    job = slurm.srun("gpu:3g.20gb:1")
    assert job.returncode == 0 and job.stdout.strip().startswith("gpus="), job.stdout + job.stderr
    assert slurm.srun("gpu:1g.5gb:1", "--immediate=5").returncode != 0  # the old type is gone
