"""Fixtures shared by the test modules; the plain helpers they use are in helpers.py."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# --pure-python (tests/pure_python.py): the compiled modules of gpud's libraries are refused before
# anything imports them (helpers imports aiohttp and gpud). The controlling pytest sees the option in
# its arguments; its xdist workers, started later, inherit the environment variable it sets.
import pure_python  # noqa: E402,I001

PURE_PYTHON = "--pure-python" in sys.argv[1:] or os.environ.get(pure_python.ENV) == "1"
if PURE_PYTHON:
    pure_python.install()

from helpers import (ADMINS, IN_CI, MPS_CONTROL, READERS, REPO, SYSTEM_PATH, USERS, GpudProcess, accounts_lock,
                     kill_mps_under)
from nspawn_root import Release, build_release


# -- deadlines ------------------------------------------------------------------------------------
# pytest-timeout fails a test that runs past its limit (pyproject's `timeout` for a unit test,
# SLOW_TEST_TIMEOUT_S for one marked slow; its fixtures count) at the line it is stuck on, every
# thread's stack in its report. Should that signal never get through (a thread stuck in C code with
# the GIL, signals blocked), faulthandler writes every thread's traceback to the real stderr a little
# later and ends the process: xdist then names the test its worker was running.
SLOW_TEST_TIMEOUT_S = 900
LAST_RESORT_AFTER_S = 30
_real_stderr = pytest.StashKey()


def pytest_addoption(parser):
    parser.addoption("--pure-python", action="store_true",
                     help="run on the pure-Python builds of aiohttp, yarl, multidict, frozenlist, propcache, "
                          "PyYAML and protobuf (their compiled modules refused, as on the package's pure/ tree); "
                          "tests that need grpcio are skipped")


def pytest_configure(config):
    if config.getoption("pure_python") and not PURE_PYTHON:
        raise pytest.UsageError("--pure-python must be on the command line (tests/conftest.py reads it before "
                                "pytest parses options)")
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        config.stash[_real_stderr] = os.fdopen(os.dup(sys.stderr.fileno()), "w")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("slow") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    if settings.timeout > 0:
        faulthandler.dump_traceback_later(settings.timeout + LAST_RESORT_AFTER_S, exit=True,
                                          file=item.config.stash[_real_stderr])
    # None: pytest-timeout sets its own timer as well


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item):
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """--pure-python: a test module that cannot import grpc is skipped, saying why."""
    outcome = yield
    report = outcome.get_result()
    if PURE_PYTHON and report.failed and isinstance(collector, pytest.Module) \
            and pure_python.GRPC_REFUSED in str(report.longrepr):
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, f"Skipped: {pure_python.GRPC_REASON}")


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=PURE_PYTHON)
def no_compiled_library_modules():
    """--pure-python: at the end of the session (of each xdist worker), not one compiled module of the
    libraries got loaded."""
    yield
    assert not pure_python.loaded(), f"--pure-python, yet loaded: {pure_python.loaded()}"



@pytest.fixture
def short_tmp():
    """A directory with a short path: Unix socket paths are limited to 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="gpt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def run_gpud(short_tmp):
    started: list[GpudProcess] = []

    def start(*args: str, env: dict | None = None) -> GpudProcess:
        process = GpudProcess(short_tmp, *args, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.proc.poll() is None:
            process.proc.kill()
            process.proc.wait(10)


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root")
        pytest.skip("needs root to create users and groups")
    with accounts_lock():
        for group in (READERS, ADMINS):
            subprocess.run([shutil.which("groupadd", path=SYSTEM_PATH), "-f", group], check=True, timeout=60)
        for user, groups in USERS.items():
            subprocess.run([shutil.which("useradd", path=SYSTEM_PATH), "-M", user], capture_output=True, timeout=60)
            subprocess.run([shutil.which("usermod", path=SYSTEM_PATH), "-G", ",".join(groups) or "", user],
                           check=True, timeout=60)
    return USERS


@pytest.fixture
def mps_tmp(short_tmp):
    if MPS_CONTROL is None:
        if IN_CI:
            pytest.fail("CI must have nvidia-cuda-mps installed (scripts/test-all installs it)")
        pytest.skip("nvidia-cuda-mps-control is not installed (apt-get install nvidia-cuda-mps, non-free)")
    yield short_tmp
    kill_mps_under(short_tmp)  # MPS outlives gpud by design: the test cleans up after itself


# -- gpud as packaged ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def release() -> Release:
    """Version N: the checkout, packaged once for every end-to-end module (test_e2e_systemd, test_e2e_slurm:
    the same pytest-xdist worker runs them, xdist_group "packages")."""
    needed = ("debootstrap", "systemd-nspawn", "nsenter", "dpkg-deb")
    if os.geteuid() != 0 or any(shutil.which(tool, path=SYSTEM_PATH) is None for tool in needed):
        if IN_CI:
            pytest.fail(f"CI runs as root with {', '.join(needed)} (scripts/test-all installs them)")
        pytest.skip("needs root, debootstrap and systemd-nspawn")
    return build_release(REPO)
