"""The .rpm on RHEL, Rocky and Alma 8 and 9 (issue 25): its interpreter requirement resolved by the real
dnf against repositories of stand-in packages that carry the Provides and files of RHEL's own, the
launcher it installs choosing the AppStream interpreter, its scriptlets following Fedora's systemd
conventions (presets, nothing started on install) where the .deb keeps Debian's (enabled and started),
and every command its scriptlets and units run coming from a declared dependency.

The stand-ins are what the resolver sees of RHEL: a name, a version, Provides, Requires and the files
whose paths matter. Each one cites the spec file or package listing it copies (STAND_INS). Their
interpreters are small sh scripts: a version probe (`-c CODE`) is answered by this machine's python3
with `sys.version_info` set to the version the stand-in stands for; anything else prints the
interpreter's name and its arguments, which is how the test sees which interpreter /usr/bin/gpud ran."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import IN_CI, SYSTEM_PATH
from test_packaging import build

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packages")]

REQUIREMENT = "python(abi) >= 3.10"


@dataclass(frozen=True)
class StandIn:
    name: str
    version: str
    provides: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    interpreter: str | None = None  # "X.Y": its files are interpreters of that version
    source: str = ""


# Python 3.11/3.12 as RHEL builds them from Fedora's python3.X.spec (one spec per version; RHEL 9.2+
# and 8.8+ ship python3.11, 9.4+ and 8.10+ python3.12, as non-"main" Pythons, pkgname python3.X):
#   %package -n %{pkgname}                         -> the package python3.11 / python3.12
#   %if %{with main_python} || %{with python_abi_provides_for_alt_pythons}
#   Provides: python(abi) = %{pybasever}           (the bcond is on "In ELN/RHEL/CentOS", off in Fedora)
#   Requires: %{pkgname}-libs%{?_isa} = %{version}-%{release}
#   %files -n %{pkgname} ... %{_bindir}/python%{pybasever}   (the interpreter is in the same package)
#   %files -n %{pkgname}-libs: the standard library and libpython, no python(abi)
# (src.fedoraproject.org/rpms/python3.12, python3.12.spec; the same in python3.11.spec and in
# CentOS Stream's rpms/python3.11 and rpms/python3.12.)
PY_SPEC = "Fedora/RHEL python3.X.spec: `Provides: python(abi) = %{pybasever}` and %{_bindir}/python%{pybasever} " \
          "in %package/%files -n %{pkgname}; -libs has neither"


def _appstream(version: str, full: str, release: str) -> list[StandIn]:
    return [StandIn(f"python{version}", f"{full}-{release}", (f"python(abi) = {version}",),
                    (f"python{version}-libs = {full}-{release}",), (f"/usr/bin/python{version}",), version, PY_SPEC),
            StandIn(f"python{version}-libs", f"{full}-{release}", (), (), (), None, PY_SPEC)]


# What each distribution's resolver has to choose from, as far as gpud's Requires reach.
def _base(dist: str) -> list[StandIn]:
    return [
        # systemd.spec: %files has %{_bindir}/systemctl (RHEL 8: systemd 239, RHEL 9: systemd 252)
        StandIn("systemd", f"252-18.{dist}", (), (), ("/usr/bin/systemctl",), None, "systemd.spec: %{_bindir}/systemctl"),
        # shadow-utils.spec: %{_sbindir}/groupadd, %{_sbindir}/useradd
        StandIn("shadow-utils", f"4.9-8.{dist}", (), (), ("/usr/sbin/groupadd", "/usr/sbin/useradd"), None,
                "shadow-utils.spec: %{_sbindir}/groupadd"),
        # glibc.spec: getent is in glibc-common (%files -f common.filelist common)
        StandIn("glibc-common", f"2.34-83.{dist}", (), (), ("/usr/bin/getent",), None,
                "glibc.spec: getent in glibc-common"),
        # coreutils.spec: `%package single` ... `Provides: coreutils = %{version}-%{release}` (minimal
        # and container images install coreutils-single, a full install coreutils)
        StandIn("coreutils-single", f"8.32-34.{dist}", (f"coreutils = 8.32-34.{dist}",), (),
                tuple(f"/usr/bin/{tool}" for tool in ("rm", "mkdir", "touch", "chown", "chmod")), None,
                "coreutils.spec: %package single, Provides: coreutils = %{version}-%{release}"),
        StandIn("findutils", f"4.8.0-6.{dist}", (), (), ("/usr/bin/find",), None, "findutils.spec: %{_bindir}/find"),
    ]


DISTRIBUTIONS = {
    # RHEL 9: python3 is the main Python, 3.9 (python3.9.spec with main_python: pkgname python3, its
    # %files has %{_bindir}/python3 and %{_bindir}/python%{pybasever}, `Provides: python(abi) = 3.9`).
    "el9": {"baseos": _base("el9") + [
                StandIn("python3", "3.9.18-3.el9", ("python(abi) = 3.9", "python3.9 = 3.9.18-3.el9"),
                        ("python3-libs = 3.9.18-3.el9",), ("/usr/bin/python3", "/usr/bin/python3.9"), "3.9",
                        "RHEL 9 python3.9.spec, main_python: pkgname python3, Provides: python(abi) = 3.9"),
                StandIn("python3-libs", "3.9.18-3.el9", (), (), (), None, PY_SPEC)],
            "appstream": _appstream("3.11", "3.11.7", "1.el9") + _appstream("3.12", "3.12.1", "4.el9")},
    # RHEL 8: no python3 by default; dnf and the system's tools run on platform-python 3.6 (RHEL 8's
    # python3.spec: `%package -n platform-python` ... `Provides: python(abi) = %{pybasever}`, its
    # interpreter /usr/libexec/platform-python; /usr/bin/python3 comes only with the python36 module).
    "el8": {"baseos": _base("el8") + [
                StandIn("platform-python", "3.6.8-56.el8", ("python(abi) = 3.6",), ("python3-libs = 3.6.8-56.el8",),
                        ("/usr/libexec/platform-python", "/usr/libexec/platform-python3.6"), "3.6",
                        "RHEL 8 python3.spec: %package -n platform-python, Provides: python(abi) = %{pybasever}"),
                StandIn("python3-libs", "3.6.8-56.el8", (), (), (), None, "RHEL 8 python3.spec: %package libs")],
            "appstream": _appstream("3.11", "3.11.7", "1.el8") + _appstream("3.12", "3.12.1", "4.el8")},
}
HOST_PYTHON = "/usr/bin/python3"


def _interpreter_script(version: str) -> str:
    """A stand-in CPython `version`: a probe (`-c CODE`) runs CODE on this machine's python3 with
    sys.version_info set to `version`; any other run prints its name and arguments."""
    major, minor = version.split(".")
    fake = (f"import collections, sys; sys.version_info = collections.namedtuple('version_info', "
            f"'major minor micro releaselevel serial')({major}, {minor}, 0, 'final', 0)")
    return (f'#!/bin/sh\nprevious=\nfor arg; do\n    if [ "$previous" = -c ]; then\n'
            f'        exec {HOST_PYTHON} -I -S -c "{fake}\n$arg"\n    fi\n    previous=$arg\ndone\n'
            f'echo "${{0##*/}} $*"\n')


def _build_stand_in(stand_in: StandIn, top: Path, out: Path) -> None:
    version, release = stand_in.version.split("-", 1)
    install = []
    for path in stand_in.files:
        content = _interpreter_script(stand_in.interpreter) if stand_in.interpreter else "#!/bin/sh\nexit 0\n"
        source = top / "SOURCES" / f"{stand_in.name}{path.replace('/', '_')}"
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(content)
        install.append(f"install -D -m 0755 {source} %{{buildroot}}{path}")
    spec = top / f"{stand_in.name}.spec"
    spec.write_text("\n".join([
        f"Name: {stand_in.name}", f"Version: {version}", f"Release: {release}",
        f"Summary: stand-in for RHEL's {stand_in.name} ({stand_in.source})", "License: MIT",
        "AutoReqProv: no",  # exactly the Provides and Requires listed, nothing generated from the files
        *[f"Provides: {provide}" for provide in stand_in.provides],
        *[f"Requires: {require}" for require in stand_in.requires],
        "%description", stand_in.source, "%install", *install, "%files", *stand_in.files, ""]))
    result = subprocess.run(["rpmbuild", "-bb", "--quiet", "--define", f"_topdir {top}", "--define", f"_rpmdir {out}",
                             "--define", "__os_install_post %{nil}", "--define", "debug_package %{nil}", str(spec)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def needs(*tools: str) -> None:
    for tool in tools:
        if shutil.which(tool, path=SYSTEM_PATH) is None:
            if IN_CI:
                pytest.fail(f"CI installs {tool} (scripts/test-all: rpm, dnf, createrepo-c)")
            pytest.skip(f"{tool} is not installed")


@pytest.fixture(scope="module")
def rpm_package() -> Path:
    needs("rpm", "dpkg-deb")
    return build()[1]


@pytest.fixture(scope="module")
def repositories(tmp_path_factory) -> dict[str, Path]:
    """One repository (createrepo_c) per distribution and channel: el9-baseos, el9-appstream, ..."""
    needs("rpmbuild", "createrepo_c")
    base = tmp_path_factory.mktemp("stand-ins")
    repos = {}
    for dist, channels in DISTRIBUTIONS.items():
        for channel, stand_ins in channels.items():
            out = base / f"{dist}-{channel}"
            for stand_in in stand_ins:
                _build_stand_in(stand_in, base / "top", out)
            subprocess.run(["createrepo_c", "-q", str(out)], check=True, timeout=120)
            repos[f"{dist}-{channel}"] = out
    return repos


@dataclass
class Dnf:
    """The real dnf, on an empty root, with only the given repositories."""

    root: Path
    work: Path
    repos: dict[str, Path]
    releasever: str
    log: list[str] = field(default_factory=list)

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        reposdir = self.work / "repos.d"
        reposdir.mkdir(parents=True, exist_ok=True)
        for name, path in self.repos.items():
            (reposdir / f"{name}.repo").write_text(f"[{name}]\nname={name}\nbaseurl=file://{path}\ngpgcheck=0\n")
        conf = self.work / "dnf.conf"
        conf.write_text(f"[main]\ngpgcheck=0\ninstall_weak_deps=False\ncachedir={self.work / 'cache'}\n")
        # tsflags=noscripts: the scriptlets need a /bin/sh in the root, which the stand-ins do not
        # carry; they are tested below and in tests/test_e2e_systemd.py.
        return subprocess.run(["dnf", "-c", str(conf), f"--installroot={self.root}", f"--releasever={self.releasever}",
                               f"--setopt=reposdir={reposdir}", "--setopt=tsflags=noscripts", "-y", *args],
                              capture_output=True, text=True, timeout=300)

    def installed(self) -> set[str]:
        result = subprocess.run(["rpm", "--root", str(self.root), "-qa", "--qf", "%{NAME}\n"], capture_output=True,
                                text=True, check=True, timeout=60)
        return set(result.stdout.split())


def _dnf(tmp_path: Path, repositories, dist: str, channels: tuple[str, ...]) -> Dnf:
    needs("dnf")
    return Dnf(tmp_path / "root", tmp_path / "dnf", {f"{dist}-{c}": repositories[f"{dist}-{c}"] for c in channels},
               dist.removeprefix("el"))


def _launcher_runs(root: Path) -> str:
    """The interpreter the installed /usr/bin/gpud runs, with only the root's /usr/bin on PATH."""
    result = subprocess.run([str(root / "usr/bin/gpud"), "--version"], capture_output=True, text=True, timeout=60,
                            env={"PATH": f"{root}/usr/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()[0]


# -- the interpreter requirement ------------------------------------------------------------------

def test_the_rpm_requires_python_abi_3_10_or_later_and_its_scriptlets_tools(rpm_package):
    requires = subprocess.run(["rpm", "-qp", "--requires", str(rpm_package)], capture_output=True, text=True,
                              check=True, timeout=60).stdout.splitlines()
    assert REQUIREMENT in requires
    assert not [r for r in requires if r.startswith("python(abi)") and r != REQUIREMENT], requires
    assert {"systemd", "shadow-utils", "glibc-common", "coreutils", "findutils"} <= set(requires), requires


@pytest.mark.parametrize(("version", "satisfies"), [("3.6", False), ("3.9", False), ("3.10", True), ("3.11", True),
                                                    ("3.12", True), ("3.13", True), ("3.14", True), ("3.20", True)])
def test_rpm_compares_python_versions_by_segments(version, satisfies):
    """rpmvercmp: "3.9" < "3.10" (numeric segments), not as strings, so 3.9 and 3.6 do not satisfy
    `python(abi) >= 3.10` and 3.14 does. Asked of this machine's rpm (4.18; RHEL 8 has 4.14, RHEL 9
    4.16, with the same rpmvercmp)."""
    needs("rpm")
    result = subprocess.run(["rpm", "--eval", f'%{{lua: print(rpm.vercmp("{version}", "3.10"))}}'],
                            capture_output=True, text=True, check=True, timeout=60)
    assert (int(result.stdout) >= 0) is satisfies, result.stdout


# -- dnf against RHEL's packages ------------------------------------------------------------------

@pytest.mark.parametrize("dist", ["el9", "el8"])
def test_dnf_pulls_in_an_appstream_python_and_the_launcher_runs_it(rpm_package, repositories, tmp_path, dist):
    dnf = _dnf(tmp_path, repositories, dist, ("baseos", "appstream"))
    system = dnf("install", "python3" if dist == "el9" else "platform-python")  # what the system has
    assert system.returncode == 0, system.stdout + system.stderr
    result = dnf("install", str(rpm_package))
    assert result.returncode == 0, result.stdout + result.stderr
    installed = dnf.installed()
    pythons = {name for name in installed if re.fullmatch(r"python3\.\d+", name)}
    assert len(pythons) == 1 and pythons <= {"python3.11", "python3.12"}, installed
    assert f"{pythons.copy().pop()}-libs" in installed
    assert {"systemd", "shadow-utils", "glibc-common", "coreutils-single", "findutils"} <= installed
    # the python(abi) provider is the package with the interpreter, which /usr/bin/gpud runs
    chosen = pythons.pop()
    assert (dnf.root / f"usr/bin/{chosen}").is_file()
    assert _launcher_runs(dnf.root) == chosen


def test_dnf_keeps_an_appstream_python_already_installed(rpm_package, repositories, tmp_path):
    dnf = _dnf(tmp_path, repositories, "el9", ("baseos", "appstream"))
    assert dnf("install", "python3", "python3.11").returncode == 0
    result = dnf("install", str(rpm_package))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "python3.12" not in dnf.installed()  # python3.11 satisfies the requirement
    assert _launcher_runs(dnf.root) == "python3.11"


@pytest.mark.parametrize("dist", ["el9", "el8"])
def test_without_appstream_dnf_refuses_cleanly(rpm_package, repositories, tmp_path, dist):
    """Only the system's 3.9 (RHEL 9) or 3.6 (RHEL 8): nothing satisfies the requirement, dnf says
    which, and installs nothing."""
    dnf = _dnf(tmp_path, repositories, dist, ("baseos",))
    assert dnf("install", "python3" if dist == "el9" else "platform-python").returncode == 0
    before = dnf.installed()
    result = dnf("install", str(rpm_package))
    assert result.returncode != 0
    assert f"nothing provides {REQUIREMENT} needed by gpud" in result.stdout + result.stderr, result.stdout + result.stderr
    assert dnf.installed() == before
