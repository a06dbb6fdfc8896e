"""Fixtures shared by the test modules; the plain helpers they use are in helpers.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import (ADMINS, IN_CI, MPS_CONTROL, READERS, SYSTEM_PATH, USERS, GpudProcess, accounts_lock,
                     kill_mps_under)


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
            process.proc.wait()


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("CI runs as root")
        pytest.skip("needs root to create users and groups")
    with accounts_lock():
        for group in (READERS, ADMINS):
            subprocess.run([shutil.which("groupadd", path=SYSTEM_PATH), "-f", group], check=True)
        for user, groups in USERS.items():
            subprocess.run([shutil.which("useradd", path=SYSTEM_PATH), "-M", user], capture_output=True)
            subprocess.run([shutil.which("usermod", path=SYSTEM_PATH), "-G", ",".join(groups) or "", user],
                           check=True)
    return USERS


@pytest.fixture
def mps_tmp(short_tmp):
    if MPS_CONTROL is None:
        if IN_CI:
            pytest.fail("CI must have nvidia-cuda-mps installed (scripts/test-all installs it)")
        pytest.skip("nvidia-cuda-mps-control is not installed (apt-get install nvidia-cuda-mps, non-free)")
    yield short_tmp
    kill_mps_under(short_tmp)  # MPS outlives gpud by design: the test cleans up after itself
