"""The host driver's user-space files a container needs to run CUDA and NVML, found as NVIDIA's
`nvidia-ctk cdi generate` finds them for the running driver version (nvidia-container-toolkit
pkg/nvcdi/driver-nvml.go, newDriverVersionDiscoverer), and the container edits that carry them:

- libraries: every 64-bit library of the host's ld.so.cache whose file, links resolved, is named
  *.so.<driver version> (getVersionLibs: Locate("*.so." + version) on the ld.so.cache);
- binaries nvidia-smi, nvidia-debugdump, nvidia-persistenced, nvidia-cuda-mps-control,
  nvidia-cuda-mps-server, nvidia-imex, nvidia-imex-ctl (newDriverBinariesDiscoverer), first found on
  the usual PATH;
- GSP firmware nvidia/<version>/gsp*.bin under the kernel's firmware search path
  (newDriverFirmwareDiscoverer, getFirmwareSearchPaths);
- the persistenced and Fabric Manager sockets under /run or /var/run (discover/ipc.go);
- createContainer hooks, run by gpud's own hook (gpud/cdi/hook.py), that make each library's soname
  link (and libcuda.so, libnvidia-opticalflow.so: discover/symlinks.go getLinksForMount), its
  development link (libnvidia-ml.so) where the host has one, and the container's linker cache
  (update-ldcache).

Where gpud differs, deliberately: /tmp/nvidia-mps is not mounted (gpud's MPS replicas mount the pipe
directory of the daemon gpud runs for them); no enable-cuda-compat hook (CUDA forward compatibility is
the image's choice), no disable-device-node-modification or update-application-profile hook, no
NVIDIA_VISIBLE_DEVICES=void or NVIDIA_CTK_LIBCUDA_DIR (for NVIDIA's runtime and hooks), no graphics
extras (the GBM and libGLX_indirect.so.0 links, the EGL vendor and Vulkan ICD files: the real H200's
spec, docs/hardware.md)."""

from __future__ import annotations

import fnmatch
import functools
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from gpud.base.hostfile import read_host_text
from gpud.base.ld_cache import read_ld_cache
from gpud.cdi import hook

BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server", "nvidia-imex", "nvidia-imex-ctl")
BINARY_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
SOCKETS = ("nvidia-persistenced/socket", "nvidia-fabricmanager/socket")
SOCKET_DIRS = ("/run", "/var/run")
# nvidia-ctk's mount options: read-only files; sockets need write access to connect (ipcMountOptions)
FILE_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
SOCKET_OPTIONS = ["nosuid", "nodev", "rbind", "rprivate", "noexec"]
# getLinksForMount: development links applications wrongly dlopen
EXTRA_LINKS = {"libcuda.so": "libcuda.so.1", "libnvidia-opticalflow.so": "libnvidia-opticalflow.so.1"}


@dataclass(frozen=True)
class DriverFiles:
    """Paths as a container sees them (the driver root taken off); `links`: (target, link) pairs."""

    root: Path
    libraries: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()
    binaries: tuple[str, ...] = ()
    firmware: tuple[str, ...] = ()
    sockets: tuple[str, ...] = ()

    def edits(self, ldconfig: str) -> dict:
        """The CDI container edits; none without libraries (a driver of another version, or none)."""
        if not self.libraries:
            return {}
        mounts = [self._mount(path, FILE_OPTIONS) for path in (*self.binaries, *self.libraries, *self.firmware)]
        mounts += [self._mount(path, SOCKET_OPTIONS) for path in self.sockets]
        links = [arg for target, link in self.links for arg in ("--link", f"{target}::{link}")]
        folders = [arg for folder in dict.fromkeys(os.path.dirname(p) for p in self.libraries)
                   for arg in ("--folder", folder)]
        return {"mounts": mounts, "hooks": [_hook("create-symlinks", *links),
                                            _hook("update-ldcache", "--ldconfig", ldconfig, *folders)]}

    def _mount(self, path: str, options: list[str]) -> dict:
        return {"hostPath": str(self.root / path.lstrip("/")), "containerPath": path, "options": options}


def find_driver_files(root: Path, version: str) -> DriverFiles:
    cache = root / "etc" / "ld.so.cache"
    try:
        status = cache.stat()
    except OSError:
        status = None
    stamp = (status.st_mtime_ns, status.st_size) if status else None
    libraries, links = _libraries(root, version, stamp)
    binaries = [found for name in BINARIES
                if (found := _first(root, [f"{d}/{name}" for d in BINARY_DIRS], _is_executable))]
    sockets = [found for name in SOCKETS if (found := _first(root, [f"{d}/{name}" for d in SOCKET_DIRS], os.path.exists))]
    firmware = []
    for directory in _firmware_dirs():
        folder = root / directory.lstrip("/") / "nvidia" / version
        if folder.is_dir():
            firmware = sorted(f"{directory}/nvidia/{version}/{p.name}" for p in folder.glob("gsp*.bin"))
            break
    return DriverFiles(root, tuple(sorted(libraries)), tuple(sorted(links, key=lambda l: l[1])), tuple(binaries),
                       tuple(firmware), tuple(sockets))


@functools.lru_cache(maxsize=4)
def _libraries(root: Path, version: str, cache_stamp: tuple | None) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The driver's libraries and their links, from the ld.so.cache (as of cache_stamp: resolving each
    entry costs tens of milliseconds, and the cache changes only when libraries are installed)."""
    libraries, links = [], []
    for soname, path in read_ld_cache(root / "etc" / "ld.so.cache") if cache_stamp else []:
        resolved = hook.resolve_in(str(root), path)  # within the driver root, as nvidia-ctk resolves
        name = os.path.basename(resolved)
        if resolved in libraries or not fnmatch.fnmatch(name, f"*.so.{version}"):
            continue
        libraries.append(resolved)
        folder = os.path.dirname(resolved)
        if soname != name:
            links.append((name, f"{folder}/{soname}"))
        links += [(target, f"{folder}/{link}") for link, target in EXTRA_LINKS.items() if name == f"{link}.{version}"]
        development = f"{folder}/{name.removesuffix(f'.{version}')}"
        if (target := _development_link(root, development, resolved)) and development not in (l for _, l in links):
            links.append((target, development))
    return tuple(libraries), tuple(links)


def _development_link(root: Path, link: str, library: str) -> str | None:
    """The target of the host's development link beside a library (libnvidia-ml.so -> libnvidia-ml.so.1),
    if there is one that leads to the library: nvidia-ctk links it in the container as the host has it
    (the real H200's spec, tests/fixtures/hardware/h200-580.159.04/nvidia-ctk-reference.yaml)."""
    try:
        target = os.readlink(root / link.lstrip("/"))
    except OSError:
        return None
    return target if "/" not in target and hook.resolve_in(str(root), link) == library else None


def host_ldconfig() -> str:
    """The host's ldconfig, which the hook runs on the container's root (-r), as nvidia-ctk's
    default "@/sbin/ldconfig" does."""
    return shutil.which("ldconfig", path="/sbin:/usr/sbin:/bin:/usr/bin") or "/sbin/ldconfig"


def _hook(*args: str) -> dict:
    # Python in isolated mode runs the hook file itself: nothing of gpud is imported, no environment read
    return {"hookName": "createContainer", "path": sys.executable,
            "args": [os.path.basename(sys.executable), "-I", hook.__file__, *args]}


def _first(root: Path, candidates: list[str], present) -> str | None:
    return next((path for path in candidates if present(root / path.lstrip("/"))), None)


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _firmware_dirs() -> list[str]:
    """getFirmwareSearchPaths: the kernel's custom firmware path, then the standard ones."""
    release = platform.release()
    dirs = [f"/lib/firmware/updates/{release}", "/lib/firmware/updates", f"/lib/firmware/{release}", "/lib/firmware"]
    try:
        custom = read_host_text("/sys/module/firmware_class/parameters/path").strip()
    except OSError:
        custom = ""
    return [custom, *dirs] if custom else dirs
