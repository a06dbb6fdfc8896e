"""gpud.base.host against real processes: who holds a device open, what would block a GPU reset."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO, Lines

from gpud.base.host import Holder, device_holders, loaded_modules, reset_blockers

CAPTURE = REPO / "tests/fixtures/hardware/h100-sxm5-580.159.04/capture.log"

# A child that renames itself (as /proc/<pid>/comm shows it), opens a file and waits for stdin to close.
_HOLDER = textwrap.dedent("""
    import sys
    name, path = sys.argv[1], sys.argv[2]
    with open("/proc/self/comm", "w") as comm:
        comm.write(name)
    held = open(path, "rb")
    print("ready", flush=True)
    sys.stdin.read()
""")


class HeldFile:
    """A real process holding `path` open under the program name `name`, until close()."""

    def __init__(self, path: Path, name: str = "holder-test"):
        path.touch()
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, name, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert Lines(self.proc.stdout, f"the holder of {path}").next("ready").strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def hold(tmp_path):
    held: list[HeldFile] = []

    def start(name: str, process: str = "holder-test") -> HeldFile:
        held.append(HeldFile(tmp_path / name, process))
        return held[-1]

    yield start
    for h in held:
        if h.proc.poll() is None:
            h.proc.kill()
            h.proc.wait(10)


def _proc_view(root: Path, pids: list[int], modules: str | None = None) -> Path:
    """A directory laid out like /proc whose pid entries are the real /proc/<pid> of these processes."""
    root.mkdir()
    for pid in pids:
        (root / str(pid)).symlink_to(f"/proc/{pid}")
    if modules is not None:
        (root / "modules").write_text(modules)
    return root


def _captured_proc_modules() -> str:
    """The /proc/modules lines of our real H100 capture (driver 580, no nvidia_drm loaded)."""
    lines = CAPTURE.read_text().splitlines()
    start = lines.index("+ cat /proc/modules")
    return "\n".join(line for line in lines[start + 1:start + 6] if " Live " in line) + "\n"


# -- device_holders --------------------------------------------------------------------------------


def test_a_process_holding_the_path_is_found_with_its_program_name(hold, tmp_path):
    held = hold("nvidia3", "nv-hostengine")
    other = hold("unrelated")
    found = device_holders([str(held.path)])
    assert found == [Holder(pid=held.pid, process="nv-hostengine", device=str(held.path))]
    assert other.pid not in {h.pid for h in found}


def test_every_holder_of_every_path_is_listed_once(hold, tmp_path):
    first, second = hold("nvidia0", "first"), hold("nvidia1", "second")
    found = device_holders([str(first.path), str(second.path), str(first.path)])
    assert found == [Holder(first.pid, "first", str(first.path)), Holder(second.pid, "second", str(second.path))]


def test_a_path_given_through_a_symlink_is_reported_as_given(hold, tmp_path):
    held = hold("real-node")
    alias = tmp_path / "alias"
    alias.symlink_to(held.path)
    assert device_holders([str(alias)]) == [Holder(held.pid, "holder-test", str(alias))]


def test_excluded_pids_and_closed_files_are_not_holders(hold, tmp_path):
    held = hold("nvidia2")
    assert device_holders([str(held.path)], exclude_pids={held.pid}) == []
    held.close()
    assert device_holders([str(held.path)]) == []
    assert device_holders([str(tmp_path / "never-opened")]) == []


def test_a_process_gone_before_its_turn_in_the_scan_is_skipped(hold, tmp_path):
    # The scan lists the pids first, then reads each one's fds: a process that exits in between
    # leaves a listed pid whose fd directory no longer exists.
    held = hold("nvidia4")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    proc = _proc_view(tmp_path / "proc", [gone.pid, held.pid])
    assert not (proc / str(gone.pid) / "fd").exists()
    assert device_holders([str(held.path)], proc=proc) == [Holder(held.pid, "holder-test", str(held.path))]


def test_processes_starting_and_exiting_during_scans_never_break_them(hold, tmp_path):
    held = hold("nvidia5")
    churn = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(8)]
    try:
        for _ in range(5):
            assert device_holders([str(held.path)]) == [Holder(held.pid, "holder-test", str(held.path))]
    finally:
        for child in churn:
            child.wait(10)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_users_processes_are_skipped_silently_by_a_non_root_scan(hold, tmp_path):
    held = hold("nvidia6")
    tmp_path.chmod(0o755)
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from gpud.base.host import device_holders; "
              f"print(device_holders([{str(held.path)!r}]))")
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                             script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"  # root's process holds it, but nobody may read root's fds


# -- loaded_modules --------------------------------------------------------------------------------


def test_loaded_modules_parses_a_real_proc_modules(tmp_path):
    proc = _proc_view(tmp_path / "proc", [], _captured_proc_modules())
    assert loaded_modules(proc) == {"nvidia_uvm", "nvidia"}


def test_loaded_modules_is_empty_when_proc_modules_is_missing(tmp_path):
    assert loaded_modules(_proc_view(tmp_path / "proc", [])) == set()


# -- reset_blockers --------------------------------------------------------------------------------


def test_each_holder_of_the_gpu_node_is_a_blocker_with_advice(hold, tmp_path):
    dcgm, persistenced = hold("nvidia3", "nv-hostengine"), hold("nvidia3", "nvidia-persistenced")
    unknown = hold("nvidia3", "train.py")
    elsewhere = hold("nvidia7", "nvidia-smi")
    proc = _proc_view(tmp_path / "proc", [dcgm.pid, persistenced.pid, unknown.pid, elsewhere.pid],
                      _captured_proc_modules())
    lines = reset_blockers(3, proc=proc, dev=tmp_path)
    device = tmp_path / "nvidia3"
    assert lines == sorted(lines, key=lambda line: int(line.split()[1]))
    assert f"PID {dcgm.pid} (nv-hostengine) holds {device}: stop DCGM (systemctl stop nvidia-dcgm)" \
           " and start it again after the reset" in lines
    # comm keeps 15 characters: "nvidia-persistenced" reads "nvidia-persiste"
    assert any(line.startswith(f"PID {persistenced.pid} (nvidia-persiste) holds {device}: stop it "
                               "(systemctl stop nvidia-persistenced) or turn persistence mode off") for line in lines)
    assert f"PID {unknown.pid} (train.py) holds {device}: stop it, or wait for it to finish" in lines
    assert len(lines) == 3  # nvidia7 is another GPU; the captured host has no nvidia_drm


def test_nvidia_drm_loaded_blocks_a_reset_and_own_pid_does_not(hold, tmp_path):
    mine = hold("nvidia0", "gpud")
    modules = _captured_proc_modules() + "nvidia_drm 135168 2 - Live 0xffffffffc0e1c000 (PO)\n"
    proc = _proc_view(tmp_path / "proc", [mine.pid], modules)
    lines = reset_blockers(0, exclude_pids={mine.pid}, proc=proc, dev=tmp_path)
    assert len(lines) == 1
    assert lines[0].startswith("kernel module nvidia_drm is loaded:") and "rmmod nvidia_drm" in lines[0]


def test_a_free_gpu_has_no_blockers(tmp_path):
    assert reset_blockers(0, proc=_proc_view(tmp_path / "proc", [], ""), dev=tmp_path) == []


@pytest.mark.parametrize("minor", [-1, "3", 1.0, True, None])
def test_reset_blockers_refuses_a_bad_minor_number(minor):
    with pytest.raises(ValueError, match="minor number"):
        reset_blockers(minor)
