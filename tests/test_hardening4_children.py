"""Children and peers that flood, trickle, hang or nest (issue 38, defects 2, 10 and 11): one runner
(gpud.base.child) with a deadline over the whole exchange and a cap on output, used by every place
gpud runs a program; gpud's own answers read by `gpud slurm health` bounded the same way."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_slurm_health import answering_gpud, gpu, line, reason, send, view

from gpud.base import child
from gpud.client import Client, DaemonUnreachable
from gpud.health.diag import MAX_OUTPUT_BYTES, run_diag
from gpud.slurm.health import EXIT_GPUD_ANSWER, EXIT_UNREACHABLE, HealthCheckFailed, Scontrol

REPO = Path(__file__).resolve().parent.parent


def script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


# -- the runner -------------------------------------------------------------------------------------


def test_a_flooding_child_is_stopped_at_the_cap_not_drained():
    started = time.monotonic()
    run = child.run_sync(["sh", "-c", "exec yes"], timeout_s=60, output_cap=100_000)
    assert run.overflowed and run.exit_code is None and len(run.stdout) == 100_000
    assert time.monotonic() - started < 5
    assert "printed more than 100000 bytes" in run.failure(60, 100_000)


def test_a_trickling_child_is_ended_at_the_deadline_with_its_group():
    started = time.monotonic()
    run = child.run_sync(["sh", "-c", "sleep 300 & while true; do printf a; sleep 0.05; done"], timeout_s=1)
    assert run.timed_out and run.exit_code is None and run.stdout.startswith(b"a")
    assert time.monotonic() - started < 3
    assert "did not finish within 1 s" in run.failure(1, child.DEFAULT_OUTPUT_CAP)
    left = subprocess.run(["pgrep", "-f", "sleep 300"], capture_output=True, text=True, timeout=10).stdout
    assert left == "", "the child's group outlived it"


def test_input_is_written_whole_and_both_streams_are_kept():
    run = child.run_sync(["sh", "-c", "cat; echo said >&2; exit 4"], timeout_s=10, stdin=b"x" * 300_000)
    assert run.exit_code == 4 and run.stdout == b"x" * 300_000 and run.stderr == b"said\n"


def test_a_program_that_cannot_start_is_an_oserror():
    with pytest.raises(FileNotFoundError):
        child.run_sync(["/nonexistent/scontrol"], timeout_s=1)


async def test_a_cancelled_caller_stops_its_child():
    task = asyncio.create_task(child.run(["sleep", "301"], timeout_s=60))
    await asyncio.sleep(0.3)  # fixed time: the child has started
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    left = subprocess.run(["pgrep", "-f", "sleep 301"], capture_output=True, text=True, timeout=10).stdout
    assert left == ""


def test_only_the_runner_starts_children():
    """Every place gpud runs a program goes through gpud.base.child (the deadline and the cap). The CDI
    hook is run as a file in a container's namespaces and imports nothing of gpud: its ldconfig runs with
    a timeout and its output not captured."""
    spawners = []
    for path in (REPO / "gpud").rglob("*.py"):
        if path == REPO / "gpud" / "cdi" / "hook.py":
            continue
        text = path.read_text()
        if any(word in text for word in ("subprocess.run(", "subprocess.Popen(", "create_subprocess_",
                                         "subprocess.check_output(", "os.system(")):
            spawners.append(str(path.relative_to(REPO)))
    assert spawners == ["gpud/base/child.py"], spawners


# -- dcgmi --------------------------------------------------------------------------------------------


async def test_a_flooding_dcgmi_is_ended_at_the_cap_not_read_until_the_check_timeout(tmp_path):
    dcgmi = script(tmp_path, "dcgmi", "exec yes '{\"DCGM Diagnostic\": '\n")
    started = time.monotonic()
    run = await run_diag(str(dcgmi), 1, [0], timeout_s=1800)
    assert time.monotonic() - started < 10
    assert run.outcome == "error" and f"printed more than {MAX_OUTPUT_BYTES} bytes" in run.error
    assert len(run.output.encode()) < MAX_OUTPUT_BYTES + 200


async def test_a_dcgmi_answer_nested_40000_deep_is_a_clear_error_not_a_recursion_error(tmp_path):
    depth = 40_000
    dcgmi = script(tmp_path, "dcgmi", f"printf '%s' '{'[' * depth}{']' * depth}'\n")
    run = await run_diag(str(dcgmi), 1, [0], timeout_s=30)
    assert run.outcome == "error" and "nests lists or objects more than 64 deep" in run.error


# -- scontrol -----------------------------------------------------------------------------------------


def test_a_flooding_scontrol_is_cut_quickly_in_slurm_health(tmp_path):
    scontrol = script(tmp_path, "scontrol", "exec yes NodeName=vm\n")
    started = time.monotonic()
    with pytest.raises(HealthCheckFailed, match="printed more than 65536 bytes"):
        Scontrol(str(scontrol), time.monotonic() + 20, dry_run=False).show_node("vm")
    assert time.monotonic() - started < 5


def test_a_trickling_scontrol_is_ended_at_the_checks_deadline(tmp_path):
    scontrol = script(tmp_path, "scontrol", "while true; do printf N; sleep 0.1; done\n")
    started = time.monotonic()
    with pytest.raises(HealthCheckFailed, match="did not finish within"):
        Scontrol(str(scontrol), time.monotonic() + 1.5, dry_run=False).show_node("vm")
    assert time.monotonic() - started < 4


# -- gpud's answers, as `gpud slurm health` reads them -------------------------------------------------


MEASURED = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print('maxrss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
            "sys.exit(r.returncode)")


def slurm_health(socket: Path, scontrol: Path, *args: str,
                 timeout: float = 60) -> tuple[subprocess.CompletedProcess, int]:
    """`gpud slurm health`, its exit, its output and its peak memory (KiB)."""
    command = [sys.executable, "-c", MEASURED, sys.executable, "-m", "gpud", "slurm", "health", "--socket",
               str(socket), "--scontrol", str(scontrol), "--node-name", "vm", *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=timeout,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    peak = int(result.stderr.rsplit("maxrss_kib ", 1)[1].split()[0])
    result.stderr = result.stderr.rsplit("maxrss_kib ", 1)[0]
    return result, peak


def node_scontrol(directory: Path) -> Path:
    return script(directory, "scontrol", f"[ \"$1\" = show ] && printf '%s' '{line('IDLE')}'\nexit 0\n")


def test_a_500_mb_answer_is_not_read_whole(tmp_path):
    def flood(handler):
        handler.send_response(200)
        handler.end_headers()  # no length: read until closed
        block = b"0" * (1 << 20)
        for _ in range(500):
            handler.wfile.write(block)

    with answering_gpud(flood) as path:
        result, peak_kib = slurm_health(path, node_scontrol(tmp_path), "--timeout", "20")
    assert result.returncode == EXIT_GPUD_ANSWER, result
    assert "over the 16777216 bytes this client reads" in result.stderr and "Traceback" not in result.stderr
    assert peak_kib < 200 * 1024, f"peak {peak_kib} KiB"


def test_an_answer_saying_it_is_500_mb_is_refused_before_it_is_read(tmp_path):
    with answering_gpud(lambda handler: send(handler, 200, b"{", length=500 << 20)) as path:
        result, _ = slurm_health(path, node_scontrol(tmp_path), "--timeout", "20")
    assert result.returncode == EXIT_GPUD_ANSWER and "is 524288000 bytes" in result.stderr, result


def test_a_trickled_answer_times_out_within_the_checks_timeout(tmp_path):
    def trickle(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "100000")
        handler.end_headers()
        for _ in range(1000):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.2)

    started = time.monotonic()
    with answering_gpud(trickle) as path:
        result, _ = slurm_health(path, node_scontrol(tmp_path), "--timeout", "3")
    assert result.returncode == EXIT_UNREACHABLE and "did not answer whole within" in result.stderr, result
    assert time.monotonic() - started < 3 + 5  # the check's --timeout, and Python's start


def raw_answer(*parts: bytes, pause_s: float = 0.0):
    """An answer written as bytes (what no HTTP server library would send), pause_s between its parts."""
    def answer(handler):
        for number, part in enumerate(parts):
            if number:
                time.sleep(pause_s)
            handler.wfile.write(part)
    return answer


@pytest.mark.parametrize("answer, said", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", "a Content-Length of '\xb2'"),
    (b"HTTP/1.1 \xb200 OK\r\nContent-Length: 0\r\n\r\n", "a status line of 'HTTP/1.1 \xb200 OK'"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\n{}\r\n0\r\n\r\n", "a chunk size of b'-2'"),
])
def test_a_number_in_an_answer_that_is_not_ascii_digits_is_refused_not_a_traceback(answer, said):
    """latin-1's superscripts pass str.isdigit() and fail int(); int(..., 16) takes a sign."""
    with answering_gpud(raw_answer(answer)) as path:
        with pytest.raises(DaemonUnreachable, match=re.escape(said)):
            Client(path, timeout=10).get("/v1/health")


def test_an_endless_trailer_section_is_refused_at_a_heads_bound():
    trailers = b"X-Trailer: y\r\n" * 10_000
    with answering_gpud(raw_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n",
                                   *[trailers] * 100)) as path:
        with pytest.raises(DaemonUnreachable, match="a trailer section over 65536 bytes"):
            Client(path, timeout=10).get("/v1/health")


def test_a_stream_whose_head_never_comes_ends_at_the_clients_timeout_and_its_events_have_none():
    with answering_gpud(lambda handler: time.sleep(5)) as path:  # fixed time: no head within the 1 s timeout
        started = time.monotonic()
        with pytest.raises(DaemonUnreachable, match="did not answer whole within 1 s"):
            next(Client(path, timeout=1).stream("/v1/watch"))
        assert time.monotonic() - started < 3
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    with answering_gpud(raw_answer(head, b"b\r\n{\"seq\": 1}\n\r\n0\r\n\r\n", pause_s=1.5)) as path:
        assert list(Client(path, timeout=1).stream("/v1/watch")) == [{"seq": 1}]


def test_an_answer_nested_40000_deep_is_a_documented_exit_not_a_traceback(tmp_path):
    deep = b"[" * 40_000 + b"]" * 40_000
    with answering_gpud(lambda handler: send(handler, 200, deep)) as path:
        result, _ = slurm_health(path, node_scontrol(tmp_path), "--timeout", "20")
    assert result.returncode == EXIT_GPUD_ANSWER, result
    assert "Traceback" not in result.stderr and "nests lists or objects more than 64 deep" in result.stderr


def test_a_10_mb_reason_is_not_written_whole_to_slurmds_log(tmp_path):
    document = view(gpu(0), gpu(2, "unhealthy", [reason("xid", "7" * (10 << 20), "reboot")]))
    updates = tmp_path / "updates"
    scontrol = script(tmp_path, "scontrol", f"[ \"$1\" = show ] && printf '%s' '{line('IDLE')}' && exit 0\n"
                                            f"printf '%s\\n' \"$@\" >> {updates}\n")
    with answering_gpud(lambda handler: send(handler, 200, json.dumps(document).encode())) as path:
        result, _ = slurm_health(path, scontrol, "--timeout", "20")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(result.stdout) < 4096 and "more characters)" in result.stdout
    assert all(len(argument) < 300 for argument in updates.read_text().splitlines())


def _peak_rss_kib() -> int:
    for status_line in Path("/proc/self/status").read_text().splitlines():
        if status_line.startswith("VmHWM:"):
            return int(status_line.split()[1])
    raise AssertionError("no VmHWM")


async def test_a_flooding_scontrol_reconfigure_is_cut_and_gpud_does_not_grow(short_tmp):
    """slurm.reconfigure with an scontrol that floods: gpud grew by 1.78 GB reading it whole."""
    from helpers import start_daemon, stop_daemon, until_async
    from test_slurm_gres import gres_view, slurm_config

    from gpud.slurm.writer import OUTPUT_CAP

    scontrol = script(short_tmp, "scontrol", "exec yes 'scontrol floods'\n")
    before = _peak_rss_kib()
    node = await start_daemon(slurm_config(short_tmp, reconfigure=True, scontrol=str(scontrol)))
    try:
        view = await until_async(lambda: gres_view(node, lambda v: v["reconfigure"]["last"]), timeout=10,
                                 what="scontrol ran")
        last = view["reconfigure"]["last"]
        assert last["returncode"] is None and f"printed more than {OUTPUT_CAP} bytes" in last["output"]
        assert len(last["output"]) < 4096 + 300
    finally:
        await stop_daemon(node)
    assert _peak_rss_kib() - before < 100 * 1024, "gpud grew while scontrol flooded"
