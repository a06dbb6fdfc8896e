"""packaging/build.sh: one .deb and one .rpm for CPython 3.10 and newer (one compiled library tree per ABI
under /usr/lib/gpud for 3.10-3.13, a pure-Python one for any other, chosen by /usr/bin/gpud), clean by lintian and rpmlint, nothing from the build machine
inside, and the packaged gpud runs offline on an interpreter alone. Installing them into a booted
system is tests/test_e2e_systemd.py."""

from __future__ import annotations

import fnmatch
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from helpers import IN_CI, REPO, kill_mps_under

from gpud import __version__
from gpud.client import ApiFailure, Client, DaemonUnreachable

# The modules that build the packages into build/ and dist/ share one pytest-xdist worker, one after
# the other.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packages")]
OS_PYTHON = "/usr/bin/python3"
ABIS = ("3.10", "3.11", "3.12", "3.13")
LIB = "usr/lib/gpud"
# The programs: gpud's launcher, and the wrappers slurm.conf names (slurmd runs them without arguments)
EXECUTABLES = ("usr/bin/gpud", "usr/bin/kubectl-gpud", f"{LIB}/slurm/health-check", f"{LIB}/slurm/prolog")
# Where the package may put files (FHS; Debian policy and Fedora's guidelines accept each of them).
ALLOWED_PLACES = ("usr/bin/gpud", "usr/bin/kubectl-gpud", f"{LIB}/", "usr/lib/systemd/system/gpud", "usr/lib/sysusers.d/gpud",
                  "usr/lib/tmpfiles.d/gpud", "usr/share/doc/gpud/", "usr/share/licenses/gpud/",
                  "usr/share/man/man1/gpud.1.gz", "usr/share/man/man1/kubectl-gpud.1.gz",
                  "usr/share/bash-completion/completions/gpud",
                  "usr/share/zsh/vendor-completions/_gpud", "usr/share/lintian/overrides/gpud", "etc/gpud/",
                  "usr/share/gpud/")
# What a build machine leaves in what it makes: our checkout's path (the venv, build/, the staged tree)
# and the temporary directories pip builds in.
BUILD_MARKERS = (str(REPO).encode(), b"pip-req-build-", b"pip-build-env-", b"pip-wheel-", b"pip-install-")
PACKAGING_README = (REPO / "packaging" / "README.md").read_text()
# The alert rules and every Grafana dashboard, where Prometheus and Grafana are pointed at them
# (docs/alerts.md); the rules' promtool unit tests stay out (a rule_files glob would load them).
MONITORING_FILES = sorted(["usr/share/gpud/prometheus/gpud-alerts.yaml",
                           *(f"usr/share/gpud/grafana/{path.name}" for path in (REPO / "deploy/grafana").glob("*.json"))])


def build(version: str | None = None) -> tuple[Path, Path]:
    env = {**os.environ, **({"GPUD_VERSION": version} if version else {})}
    result = subprocess.run(["packaging/build.sh"], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    version = version or __version__
    deb, rpm = REPO / "dist" / f"gpud_{version}_amd64.deb", REPO / "dist" / f"gpud-{version}-1.x86_64.rpm"
    assert deb.exists() and rpm.exists()
    return deb, rpm


def needs(tool: str) -> None:
    if shutil.which(tool) is None:
        if IN_CI:
            pytest.fail(f"CI installs {tool} (scripts/test-all)")
        pytest.skip(f"{tool} is not installed")


@pytest.fixture(scope="module")
def packages():
    if shutil.which("dpkg-deb") is None or not Path(OS_PYTHON).exists():
        if IN_CI:
            pytest.fail("CI runs on Debian 12, with dpkg-deb and python3")
        pytest.skip("needs dpkg-deb and /usr/bin/python3")
    return build()


@pytest.fixture(scope="module")
def unpacked(packages, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deb") / "root"
    subprocess.run(["dpkg-deb", "-x", str(packages[0]), str(root)], check=True, timeout=120)
    return root


def deb_members(deb: Path) -> list[tarfile.TarInfo]:
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True, timeout=120).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return archive.getmembers()


def launcher_for(root: Path, here: Path) -> Path:
    """/usr/bin/gpud of the unpacked package, pointed at the unpacked /usr/lib/gpud."""
    text = (root / "usr/bin/gpud").read_text()
    assert text.count("GPUD_LIB=/usr/lib/gpud\n") == 1
    launcher = here / "gpud-here"
    launcher.write_text(text.replace("GPUD_LIB=/usr/lib/gpud\n", f"GPUD_LIB={root / LIB}\n"))
    launcher.chmod(0o755)
    return launcher


def test_deb_metadata_conffiles_and_scripts(packages):
    deb, _ = packages
    info = subprocess.run(["dpkg-deb", "-I", str(deb)], capture_output=True, text=True, check=True, timeout=120).stdout
    assert "Package: gpud" in info and "Section: admin" in info and "Priority: optional" in info
    depends = re.search(r"^ Depends: (.+)$", info, re.M)[1].split(", ")
    # any python3 from 3.10 on: one the package has no compiled tree for runs gpud on pure/
    assert "python3 (>= 3.10)" in depends and not [d for d in depends if d.startswith("python3 (<")], depends
    assert any(d.startswith("libc6 (>= 2.") for d in depends), depends
    control = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(deb)], capture_output=True, check=True,
                             timeout=120).stdout
    assert b"conffiles" in control and b"postinst" in control and b"prerm" in control
    members = deb_members(deb)
    listing = {member.name for member in members}
    for path in ("./usr/bin/gpud", "./usr/lib/systemd/system/gpud.service", "./usr/lib/systemd/system/gpud.socket",
                 "./usr/lib/systemd/system/gpud-device-plugin.service",
                 "./usr/lib/systemd/system/gpud-dra-plugin.service", "./etc/gpud/gpud.yaml",
                 "./etc/gpud/mig-layouts.yaml", f"./{LIB}/launch.py", f"./{LIB}/common/gpud/mig/data/mig-layouts.yaml",
                 f"./{LIB}/common/gpud/health/xids.yaml", f"./{LIB}/common/gpud/device_plugin/api_pb2.py",
                 f"./{LIB}/common/gpud/device_plugin/api_pb2_grpc.py", "./usr/share/man/man1/gpud.1.gz",
                 "./usr/share/bash-completion/completions/gpud", "./usr/share/zsh/vendor-completions/_gpud",
                 "./usr/share/doc/gpud/copyright", "./usr/share/doc/gpud/changelog.Debian.gz",
                 "./usr/share/lintian/overrides/gpud"):
        assert path in listing, path
    assert sorted(member.name.removeprefix("./") for member in members
                  if member.name.startswith("./usr/share/gpud/") and member.isfile()) == MONITORING_FILES


def test_files_are_in_their_places_with_sane_modes_and_nothing_left_by_a_build(packages):
    for member in deb_members(packages[0]):
        path = member.name.removeprefix("./")
        if member.isdir():
            assert stat.S_IMODE(member.mode) == 0o755, path
            continue
        assert path.startswith(ALLOWED_PLACES), path
        assert member.uid == 0 and member.gid == 0, path
        if not member.issym():  # a link's own mode means nothing on Linux
            assert stat.S_IMODE(member.mode) == (0o755 if path in EXECUTABLES else 0o644), (path, oct(member.mode))
        name = path.rsplit("/", 1)[-1]
        assert "/__pycache__/" not in path and not name.endswith((".pyc", ".pyx", ".pxd", ".c", ".h")), path
        assert name not in ("example.py", "RECORD", "direct_url.json") and "_testcapi" not in name, path
        assert not name.startswith("."), path
        assert "/tests/" not in path and "/testdata/" not in path and "/bin/" not in path.removeprefix("usr/bin/"), path


def test_no_build_machine_path_anywhere(unpacked):
    for path in unpacked.rglob("*"):
        if path.is_file() and not path.is_symlink():
            content = path.read_bytes()
            assert not any(marker in content for marker in BUILD_MARKERS), path
        elif path.is_symlink():  # links made by build.sh: relative, inside /usr/lib/gpud, to a real file
            target = os.readlink(path)
            assert not target.startswith("/") and path.resolve().is_file(), (path, target)
            assert path.resolve().is_relative_to(unpacked / LIB), (path, target)


def test_shared_objects_are_stripped(unpacked):
    objects = [path for path in (unpacked / LIB).rglob("*.so") if not path.is_symlink()]
    assert len(objects) > 20
    for path in objects:
        sections = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True,
                                  check=True, timeout=120).stdout
        assert " .symtab " not in sections and " .debug_" not in sections and " .comment " not in sections, path


def test_shared_objects_need_no_newer_glibc_than_the_package_declares_nor_than_rhel_9s(packages, unpacked):
    info = subprocess.run(["dpkg-deb", "-f", str(packages[0]), "Depends"], capture_output=True, text=True,
                          check=True, timeout=120).stdout
    declared = tuple(int(part) for part in re.search(r"libc6 \(>= ([\d.]+)\)", info)[1].split("."))
    needed = set()
    for path in (unpacked / LIB).rglob("*.so"):
        symbols = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True, check=True,
                                 timeout=120).stdout
        needed.update(tuple(int(part) for part in version.split("."))
                      for version in re.findall(r"GLIBC_([\d.]+)", symbols))
    assert max(needed) <= declared <= (2, 34), (max(needed), declared)


@pytest.mark.parametrize("abi", ABIS)
def test_one_library_tree_per_cpython_abi(unpacked, abi):
    tag = "cp" + abi.replace(".", "")
    tree = unpacked / LIB / tag
    for compiled in ("grpc/_cython/cygrpc", "aiohttp/_http_parser", "multidict/_multidict", "yarl/_quoting_c"):
        assert (tree / f"{compiled}.cpython-{tag[2:]}-x86_64-linux-gnu.so").is_file(), compiled
    others = [path for path in tree.rglob("*.so") if f".cpython-{tag[2:]}-" not in path.name]
    assert not others, others
    # what every ABI shares is once in common/: gpud itself, the pure-Python libraries, protobuf's abi3 module
    common = unpacked / LIB / "common"
    assert (common / "gpud/cli/__init__.py").is_file() and (common / "structlog").is_dir()
    assert not list(common.rglob("*.cpython-*.so"))
    assert (common / "google/_upb").is_dir() and not (tree / "gpud").exists()


def test_the_pure_tree_has_the_oldest_abis_libraries_without_compiled_modules_or_grpc(unpacked):
    pure, oldest = unpacked / LIB / "pure", unpacked / LIB / ("cp" + ABIS[0].replace(".", ""))
    assert (pure / "aiohttp/http_parser.py").exists() and (pure / "multidict/_multidict_py.py").exists()
    assert not [path for path in pure.rglob("*") if ".so" in path.suffixes], "compiled modules in pure/"
    assert not (pure / "grpc").exists() and not list(pure.glob("grpcio-*"))
    # what the oldest tree has, but its compiled modules and grpcio: every library in it supports 3.10 on
    names = lambda tree: {str(path.relative_to(tree)) for path in tree.rglob("*")  # noqa: E731
                          if ".so" not in path.suffixes and "grpc" not in path.relative_to(tree).parts[0]}
    assert names(pure) == names(oldest)
    # files are links into the other trees: the package grows by little more than directory entries
    assert not [path for path in pure.rglob("*") if path.is_file() and not path.is_symlink() and path.stat().st_size]


def test_copyright_covers_every_bundled_library(unpacked):
    copyright_text = (unpacked / "usr/share/doc/gpud/copyright").read_text()
    assert copyright_text.startswith("Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/")
    patterns = [pattern for line in copyright_text.splitlines() if line.startswith("Files: ")
                for pattern in line.removeprefix("Files: ").split()]
    libraries = [entry for tree in (unpacked / LIB).iterdir() if tree.is_dir() and tree.name != "slurm"
                 for entry in tree.iterdir() if not entry.name.endswith(".dist-info") and entry.name != "gpud"]
    assert len(libraries) > 20
    for entry in libraries:
        sample = str((entry / "__init__.py" if entry.is_dir() else entry).relative_to(unpacked))
        assert any(fnmatch.fnmatch(sample, pattern) for pattern in patterns if pattern != "*"), sample
    licences_named = set(re.findall(r"^License: (.+)$", copyright_text, re.M))
    for expression in licences_named:
        for licence in re.split(r" (?:and|or) ", expression):
            assert f"License: {licence}\n " in copyright_text, f"no text for {licence}"


def test_lintian_reports_no_errors_and_only_justified_warnings(packages):
    needs("lintian")
    result = subprocess.run(["lintian", "--tag-display-limit", "0", str(packages[0])], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode in (0, 1, 2), result.stderr  # 0 clean, 1/2 tags; anything else is lintian failing
    tags = re.findall(r"^([EW]): gpud(?: \S+)?: (\S+)", result.stdout, re.M)
    assert not [tag for level, tag in tags if level == "E"], result.stdout
    assert all(f"`{tag}`" in PACKAGING_README for _, tag in tags), result.stdout
    overrides = (REPO / "packaging/gpud.lintian-overrides").read_text()
    for tag in re.findall(r"^gpud: (\S+)", overrides, re.M):
        assert f"`{tag}`" in PACKAGING_README, f"override of {tag} not explained in packaging/README.md"


def test_rpmlint_reports_no_errors_and_only_justified_warnings(packages):
    needs("rpmlint")
    config = REPO / "packaging/rpmlint.toml"
    result = subprocess.run(["rpmlint", "-c", str(config), str(packages[1])], capture_output=True, text=True,
                            timeout=600)
    tags = re.findall(r"^gpud\.x86_64: ([EW]): (\S+)", result.stdout, re.M)
    assert "1 packages and 0 specfiles checked" in result.stdout, result.stdout + result.stderr
    assert not [tag for level, tag in tags if level == "E"], result.stdout
    assert all(f"`{tag}`" in PACKAGING_README for _, tag in tags), result.stdout
    for tag in re.findall(r'^\s+"([a-z%-]+)', config.read_text(), re.M):  # the filtered tags
        assert f"`{tag.strip()}`" in PACKAGING_README, f"filter of {tag} not explained in packaging/README.md"


def assert_serves_gpus(launcher: Path, env: dict[str, str], here: Path, while_serving=None) -> list[dict]:
    """The packaged gpud starts on a simulated T4 and answers GET /v1/gpus; while_serving(process) then
    looks at it. Returns its log (JSON lines)."""
    sock, log_path = here / "p.sock", here / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(launcher), "serve", "--simulate", "t4", "--socket", str(sock), "--sim-state",
                                 str(here / "sim.json"), "--state-dir", str(here / "state"), "--log-format", "json"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = Client(sock, timeout=5)
        deadline = time.monotonic() + 30
        gpus = None
        while time.monotonic() < deadline and gpus is None and proc.poll() is None:
            try:
                gpus = client.get("/v1/gpus")["gpus"]
            except (DaemonUnreachable, ApiFailure):  # not up yet, or still starting
                time.sleep(0.1)
        assert gpus and gpus[0]["name"] == "Tesla T4", log_path.read_text()[-2000:]
        if while_serving:
            while_serving(proc)
    finally:
        proc.terminate()
        proc.wait(10)
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]


def mapped_files(pid: int) -> set[str]:
    """The files a process has mapped: its shared objects among them."""
    return {line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith("/")}


def python_libraries(log: list[dict]) -> dict:
    lines = [event for event in log if event.get("event") == "python_libraries"]
    assert len(lines) == 1, log
    return lines[0]


def test_the_packaged_gpud_runs_on_the_os_python_alone(unpacked, short_tmp):
    launcher = launcher_for(unpacked, short_tmp)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(short_tmp)}  # nothing from the venv or the user
    version = subprocess.run([str(launcher), "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith(f"gpud {__version__}"), version.stderr
    assert_serves_gpus(launcher, env, short_tmp)
    # no bytecode written beside the package's files
    assert not list((unpacked / LIB).rglob("__pycache__"))


def test_the_packaged_kubectl_plugin_is_the_launcher_under_its_name(unpacked, short_tmp):
    """/usr/bin/kubectl-gpud is the launcher, which called by that name runs the plugin's command line
    (launch.py run as kubectl-gpud.py); its man page is there, as lintian asks of every program in /usr/bin."""
    assert (unpacked / "usr/bin/kubectl-gpud").read_bytes() == (unpacked / "usr/bin/gpud").read_bytes()
    assert (unpacked / LIB / "kubectl-gpud.py").read_bytes() == (unpacked / LIB / "launch.py").read_bytes()
    assert (unpacked / "usr/share/man/man1/kubectl-gpud.1.gz").is_file()
    plugin = short_tmp / "kubectl-gpud"
    plugin.symlink_to(launcher_for(unpacked, short_tmp))  # $0 is the name it is called by, as kubectl calls it
    env = {"PATH": "/usr/bin:/bin", "HOME": str(short_tmp)}
    version = subprocess.run([str(plugin), "--version"], capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0 and version.stdout == f"kubectl-gpud {__version__}\n", version.stdout + version.stderr
    usage = subprocess.run([str(plugin), "inspect", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert usage.returncode == 0 and usage.stdout.startswith("usage: kubectl gpud inspect"), usage.stderr


def find_interpreter(abi: str) -> str | None:
    """A CPython `abi` on this machine: the OS's, or one a developer installed (pyenv)."""
    found = shutil.which(f"python{abi}", path="/usr/bin:/usr/local/bin")
    candidates = sorted(Path.home().glob(f".pyenv/versions/{abi}.*/bin/python{abi}"))
    return found or (str(candidates[-1]) if candidates else None)


@pytest.mark.parametrize("abi", ABIS)
def test_the_launcher_runs_gpud_on_each_python_found_here(unpacked, short_tmp, abi):
    interpreter = find_interpreter(abi)
    if interpreter is None:
        if IN_CI and abi == "3.11":
            pytest.fail("Debian 12 has python3.11")
        pytest.skip(f"no python{abi} here (tests/test_e2e_systemd.py boots Debian 13 for 3.13)")
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(interpreter)
    env = {"PATH": f"{bin_dir}:/bin", "HOME": str(short_tmp)}
    launcher = launcher_for(unpacked, short_tmp)
    # the device plugin imports grpc, whose compiled module exists only in this ABI's tree
    plugin = subprocess.run([str(launcher), "device-plugin", "--kubelet-dir", str(short_tmp / "none"),
                             "--log-format", "json"], capture_output=True, text=True, env=env, timeout=60)
    assert plugin.returncode == 2 and "kubelet_dir_missing" in plugin.stdout, plugin.stdout + plugin.stderr
    tag = "cp" + abi.replace(".", "")

    def compiled_and_no_grpc(proc):  # aiohttp and what it needs on this version only; gpud serve never loads grpc
        loaded = mapped_files(proc.pid)
        assert any(f"/{LIB}/{tag}/aiohttp/" in path for path in loaded), sorted(loaded)
        assert not [path for path in loaded if "/grpc/" in path], sorted(loaded)

    log = assert_serves_gpus(launcher, env, short_tmp, compiled_and_no_grpc)
    assert python_libraries(log)["mode"] == "compiled" and python_libraries(log)["python"].startswith(abi)


@pytest.mark.parametrize("abi", ABIS)
def test_without_its_compiled_tree_each_python_runs_gpud_on_the_pure_tree(unpacked, short_tmp, abi):
    """As a CPython released after the package (3.14 for this one) runs it: the package as installed, but
    for the compiled tree of the interpreter at hand, which launch.py then does not find."""
    interpreter = find_interpreter(abi)
    if interpreter is None:
        pytest.skip(f"no python{abi} here")
    tag = "cp" + abi.replace(".", "")
    lib = short_tmp / "lib"  # /usr/lib/gpud without this tree: the others, linked; launch.py, a copy
    lib.mkdir()
    for entry in (unpacked / LIB).iterdir():
        if entry.name == "launch.py":
            shutil.copy(entry, lib / entry.name)
        elif entry.name != tag:
            (lib / entry.name).symlink_to(entry)
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(interpreter)
    env = {"PATH": f"{bin_dir}:/bin", "HOME": str(short_tmp)}
    launcher = launcher_for(unpacked, short_tmp)
    launcher.write_text(launcher.read_text().replace(f"GPUD_LIB={unpacked / LIB}\n", f"GPUD_LIB={lib}\n"))

    def nothing_compiled_of_the_package(proc):
        loaded = mapped_files(proc.pid)
        assert not [path for path in loaded if path.startswith((str(unpacked / LIB), str(lib)))], sorted(loaded)

    log = assert_serves_gpus(launcher, env, short_tmp, nothing_compiled_of_the_package)
    said = python_libraries(log)
    assert said["mode"] == "pure" and said["python"].startswith(abi + "."), said
    assert said["path"] == f"{lib}/pure" and said["pure"] == ["aiohttp", "frozenlist", "multidict", "propcache",
                                                               "yarl"], said
    # the device plugin cannot run there: it says why and what to do, with its documented exit code
    plugin = subprocess.run([str(launcher), "device-plugin", "--kubelet-dir", str(short_tmp / "none")],
                            capture_output=True, text=True, env=env, timeout=60)
    assert plugin.returncode == 127 and plugin.stdout == "", plugin.stdout + plugin.stderr
    others = ", ".join(other for other in ABIS if other != abi)
    assert plugin.stderr.startswith("gpud: device-plugin needs grpcio, which has no pure-Python build"), plugin.stderr
    assert f"compiled for CPython {others} " in plugin.stderr and "GPUD_PYTHON=python" in plugin.stderr, plugin.stderr
    assert "Traceback" not in plugin.stderr


def fake_python(bin_dir: Path, name: str, version: str) -> None:
    """An interpreter of `version` that answers the launcher's version check (the launcher's own code, run
    by the OS's Python with that version_info), then says it was the one run."""
    major, minor = version.split(".")
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\nif [ "$1 $2 $3" = "-I -S -c" ]; then\n'
                      f'    exec {OS_PYTHON} -I -S -c "import sys; sys.version_info = ({major}, {minor}, 0); '
                      f'exec(sys.argv[1])" "$4"\nfi\necho "{name} $*"\n')
    script.chmod(0o755)


@pytest.mark.parametrize(("installed", "chosen"), [
    ({"python3": "3.12", "python3.12": "3.12"}, "python3"),  # Debian, Ubuntu, Fedora: python3 fits
    ({"python3": "3.9", "python3.11": "3.11", "python3.12": "3.12"}, "python3.12"),  # RHEL 9: python3 is 3.9
    ({"python3.10": "3.10"}, "python3.10"),  # no python3 at all
    ({"python3": "3.14", "python3.13": "3.13"}, "python3"),  # Fedora 43, Debian testing: pure/ if no cp314/
    ({"python3": "3.9", "python3.9": "3.9", "python3.14": "3.14", "python3.10": "3.10"}, "python3.14"),  # 14 > 9
    # not interpreters of the form looked for: python3.X-config, a free-threaded python3.Xt
    ({"python3.11": "3.11", "python3.13-config": "3.13", "python3.13t": "3.13", "python3.9": "3.9"}, "python3.11"),
])
def test_the_launcher_chooses_python3_if_it_fits_else_the_newest_python3_x(unpacked, short_tmp, installed, chosen):
    for name, version in installed.items():
        fake_python(short_tmp, name, version)
    launcher = launcher_for(unpacked, short_tmp)
    result = subprocess.run([str(launcher), "status", "--json"], capture_output=True, text=True, timeout=30,
                            env={"PATH": str(short_tmp)})
    assert result.returncode == 0 and result.stdout == f"{chosen} -I -S {unpacked / LIB}/launch.py status --json\n", \
        result.stdout + result.stderr


def test_the_launcher_takes_the_newest_python3_x_across_path_and_gpud_python_first(unpacked, short_tmp):
    first, second = short_tmp / "a", short_tmp / "b"
    first.mkdir(), second.mkdir()
    fake_python(first, "python3.11", "3.11")
    fake_python(second, "python3.13", "3.13")
    launcher = launcher_for(unpacked, short_tmp)
    run = lambda **env: subprocess.run([str(launcher), "--version"], capture_output=True, text=True,  # noqa: E731
                                       timeout=30, env={"PATH": f"{first}::{second}", **env})
    assert run().stdout.startswith("python3.13 -I -S "), run()
    fake_python(second, "python3", "3.14")
    assert run().stdout.startswith("python3 -I -S ")
    # GPUD_PYTHON: an operator's choice (the device plugin on a version with compiled libraries)
    assert run(GPUD_PYTHON="python3.11").stdout.startswith("python3.11 -I -S ")
    fake_python(second, "python3.9", "3.9")
    refused = run(GPUD_PYTHON="python3.9")
    assert refused.returncode == 127 and "GPUD_PYTHON=python3.9 is not a Python 3.10 or newer" in refused.stderr


@pytest.mark.parametrize(("links_to", "chosen"), [("python3.12", "python3.12"), ("python3.9", "python3.11")])
def test_the_launcher_tells_python3s_version_by_the_name_it_links_to(unpacked, short_tmp, links_to, chosen):
    # Debian's and Fedora's python3 is a link to python3.X: no interpreter is started just to ask its
    # version (every command, and Slurm's health check before each job, paid a second start for it)
    for name in (links_to, "python3.11"):
        script = short_tmp / name
        script.write_text('#!/bin/sh\nif [ "$1 $2 $3" = "-I -S -c" ]; then echo probed >&2; exit 3; fi\n'
                          'echo "${0##*/} $*"\n')
        script.chmod(0o755)
    (short_tmp / "python3").symlink_to(short_tmp / links_to)
    result = subprocess.run([str(launcher_for(unpacked, short_tmp)), "status"], capture_output=True, text=True,
                            timeout=30, env={"PATH": str(short_tmp)})
    assert result.returncode == 0 and "probed" not in result.stderr, result.stderr
    assert result.stdout == f"{chosen} -I -S {unpacked / LIB}/launch.py status\n"


def test_the_launcher_says_when_no_python_fits(unpacked, short_tmp):
    fake_python(short_tmp, "python3", "3.9")  # e.g. RHEL 9's 3.9, with no python3.1X beside it
    fake_python(short_tmp, "python3.9", "3.9")
    result = subprocess.run([str(launcher_for(unpacked, short_tmp)), "--version"], capture_output=True, text=True,
                            timeout=30, env={"PATH": str(short_tmp)})
    assert result.returncode == 127 and result.stdout == ""
    assert "needs Python 3.10 or newer" in result.stderr, result.stderr


def test_launch_py_says_when_the_package_has_no_tree_for_this_python(unpacked, short_tmp):
    shutil.copy(unpacked / LIB / "launch.py", short_tmp / "launch.py")
    (short_tmp / "cp399").mkdir()
    os_python = subprocess.run([OS_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    result = subprocess.run([OS_PYTHON, "-I", str(short_tmp / "launch.py"), "--version"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 127, result.stderr
    assert f"no libraries for Python {os_python} (it has: cp399)" in result.stderr, result.stderr


def test_rpm_metadata_config_files_scriptlets_and_interpreter_dependency(packages, tmp_path):
    _, rpm = packages
    needs("rpm")
    query = lambda *flags: subprocess.run(["rpm", "-qp", *flags, str(rpm)], capture_output=True, text=True,  # noqa: E731
                                          check=True, timeout=120).stdout
    assert query("-c").split() == ["/etc/gpud/gpud.yaml", "/etc/gpud/mig-layouts.yaml"]
    scripts = query("--scripts")
    assert "postinstall scriptlet" in scripts and "groupadd --system gpud" in scripts
    files = query("-l").split()
    assert "/usr/lib/systemd/system/gpud.service" in files and "/usr/share/licenses/gpud/copyright" in files
    assert sorted(path.lstrip("/") for path in files if path.startswith("/usr/share/gpud/")
                  and path.endswith((".yaml", ".json"))) == MONITORING_FILES
    assert not [path for path in files if path.startswith("/opt")]
    assert f"- {__version__}" in query("--changelog")
    assert query("--qf", "%{GROUP}") == "System Environment/Daemons"
    # any CPython >= 3.10 (tests/test_packaging_rpm.py resolves it with dnf against RHEL 8/9's packages)
    requirement = "python(abi) >= 3.10"
    assert requirement in query("--requires").splitlines()
    # in an empty root, that is missing
    subprocess.run(["rpm", "--root", str(tmp_path), "--initdb"], check=True, timeout=120)
    test_install = subprocess.run(["rpm", "--root", str(tmp_path), "-i", "--test", str(rpm)], capture_output=True,
                                  text=True, timeout=120)
    assert test_install.returncode != 0 and f"{requirement} is needed by gpud" in test_install.stderr, \
        test_install.stderr


def test_gpud_version_overrides_the_version_without_touching_the_checkout(packages, tmp_path):
    before = (REPO / "gpud/__init__.py").read_bytes()
    deb, rpm = build("0.0.9")
    try:
        assert (REPO / "gpud/__init__.py").read_bytes() == before
        info = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True,
                              timeout=120)
        assert info.stdout.strip() == "0.0.9"
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path)], check=True, timeout=120)
        assert '__version__ = "0.0.9"' in (tmp_path / LIB / "common/gpud/__init__.py").read_text()
        assert (tmp_path / LIB / "common/gpud-0.0.9.dist-info").is_dir()
    finally:
        deb.unlink()
        rpm.unlink()


# -- the maintainer scripts and MPS (issue 20, item 8c) -------------------------------------------

# Run in a mount namespace of its own, on a tmpfs over /run: the script's /run/gpud is the test's, and
# the host's /run is untouched. A root-only socket stands for anything of root's that mps.user would
# like root to talk to; mps.user plants a link to it where a control socket belongs. A second pipe
# directory holds a real MPS control daemon of mps.user, which the removal must end.
PRERM_STAGE = """\
set -eu
mount -t tmpfs -o mode=0755 gpudt-prerm /run
mkdir -p /run/gpud/mps/planted/pipe /run/gpud/mps/real/pipe /run/gpud-logs/real /run/root-only
chmod 0700 /run/root-only
chown {user} /run/gpud/mps/planted/pipe /run/gpud/mps/real/pipe /run/gpud-logs/real
"$PYTHON" -c '
import socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # what the MPS client connects with
listener.bind("/run/root-only/root.sock")
listener.listen(1)
listener.settimeout(15)
open("/run/root-only/ready", "w").close()
try:
    peer, _ = listener.accept()
except socket.timeout:
    sys.exit(0)
open(sys.argv[1], "w").write("connected as root")
' "$REACHED" &
while [ ! -e /run/root-only/ready ]; do sleep 0.05; done
runuser -u {user} -- ln -s /run/root-only/root.sock /run/gpud/mps/planted/pipe/control
runuser -u {user} -- env CUDA_MPS_PIPE_DIRECTORY=/run/gpud/mps/real/pipe \
    CUDA_MPS_LOG_DIRECTORY=/run/gpud-logs/real nvidia-cuda-mps-control -d
while [ ! -S /run/gpud/mps/real/pipe/control ]; do sleep 0.05; done
PATH="$STUBS:$PATH" sh {script} remove 2>&1 || echo "preremove exited $?"
for pid in $(pgrep -u {user} -x nvidia-cuda-mps); do
    if grep -qz '^CUDA_MPS_PIPE_DIRECTORY=/run/gpud/mps/real/pipe$' /proc/$pid/environ; then
        echo "the real MPS daemon is still running"
    fi
done
kill %1 2>/dev/null || true
"""


def test_preremove_ends_mps_daemons_only_through_paths_that_root_or_mps_user_own(short_tmp, mps_tmp, users):
    """prerm ran nvidia-cuda-mps-control as root on every /run/gpud/mps/*/pipe, whose contents are
    mps.user's: a control "socket" planted as a link made root connect to a socket only root may
    reach. Now the planted one is refused and left alone, and the real daemon of mps.user still quits."""
    user = "gpudt-other"
    stubs, reached = short_tmp / "stubs", short_tmp / "reached"
    stubs.mkdir()
    (short_tmp / "gpud.yaml").write_text(f"mps:\n  user: {user}\n  log_root: /run/gpud-logs\n")
    # gpud as the package installs it, on the operator's config; no systemctl of the host's
    (stubs / "gpud").write_text(f'#!/bin/sh\nexec "{os.environ.get("PYTHON", sys.executable)}" -m gpud "$@" '
                                f'--config {short_tmp / "gpud.yaml"}\n')
    (stubs / "systemctl").write_text("#!/bin/sh\nexit 1\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    stage = PRERM_STAGE.format(user=user, script=REPO / "packaging/preremove.sh")
    try:
        result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", stage],
                                env=dict(os.environ, PYTHON=sys.executable, REACHED=str(reached), STUBS=str(stubs)),
                                capture_output=True, text=True, timeout=90)
    finally:
        kill_mps_under(Path("/run/gpud/mps/real/pipe"))  # the daemon lives on in the namespace if it did not quit
    assert result.returncode == 0, result.stdout + result.stderr
    assert not reached.exists(), result.stdout  # root never connected through the planted link
    assert "the real MPS daemon is still running" not in result.stdout, result.stdout
    assert "left running: planted" in result.stdout and "quit: real" in result.stdout, result.stdout
