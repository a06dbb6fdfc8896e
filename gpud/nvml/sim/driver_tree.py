"""The user-space file tree of the NVIDIA driver a simulated node runs, under a root of its own
(<root>/usr/lib/..., <root>/etc/ld.so.cache, ...), made in Python without root or a compiler, so that
gpud's CDI spec carries the driver's files on a simulated node as on a real one.

What the driver's .run installs for compute (NVIDIA driver README, "Installed Components", e.g.
https://download.nvidia.com/XFree86/Linux-x86_64/550.54.14/README/installedcomponents.html; the
compute, utility and video set is NVIDIA/libnvidia-container src/nvc_info.c utility_libs,
compute_libs, video_libs):
- libraries lib<name>.so.<version> in the distribution's multiarch directory (Debian's
  /usr/lib/x86_64-linux-gnu), each with its soname link (lib<name>.so.1; libnvidia-nvvm.so.4) as
  ldconfig makes it, listed in <root>/etc/ld.so.cache as `ldconfig -r <root>` would list them;
- nvidia-smi, nvidia-debugdump, nvidia-persistenced, nvidia-cuda-mps-control, nvidia-cuda-mps-server
  in /usr/bin;
- the GSP firmware /lib/firmware/nvidia/<version>/gsp_*.bin: the driver ships one file per group of
  GPU families, all of them whatever the GPUs (open-gpu-kernel-modules kernel-open/common/inc/
  nv-firmware.h, nv_firmware_path: since R530, gsp_tu10x.bin for Turing and GA100 (A100, A30),
  gsp_ga10x.bin for GA10x, Ada, Hopper and Blackwell; R525 named the latter gsp_ad10x.bin; R465 to
  R520 had one gsp.bin).

Stand-ins, not the driver: each library is a minimal valid ELF64 shared object of this machine that
carries its soname and exports nothing, so `readelf -d` shows the soname, ldconfig takes it and
dlopen loads it, but no CUDA or NVML call can be made through it; the binaries are shell scripts that
say so and fail; the firmware files are a line of text."""

from __future__ import annotations

import os
import platform
import shutil
import struct
from pathlib import Path

from gpud.base.ld_cache import write_ld_cache

from .drivers import parse_driver

LIBRARIES = {"libcuda": "libcuda.so.1", "libcudadebugger": "libcudadebugger.so.1", "libnvidia-ml": "libnvidia-ml.so.1",
             "libnvidia-ptxjitcompiler": "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm": "libnvidia-nvvm.so.4",
             "libnvidia-cfg": "libnvidia-cfg.so.1", "libnvidia-opencl": "libnvidia-opencl.so.1",
             "libnvidia-allocator": "libnvidia-allocator.so.1", "libnvidia-encode": "libnvidia-encode.so.1",
             "libnvcuvid": "libnvcuvid.so.1", "libnvidia-opticalflow": "libnvidia-opticalflow.so.1"}
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
BINARY_DIR = "usr/bin"
FIRMWARE_DIR = "lib/firmware/nvidia"
# e_machine (System V gABI; glibc elf.h EM_X86_64, EM_AARCH64)
_ELF_MACHINES = {"x86_64": 62, "aarch64": 183}
_STAND_IN_BINARY = "#!/bin/sh\necho '{name}: a stand-in made by the NVIDIA driver simulator of gpud, not the tool' >&2\nexit 1\n"
_STAND_IN_FIRMWARE = b"a stand-in of gpud's NVIDIA driver simulator, not NVIDIA's GSP firmware\n"


def library_dir() -> str:
    """Where the driver's libraries go, below the root: the multiarch directory of Debian and Ubuntu."""
    return f"usr/lib/{platform.machine()}-linux-gnu"


def firmware_names(version: str) -> tuple[str, ...]:
    major = int(version.split(".")[0])
    if major >= 530:
        return ("gsp_ga10x.bin", "gsp_tu10x.bin")
    if major >= 525:
        return ("gsp_ad10x.bin", "gsp_tu10x.bin")
    return ("gsp.bin",) if major >= 465 else ()


def driver_tree_paths(version: str) -> list[str]:
    """Every file and link of the tree of a driver version, relative to its root."""
    lib = library_dir()
    return sorted([*(f"{lib}/{stem}.so.{version}" for stem in LIBRARIES), *(f"{lib}/{soname}" for soname in LIBRARIES.values()),
                   *(f"{BINARY_DIR}/{name}" for name in BINARIES),
                   *(f"{FIRMWARE_DIR}/{version}/{name}" for name in firmware_names(version)),
                   "etc/ld.so.conf", "etc/ld.so.cache"])


def write_driver_tree(root: Path, driver: str | None) -> None:
    """Makes root hold the tree of the simulated driver version (None: the simulator's default). A tree
    of that version is kept; one of another version is replaced. Built beside root and renamed into
    place, so a tree at root is always whole."""
    if platform.machine() not in _ELF_MACHINES:  # no stand-in for this machine: the spec has device nodes only
        return
    version = parse_driver(driver).version
    wanted = driver_tree_paths(version)
    if root.is_dir() and _entries(root) == wanted:
        return
    building = root.with_name(f"{root.name}.partial-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    lib = building / library_dir()
    lib.mkdir(parents=True)
    for stem, soname in LIBRARIES.items():
        (lib / f"{stem}.so.{version}").write_bytes(shared_object(soname))
        (lib / f"{stem}.so.{version}").chmod(0o755)
        os.symlink(f"{stem}.so.{version}", lib / soname)
    (building / BINARY_DIR).mkdir(parents=True)
    for name in BINARIES:
        (building / BINARY_DIR / name).write_text(_STAND_IN_BINARY.format(name=name))
        (building / BINARY_DIR / name).chmod(0o755)
    firmware = building / FIRMWARE_DIR / version
    firmware.mkdir(parents=True)
    for name in firmware_names(version):
        (firmware / name).write_bytes(_STAND_IN_FIRMWARE)
    (building / "etc" / "ld.so.conf").parent.mkdir()
    (building / "etc" / "ld.so.conf").write_text(f"/{library_dir()}\n")
    write_ld_cache(building / "etc" / "ld.so.cache", [(soname, f"/{library_dir()}/{soname}") for soname in LIBRARIES.values()])
    shutil.rmtree(root, ignore_errors=True)
    os.rename(building, root)


def shared_object(soname: str) -> bytes:
    """A minimal ELF64 shared object of this machine (little-endian) naming itself soname, exporting
    nothing: the ELF header, three program headers (one read-write PT_LOAD of the whole file,
    PT_DYNAMIC, a non-executable PT_GNU_STACK, without which glibc would want an executable stack),
    then a one-bucket DT_HASH, the null symbol, the string table and the dynamic section. Virtual
    addresses are file offsets. The PT_LOAD is writable since glibc before 2.35 relocates the dynamic
    section in place."""
    ehdr, phdr, dyn = struct.Struct("<16sHHIQQQIHHHHHH"), struct.Struct("<IIQQQQQQ"), struct.Struct("<qQ")
    hash_at = ehdr.size + 3 * phdr.size
    symtab_at = hash_at + 16
    strtab_at = symtab_at + 24
    strtab = b"\0" + soname.encode() + b"\0"
    dynamic_at = (strtab_at + len(strtab) + 7) & ~7
    # DT_HASH, DT_STRTAB, DT_SYMTAB, DT_STRSZ, DT_SYMENT, DT_SONAME, DT_NULL
    dynamic = b"".join(dyn.pack(tag, value) for tag, value in
                       ((4, hash_at), (5, strtab_at), (6, symtab_at), (10, len(strtab)), (11, 24), (14, 1), (0, 0)))
    size = dynamic_at + len(dynamic)
    read_write = 4 | 2  # PF_R | PF_W
    header = ehdr.pack(b"\x7fELF\x02\x01\x01" + bytes(9),  # ELFCLASS64, ELFDATA2LSB, EV_CURRENT, System V ABI
                       3, _ELF_MACHINES[platform.machine()], 1, 0, ehdr.size, 0, 0,  # ET_DYN, EV_CURRENT
                       ehdr.size, phdr.size, 3, 64, 0, 0)
    programs = (phdr.pack(1, read_write, 0, 0, 0, size, size, 0x1000)  # PT_LOAD
                + phdr.pack(2, read_write, dynamic_at, dynamic_at, dynamic_at, len(dynamic), len(dynamic), 8)  # PT_DYNAMIC
                + phdr.pack(0x6474E551, read_write, 0, 0, 0, 0, 0, 16))  # PT_GNU_STACK
    hash_table = struct.pack("<IIII", 1, 1, 0, 0)  # nbucket, nchain, bucket[0], chain[0]: no symbol
    body = header + programs + hash_table + bytes(24) + strtab
    return body + bytes(dynamic_at - len(body)) + dynamic


def _entries(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_symlink() or path.is_file())
