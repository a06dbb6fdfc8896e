"""The simulated driver's user-space file tree (gpud/nvml/sim/driver_tree.py): real ELF shared objects
with the driver's sonames that dlopen loads, an ld.so.cache the host's ldconfig reads as its own, kept
for its driver version and replaced for another."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import need

from gpud.base.ld_cache import read_ld_cache, write_ld_cache
from gpud.cdi.driver_files import find_driver_files
from gpud.nvml.sim.driver_tree import BINARIES, LIBRARIES, driver_tree_paths, firmware_names, library_dir, write_driver_tree

VERSION = "550.90.07"  # the simulator's default driver
LDCONFIG = "/sbin/ldconfig"


def ldconfig_listing(cache: Path) -> list[str]:
    """The libraries `ldconfig -p -C cache` prints, one line each (its header and footer left out)."""
    need(Path(LDCONFIG).exists(), f"{LDCONFIG} is absent")
    printed = subprocess.run([LDCONFIG, "-p", "-C", cache], capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    return [line.strip() for line in printed.stdout.splitlines() if line.startswith("\t")]


@pytest.fixture
def tree(short_tmp) -> Path:
    write_driver_tree(short_tmp / "sim.json.driver", VERSION)
    return short_tmp / "sim.json.driver"


def test_the_tree_holds_the_drivers_files(tree):
    lib = tree / library_dir()
    for stem, soname in LIBRARIES.items():
        assert os.readlink(lib / soname) == f"{stem}.so.{VERSION}"  # the link ldconfig makes
    assert all(os.access(tree / "usr" / "bin" / name, os.X_OK) for name in BINARIES)
    assert sorted(p.name for p in (tree / "lib" / "firmware" / "nvidia" / VERSION).iterdir()) == ["gsp_ga10x.bin", "gsp_tu10x.bin"]
    found = find_driver_files(tree, VERSION)  # as gpud's CDI writer finds a driver
    assert found.libraries == tuple(sorted(f"/{library_dir()}/{stem}.so.{VERSION}" for stem in LIBRARIES))
    assert found.binaries == tuple(f"/usr/bin/{name}" for name in BINARIES)
    assert found.firmware == (f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin", f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin")
    stand_in = subprocess.run([tree / "usr" / "bin" / "nvidia-smi"], capture_output=True, text=True, timeout=30)
    assert stand_in.returncode == 1 and "stand-in" in stand_in.stderr


def test_the_libraries_are_shared_objects_with_the_drivers_sonames_that_dlopen_loads(tree):
    need(shutil.which("readelf") is not None, "readelf (binutils) is not installed")
    lib = tree / library_dir()
    for stem, soname in LIBRARIES.items():
        path = lib / f"{stem}.so.{VERSION}"
        assert path.read_bytes()[:4] == b"\x7fELF"
        shown = subprocess.run(["readelf", "-h", "-d", "-l", path], capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0 and not shown.stderr, shown.stderr
        assert "DYN (Shared object file)" in shown.stdout and f"Library soname: [{soname}]" in shown.stdout
        assert "GNU_STACK" in shown.stdout  # no executable stack wanted
        assert ctypes.CDLL(str(lib / soname))._handle  # through the soname link, as a loader finds it
    with pytest.raises(AttributeError):  # it exports nothing: no CUDA or NVML call can be made
        ctypes.CDLL(str(lib / "libnvidia-ml.so.1")).nvmlInit_v2  # noqa: B018


def test_the_linker_cache_reads_as_the_hosts_ldconfig_writes_it(tree, short_tmp):
    wanted = sorted(f"{soname} (libc6,x86-64) => /{library_dir()}/{soname}" for soname in LIBRARIES.values())
    cache = tree / "etc" / "ld.so.cache"
    if os.uname().machine == "x86_64":
        assert sorted(ldconfig_listing(cache)) == wanted
    assert sorted(read_ld_cache(cache)) == sorted((soname, f"/{library_dir()}/{soname}") for soname in LIBRARIES.values())
    # what the host's ldconfig writes for the same tree: the same entries in the same order (ldconfig -r
    # chroots: root only)
    need(os.geteuid() == 0, "ldconfig -r needs root (it chroots)")
    copy = short_tmp / "copy"
    shutil.copytree(tree, copy, symlinks=True)
    made = subprocess.run([LDCONFIG, "-r", copy], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and not made.stderr, made.stderr
    assert ldconfig_listing(copy / "etc" / "ld.so.cache") == ldconfig_listing(cache)


def test_sonames_are_ordered_as_ldconfig_orders_them(short_tmp):
    """ld.so searches the cache by bisection in ldconfig's order: digits compare as numbers."""
    cache = short_tmp / "ld.so.cache"
    write_ld_cache(cache, [("libx.so.9", "/l/libx.so.9"), ("liba.so.1", "/l/liba.so.1"), ("libx.so.10", "/l/libx.so.10"),
                           ("libx-2.so.1", "/l/libx-2.so.1")])
    assert [soname for soname, _ in read_ld_cache(cache)] == ["libx.so.10", "libx.so.9", "libx-2.so.1", "liba.so.1"]


def test_a_tree_is_kept_for_its_version_and_replaced_for_another(tree):
    cache = (tree / "etc" / "ld.so.cache").stat()
    write_driver_tree(tree, VERSION)  # the same version: nothing is rewritten
    assert (tree / "etc" / "ld.so.cache").stat().st_ino == cache.st_ino
    write_driver_tree(tree, "580.65.06")  # `--sim-driver 580.65.06` on the same state
    assert sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file() or p.is_symlink()) == \
        driver_tree_paths("580.65.06")
    assert not find_driver_files(tree, VERSION).libraries
    assert len(find_driver_files(tree, "580.65.06").libraries) == len(LIBRARIES)
    assert not list(tree.parent.glob("*.partial-*"))


@pytest.mark.parametrize("version, names", [("580.65.06", ("gsp_ga10x.bin", "gsp_tu10x.bin")),
                                            ("525.147.05", ("gsp_ad10x.bin", "gsp_tu10x.bin")),
                                            ("470.256.02", ("gsp.bin",)), ("460.106.00", ())])
def test_the_gsp_firmware_is_named_as_the_driver_of_that_version_names_it(version, names):
    assert firmware_names(version) == names
