"""gpud doctor: its nvidia-smi parsers on real captures, and the whole check on simulated and driverless nodes.

Real captures: our own H100 (tests/fixtures/hardware/h100-sxm5-580.159.04/) and public outputs
(tests/fixtures/nvidia-smi/README.md says where each comes from).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import jsonschema
import pynvml
import pytest
from helpers import IN_CI, REPO, Lines, real_nvml_library_present

from gpud.cli import doctor_checks
from gpud.nvml import smi
from gpud.nvml.doctor_reads import MIB, GiProfile, GpuReading, NodeReading
from gpud.nvml.sim import SimulatedNvml
from gpud.nvml.sim.scenarios import fill_with_gpu_instances, started

H100 = REPO / "tests/fixtures/hardware/h100-sxm5-580.159.04"
PUBLIC = REPO / "tests/fixtures/nvidia-smi"
SCHEMA = json.loads((REPO / "tests/fixtures/doctor/report.schema.json").read_text())
# NVML calls that change a GPU or register something; a doctor run must make none of them.
MUTATING = re.compile(r"^nvml\w*?(Set|Create|Destroy|Reset|Register|Clear|Modify|Issue|Freeze|Enable|Disable)")


def captured_lgip(run: int = 0) -> str:
    """The `nvidia-smi mig -lgip` table from our H100 capture log: run 0 as root, run 1 as uid 65534."""
    lines = H100.joinpath("capture.log").read_text().splitlines()
    start = [i for i, line in enumerate(lines) if line.endswith(" nvidia-smi mig -lgip")][run]
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("+ "))
    return "\n".join(lines[start + 1:end]) + "\n"


def probe_reading() -> NodeReading:
    """What NVML answered on our real H100 (probe-root.json), as doctor's reads would hold it."""
    probe = json.loads(H100.joinpath("probe-root.json").read_text())
    value = lambda key: ast.literal_eval(probe[key]["ok"]) if isinstance(probe[key]["ok"], str) and \
        probe[key]["ok"].startswith("{") else probe[key]["ok"]  # noqa: E731
    profiles = tuple(GiProfile(id=p["id"], name=p["name"], slices=p["sliceCount"], instances=p["instanceCount"],
                               memory_mib=p["memorySizeMB"])
                     for key in probe if key.startswith("gpu0.gip_v2[") and "ok" in probe[key]
                     for p in [value(key)])
    gpu = GpuReading(index=0, name=value("gpu0.name"), uuid=value("gpu0.uuid"), bus_id=value("gpu0.pci")["busId"],
                     minor_number=value("gpu0.minor"), memory_total_mib=value("gpu0.mem_v1")["total"] // MIB,
                     mig_current="disabled", mig_pending="disabled", gi_profiles=profiles, gi_profiles_answered=True)
    return NodeReading(driver_version=value("driver"), nvml_version=value("nvml"), cuda_version="13.0", gpus=(gpu,))


# -- nvidia-smi -q -x ----------------------------------------------------------------------------


def test_query_xml_of_our_real_h100():
    report = smi.parse_query_xml(H100.joinpath("nvidia-smi-q.xml").read_text())
    assert (report.driver_version, report.cuda_version) == ("580.159.04", "13.0")
    assert report.gpus == (smi.SmiGpu(bus_id="00000000:00:06.0", name="NVIDIA H100 80GB HBM3",
                                      uuid="GPU-367cf1a5-a8a4-acd1-88b8-28b606aa5e3c", minor_number=0,
                                      mig_current="disabled", mig_pending="disabled", memory_total_mib=81559),)


def test_query_xml_with_mig_devices_and_trimmed_fields():
    report = smi.parse_query_xml(PUBLIC.joinpath("q-x-a100-pcie-40gb-x8-535.129.03-mig-on.xml").read_text())
    assert report.driver_version == "535.129.03" and len(report.gpus) == 8
    by_bus = {gpu.bus_id: gpu for gpu in report.gpus}
    mig_gpu = by_bus["00000000:21:00.0"]
    assert (mig_gpu.mig_current, mig_gpu.mig_pending, mig_gpu.minor_number) == ("enabled", "enabled", 2)
    assert [(d.index, d.gpu_instance_id, d.compute_instance_id, d.memory_total_mib) for d in mig_gpu.mig_devices] \
        == [(0, 1, 0, 19968), (1, 5, 0, 9856), (2, 13, 0, 4864)]
    plain = by_bus["00000000:10:00.0"]
    assert plain.mig_current is None and plain.mig_devices == ()  # N/A and "None" as printed
    assert plain.memory_total_mib is None  # the publisher trimmed the GPU's memory element


@pytest.mark.parametrize("text, message", [
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", "not XML"),
    ('<?xml version="1.0" ?><nvidia_smi_log_unit></nvidia_smi_log_unit>', "not <nvidia_smi_log>"),
    ("", "not XML"),
])
def test_query_xml_that_is_not_a_report_is_refused(text, message):
    with pytest.raises(smi.SmiError, match=message):
        smi.parse_query_xml(text)


# -- nvidia-smi mig -lgip ------------------------------------------------------------------------


def test_lgip_of_our_real_h100_as_root_and_as_nobody():
    profiles = smi.parse_lgip(captured_lgip())
    assert [(p.name, p.id, p.free, p.total, p.memory_gib, p.sm_count) for p in profiles] == [
        ("MIG 1g.10gb", 19, 7, 7, 9.75, 16), ("MIG 1g.10gb+me", 20, 1, 1, 9.75, 16),
        ("MIG 1g.20gb", 15, 4, 4, 19.62, 26), ("MIG 2g.20gb", 14, 3, 3, 19.62, 32),
        ("MIG 3g.40gb", 9, 2, 2, 39.5, 60), ("MIG 4g.40gb", 5, 1, 1, 39.5, 64), ("MIG 7g.80gb", 0, 1, 1, 79.25, 132)]
    assert {p.gpu for p in profiles} == {0} and not any(p.p2p for p in profiles)
    assert "--reuid=65534" in H100.joinpath("capture.log").read_text()
    assert smi.parse_lgip(captured_lgip(run=1)) == profiles


def test_lgip_public_tables_with_mig_on():
    four = smi.parse_lgip(PUBLIC.joinpath("lgip-h100-sxm5-x4-mig-on.txt").read_text())
    assert len(four) == 28 and [p.gpu for p in four[::7]] == [0, 1, 2, 3]
    assert [p.id for p in four[:7]] == [19, 20, 15, 14, 9, 5, 0]
    nvl = smi.parse_lgip(PUBLIC.joinpath("lgip-h100-nvl-560.35.03-mig-on.txt").read_text())
    assert [(p.name, p.memory_gib) for p in nvl] == [
        ("MIG 1g.12gb", 10.75), ("MIG 1g.12gb+me", 10.75), ("MIG 1g.24gb", 21.62), ("MIG 2g.24gb", 21.62),
        ("MIG 3g.47gb", 46.38), ("MIG 4g.47gb", 46.38), ("MIG 7g.94gb", 93.12)]


def test_lgip_without_a_table_lists_nothing():
    assert smi.parse_lgip("No MIG-enabled devices found.\n") == []  # as our capture shows for -lgi
    assert smi.parse_lgip("") == []


# -- comparing NVML with nvidia-smi, on real data from one machine --------------------------------


def test_real_nvml_answers_agree_with_real_nvidia_smi():
    reading = probe_reading()
    report = smi.parse_query_xml(H100.joinpath("nvidia-smi-q.xml").read_text())
    assert doctor_checks.smi_mismatches(reading, report, smi.parse_lgip(captured_lgip())) == []


def test_a_changed_value_is_a_mismatch():
    reading = probe_reading()
    gpu = reading.gpus[0]
    shrunk = replace(gpu, memory_total_mib=gpu.memory_total_mib - 1,
                     gi_profiles=(replace(gpu.gi_profiles[0], memory_mib=10240, instances=6),) + gpu.gi_profiles[1:])
    report = smi.parse_query_xml(H100.joinpath("nvidia-smi-q.xml").read_text())
    mismatches = doctor_checks.smi_mismatches(replace(reading, gpus=(shrunk,)), report, smi.parse_lgip(captured_lgip()))
    assert mismatches == ["GPU 0 memory total (MiB): NVML 81558, nvidia-smi 81559",
                          "GPU 0 profile 19 instances: NVML 6, nvidia-smi 7",
                          "GPU 0 profile 19 memory: NVML 10240 MiB, nvidia-smi 9.75 GiB"]


# -- nvidia-smi is only ever asked to list ------------------------------------------------------


def test_run_refuses_commands_that_change_state():
    for args in (("-r",), ("-mig", "1"), ("mig", "-cgi", "19"), ("-pm", "0"), ("-q",)):
        with pytest.raises(ValueError, match="read-only"):
            smi.run("/bin/true", args)


def test_run_reports_a_failing_or_missing_nvidia_smi(tmp_path):
    failing = tmp_path / "nvidia-smi"
    failing.write_text("#!/bin/sh\necho 'Failed to initialize NVML: Driver/library version mismatch'\nexit 18\n")
    failing.chmod(0o755)
    with pytest.raises(smi.SmiError, match="exited with 18: Failed to initialize NVML"):
        smi.run(str(failing), ("-q", "-x"))
    with pytest.raises(smi.SmiError, match="could not run"):
        smi.run(str(tmp_path / "absent"), ("-L",))


# -- doctor on a simulated node ------------------------------------------------------------------


class RecordingBackend:
    """The simulator, with every NVML and sim_* call it receives written down by name."""

    def __init__(self, backend):
        self._backend = backend
        self.calls: list[str] = []

    def __getattr__(self, name):
        value = getattr(self._backend, name)
        if name.startswith(("nvml", "sim_")) and callable(value) and not isinstance(value, type):
            def recorded(*args, **kwargs):
                self.calls.append(name)
                return value(*args, **kwargs)
            return recorded
        return value


@pytest.fixture
def fake_smi(short_tmp):
    """A directory with an `nvidia-smi` that prints our real H100 capture and logs its arguments."""
    (short_tmp / "lgip.txt").write_text(captured_lgip())
    script = short_tmp / "nvidia-smi"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$*" >> {short_tmp}/argv.log
        case "$*" in
          "-q -x") /bin/cat {H100}/nvidia-smi-q.xml ;;
          "mig -lgip") /bin/cat {short_tmp}/lgip.txt ;;
          *) echo "unexpected: $*" >&2; exit 2 ;;
        esac
    """))
    script.chmod(0o755)
    return short_tmp


def _doctor(*args: str, path: str = "/nonexistent", env: dict | None = None, user: list[str] | None = None):
    environment = {**os.environ, "PATH": path, **(env or {})}
    result = subprocess.run([*(user or []), sys.executable, "-m", "gpud.cli.doctor", *args], capture_output=True,
                            text=True, timeout=60, cwd=REPO, env=environment)
    return result


def test_doctor_makes_no_changing_call_and_leaves_the_state_untouched(tmp_path):
    state = tmp_path / "state.json"
    staged = started("dgx-a100", state)
    fill_with_gpu_instances(staged, pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE)
    staged.nvmlShutdown()
    before = state.read_bytes()
    backend = RecordingBackend(SimulatedNvml("dgx-a100", state))

    report = doctor_checks.examine(backend, simulated=True, smi_path=None)

    assert report["status"] == "ok", report["problems"]
    assert {"nvmlDeviceGetGpuInstanceProfileInfo", "nvmlDeviceGetGpuInstances",
            "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetNvLinkState"} <= set(backend.calls)
    assert [name for name in backend.calls if MUTATING.match(name)] == []
    assert {name for name in backend.calls if name.startswith("sim_")} <= {"sim_holders"}
    assert backend.calls[0] == "nvmlInit" and backend.calls[-1] == "nvmlShutdown"
    assert state.read_bytes() == before
    with pytest.raises(pynvml.NVMLError_Uninitialized):  # doctor closed its session
        backend._backend.nvmlDeviceGetCount()
    gpu = report["gpus"][0]
    assert gpu["mig"]["current"] == "enabled" and gpu["mig"]["gpu_instance_count"] == 3
    assert [d["name"] for d in gpu["mig"]["devices"]] == ["NVIDIA A100-SXM4-40GB MIG 2g.10gb"] * 3
    jsonschema.validate(report, SCHEMA)


def test_exit_0_on_a_healthy_simulated_node_without_nvidia_smi():
    result = _doctor("--simulate", "dgx-a100", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    assert report["status"] == "ok" and report["problems"] == [] and len(report["gpus"]) == 8
    assert report["nvidia_smi"] == {"path": None, "compared": False, "mismatches": [],
                                    "summary": "nvidia-smi is not on PATH: comparison skipped"}
    assert report["gpus"][0]["nvlink"] == {"links": 12, "active": 12, "inactive": 0, "summary": "all 12 links active"}
    text = _doctor("--simulate", "dgx-a100")
    assert text.returncode == 0 and text.stdout.rstrip().endswith("Result: OK (exit 0)")


def test_exit_1_when_nvidia_smi_describes_another_node(fake_smi):
    # The simulated H100 is not the real H100 nvidia-smi reports: different UUID and driver.
    result = _doctor("--simulate", "H100-SXM5-80GB:1", "--json", path=str(fake_smi))
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    uuid = report["gpus"][0]["uuid"]
    assert report["nvidia_smi"]["mismatches"] == [
        f"driver version: NVML {report['driver']['version']}, nvidia-smi 580.159.04",
        f"GPU 0 ({uuid}) is not in nvidia-smi -q -x"]
    assert all(p.startswith("nvidia-smi disagrees with NVML: ") for p in report["problems"])
    assert set((fake_smi / "argv.log").read_text().splitlines()) == {"-q -x", "mig -lgip"}


def test_exit_1_for_a_lost_gpu(tmp_path):
    state = tmp_path / "state.json"
    staged = started("dgx-a100", state)
    staged.sim_set_gpu_lost(2)
    staged.nvmlShutdown()
    result = _doctor("--simulate", "dgx-a100", "--sim-state", str(state), "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    assert any(p.startswith("GPU 2: ") for p in report["problems"])
    assert not any(p.startswith(("GPU 1: ", "GPU 3: ")) for p in report["problems"])



def test_exit_2_when_the_driver_is_not_loaded():
    # Debian's libnvidia-ml1 on a machine without the kernel module answers nvmlInit with Driver Not Loaded.
    if not real_nvml_library_present():
        if IN_CI:
            pytest.fail("CI must have libnvidia-ml1 installed (.ci/run installs it)")
        pytest.skip("libnvidia-ml.so.1 is not installed (apt-get install libnvidia-ml1 from non-free)")
    result = _doctor("--json")
    assert result.returncode == 2, result.stdout + result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    assert report["status"] == "cannot-run" and "Driver Not Loaded (NVML error 9)" in report["error"]
    text = _doctor()
    assert text.returncode == 2 and "cannot run: NVML cannot start: Driver Not Loaded" in text.stdout
    assert "try gpud on a simulated node: gpud serve --simulate dgx-a100" in text.stdout  # no GPU: what to try


@pytest.mark.parametrize("args", [["--simulate", "no-such-preset"], ["--simulate", "A100-SXM4-40GB:0"]])
def test_exit_2_for_a_simulated_node_that_cannot_be_made(args):
    result = _doctor(*args, "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    assert report["status"] == "cannot-run"


def test_holders_and_processes_are_reset_blockers_but_not_problems(tmp_path, short_tmp):
    held = short_tmp / "nvidia0"
    held.touch()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        open("/proc/self/comm", "w").write("nv-hostengine")
        f = open({str(held)!r}, "rb"); print("ready", flush=True); sys.stdin.read()""")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert Lines(holder.stdout, "the holder").next("ready").strip() == "ready"
        nvml = started("dgx-a100", tmp_path / "state.json")
        nvml.sim_set_processes(0, [holder.pid, 4242])  # a process holding the node and running on the GPU: once
        nvml.nvmlShutdown()
        report = doctor_checks.examine(nvml, simulated=False, smi_path=None, dev=short_tmp)
    finally:
        holder.stdin.close()
        holder.wait(10)
    jsonschema.validate(report, SCHEMA)
    assert report["status"] == "ok"
    assert report["gpus"][0]["reset_blockers"] == [
        f"PID {holder.pid} (nv-hostengine) holds {held}: stop DCGM (systemctl stop nvidia-dcgm) and start it "
        "again after the reset",
        "PID 4242 (?) runs on the GPU: stop it, or wait for it to finish"]
    assert report["gpus"][0]["compute_processes"] == [{"pid": pid, "name": None} for pid in sorted([holder.pid, 4242])]
    assert report["gpus"][1]["reset_blockers"] == []
    assert "doctor's own NVML session is not counted as a reset blocker: it ends when doctor exits" in report["notes"]


def test_a_down_nvlink_is_noted_and_boards_without_nvlink_or_bridge_are_fine(tmp_path):
    nvml = started("dgx-a100", tmp_path / "a100.json")
    nvml.sim_set_nvlink(1, 3, up=False)
    nvml.nvmlShutdown()
    report = doctor_checks.examine(nvml, simulated=True, smi_path=None)
    assert report["gpus"][1]["nvlink"] == {"links": 12, "active": 11, "inactive": 1,
                                           "summary": "1 of 12 links inactive"}
    assert any(n.startswith("GPU 1: 1 of 12 links inactive") for n in report["notes"])
    t4 = doctor_checks.examine(SimulatedNvml("t4", tmp_path / "t4.json"), simulated=True, smi_path=None)
    assert t4["gpus"][0]["nvlink"]["summary"] == "no NVLink" and t4["gpus"][0]["mig"] == {"capable": False}
    assert t4["status"] == "ok"
    # NVLink-capable PCIe boards without a bridge report every link inactive: not a fault (reference README).
    pcie = doctor_checks.examine(SimulatedNvml("A100-PCIE-80GB:2", tmp_path / "pcie.json"), simulated=True, smi_path=None)
    assert [gpu["nvlink"]["summary"] for gpu in pcie["gpus"]] == ["no bridge: all 12 links inactive"] * 2
    assert pcie["status"] == "ok" and not any("inactive" in n for n in pcie["notes"])


def test_simulated_holders_are_the_reset_blockers_of_a_simulated_node(tmp_path):
    nvml = started("dgx-a100", tmp_path / "state.json")
    nvml.sim_add_holder(3, "nvidia-persistenced", 1234)
    nvml.nvmlShutdown()
    report = doctor_checks.examine(nvml, simulated=True, smi_path=None)
    assert report["gpus"][3]["reset_blockers"] == [
        "PID 1234 (nvidia-persistenced) holds /dev/nvidia3: stop it (systemctl stop nvidia-persistenced) or turn "
        "persistence mode off for this GPU (nvidia-smi -pm 0 -i <GPU>), and restore it after the reset"]
    assert [gpu["reset_blockers"] for gpu in report["gpus"] if gpu["index"] != 3] == [[]] * 7
    assert report["status"] == "ok"


def test_an_r580_node_agrees_with_the_real_h100_profile_table(fake_smi):
    # R580 answers the profile queries with MIG off (our capture): the simulated H100's table is then
    # compared with the real `nvidia-smi mig -lgip`, and only the node's identity differs.
    result = _doctor("--simulate", "H100-SXM5-80GB:1", "--sim-driver", "580.65.06", "--json", path=str(fake_smi))
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["gpus"][0]["mig"]["profiles_readable"] is True
    assert len(report["gpus"][0]["mig"]["profiles"]) == 7
    assert not any("profile" in m for m in report["nvidia_smi"]["mismatches"]), report["nvidia_smi"]["mismatches"]
    assert len(report["nvidia_smi"]["mismatches"]) == 2  # driver version and UUID


def test_an_r535_node_without_mig_gives_no_profile_table_and_that_is_a_note():
    # R535 answers NOT_SUPPORTED to the profile queries while MIG is off (NVIDIA/mig-parted 219e780d).
    result = _doctor("--simulate", "hgx-h100", "--sim-driver", "535.183.01", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    assert all(gpu["mig"]["profiles_readable"] is False for gpu in report["gpus"])
    assert report["notes"][0].startswith("GPUs 0, 1, 2, 3, 4, 5, 6, 7: the driver does not give the MIG profile")


def test_a_driver_older_than_r535_is_a_problem():
    result = _doctor("--simulate", "t4", "--sim-driver", "470.82.01", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["driver"]["supported"] is False and report["driver"]["minimum_branch"] == 535
    assert report["problems"] == ["NVIDIA driver 470.82.01 is older than gpud's minimum branch R535: install "
                                  "driver 535 or newer"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_as_non_root_the_mig_instance_reads_are_listed_with_what_gpud_loses(short_tmp):
    short_tmp.chmod(0o777)
    state = short_tmp / "state.json"
    staged = started("dgx-a100", state)
    fill_with_gpu_instances(staged, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    staged.nvmlShutdown()
    state.chmod(0o666)
    result = _doctor("--simulate", "dgx-a100", "--sim-state", str(state), "--json",
                     user=[shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"])
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    jsonschema.validate(report, SCHEMA)
    assert {(d["gpu"], d["read"]) for d in report["permissions"]["denied"]} == \
        {(gpu, "mig.gpu_instances") for gpu in range(8)}
    assert report["permissions"]["summary"] == "running as uid 65534: 8 reads need root; mig, reset, mps need root"
    assert [c["change"] for c in report["permissions"]["changes_need_root"]] == ["mig", "reset", "mps"]
    assert report["gpus"][0]["mig"]["gpu_instance_count"] is None
    assert report["running_as_root"] is False
    assert any(n.startswith("not root: other users' processes") for n in report["notes"])


@pytest.mark.parametrize("run", ["root", "nobody", "busy"])
def test_reports_from_real_h100_runs_match_the_schema(run):
    report = json.loads((REPO / f"tests/fixtures/doctor/h100-580.159.04-{run}.json").read_text())
    jsonschema.validate(report, SCHEMA)
    assert report["status"] == "ok" and report["nvidia_smi"]["compared"] and report["nvidia_smi"]["mismatches"] == []
    assert report["gpus"][0]["fabric"]["state"] == "not-supported"  # the query answers, with no fabric, in a VM


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_as_non_root_doctor_names_the_changes_the_driver_keeps_for_root(short_tmp):
    """Every read answers an ordinary user with MIG off, yet gpud run as that user could not apply a
    MIG layout, reset a GPU or run MPS: doctor says so, where a text reader looks, with the sources."""
    short_tmp.chmod(0o777)
    result = _doctor("--simulate", "dgx-a100", "--sim-state", str(short_tmp / "state.json"),
                     user=[shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "permissions  running as uid 65534: every read answered; mig, reset, mps need root" in result.stdout
    for needed in ("MIG changes (gpud mig apply", "GPU resets (gpud gpus reset", "MPS (gpud sets the compute mode"):
        assert f"  {needed}" in result.stdout and '"Requires root' in result.stdout
    as_root = _doctor("--simulate", "dgx-a100", "--sim-state", str(short_tmp / "state.json"), "--json")
    assert json.loads(as_root.stdout)["permissions"]["changes_need_root"] == []
