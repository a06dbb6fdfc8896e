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


# -- the scriptlets: Fedora's conventions in the .rpm, Debian's in the .deb -----------------------

RPM_SCRIPTS = {"postinstall": "%{POSTIN}", "preremove": "%{PREUN}", "postremove": "%{POSTUN}"}
DEB_SCRIPTS = {"postinstall": "postinst", "preremove": "prerm", "postremove": "postrm"}


@pytest.fixture(scope="module")
def scriptlets(rpm_package, tmp_path_factory) -> dict[str, dict[str, str]]:
    """The scripts as each package carries them: {"rpm": {"postinstall": text, ...}, "deb": {...}}."""
    rpm = {name: subprocess.run(["rpm", "-qp", "--qf", tag, str(rpm_package)], capture_output=True, text=True,
                                check=True, timeout=60).stdout for name, tag in RPM_SCRIPTS.items()}
    control = tmp_path_factory.mktemp("deb-control")
    deb = rpm_package.parent / rpm_package.name.replace("-1.x86_64.rpm", "_amd64.deb").replace("gpud-", "gpud_")
    subprocess.run(["dpkg-deb", "-e", str(deb), str(control)], check=True, timeout=60)
    return {"rpm": rpm, "deb": {name: (control / file).read_text() for name, file in DEB_SCRIPTS.items()}}


STUB = '#!/bin/sh\necho "${0##*/} $*" >> "$GPUD_TEST_LOG"\n[ "$1" != is-enabled ]\n'


def _run_script(text: str, args: list[str], here: Path, systemd_running: bool, without: tuple[str, ...] = ()):
    """Runs a scriptlet as root in a mount namespace of its own, over a tmpfs /run (with
    /run/systemd/system where systemd "runs"). systemctl, gpud, getent and groupadd are stubs that
    log their arguments (no group is made, no unit touched); the rest is this machine's. A command in
    `without` is missing from PATH altogether."""
    if shutil.which("unshare", path=SYSTEM_PATH) is None or subprocess.run(["id", "-u"], capture_output=True, text=True,
                                                                          timeout=10).stdout.strip() != "0":
        pytest.fail("CI runs as root, with unshare") if IN_CI else pytest.skip("needs root and unshare")
    bin_dir = here / "bin"
    shutil.rmtree(bin_dir, ignore_errors=True)
    bin_dir.mkdir(parents=True)
    for tool in ("systemctl", "gpud", "getent", "groupadd"):
        if tool not in without:
            (bin_dir / tool).write_text(STUB)
            (bin_dir / tool).chmod(0o755)
    for tool in ("rm", "mkdir", "touch", "chown", "chmod", "find", "python3"):
        if tool not in without:
            (bin_dir / tool).symlink_to(shutil.which(tool, path="/usr/bin:/bin"))
    script, log = here / "script", here / "log"
    script.write_text(text)
    log.write_text("")
    mount, mkdir = (shutil.which(tool, path=SYSTEM_PATH) for tool in ("mount", "mkdir"))
    stage = f"{mount} -t tmpfs gpudt-scriptlet /run && " + \
        (f"{mkdir} -p /run/systemd/system && " if systemd_running else "")
    result = subprocess.run([shutil.which("unshare", path=SYSTEM_PATH), "-m", "/bin/sh", "-c",
                             stage + 'exec /bin/sh "$0" "$@"', str(script), *args],
                            capture_output=True, text=True, timeout=120,
                            env={"PATH": str(bin_dir), "GPUD_TEST_LOG": str(log)})
    assert result.returncode == 0, (args, result.stdout + result.stderr)
    return [line for line in log.read_text().splitlines() if line.startswith("systemctl ") or line.startswith("gpud ")]


# An upgrade restarts what runs of the package's units, a removal stops and disables all of them: gpud, its
# socket, and the two Kubernetes plugins the package ships but never enables.
TRY_RESTART = "systemctl try-restart gpud.service gpud-device-plugin.service gpud-dra-plugin.service"
DISABLE_NOW = "systemctl --no-reload disable --now gpud-device-plugin.service gpud-dra-plugin.service gpud.service " \
              "gpud.socket"

# (packager, script, its arguments, the systemctl and gpud commands it runs where systemd runs)
CONVENTIONS = [
    # rpm: %systemd_post (`systemctl --no-reload preset`, nothing started), %systemd_preun (`--no-reload
    # disable --now`), and the try-restart of %systemd_postun_with_restart, in the new version's %post.
    ("rpm", "postinstall", ["1"], ["systemctl --no-reload preset gpud.service"]),
    ("rpm", "postinstall", ["2"], ["systemctl daemon-reload", TRY_RESTART]),
    ("rpm", "preremove", ["1"], []),
    ("rpm", "preremove", ["0"], [DISABLE_NOW, "gpud mps quit-all"]),
    ("rpm", "postremove", ["1"], ["systemctl daemon-reload"]),
    ("rpm", "postremove", ["0"], ["systemctl daemon-reload"]),
    # deb: dh_installsystemd's convention, enabled and started on install
    ("deb", "postinstall", ["configure", ""], ["systemctl daemon-reload", "systemctl enable --now gpud.service"]),
    ("deb", "postinstall", ["configure", "0.0.9"],
     ["systemctl daemon-reload", TRY_RESTART]),
    ("deb", "preremove", ["upgrade", "0.2.0"], []),
    ("deb", "preremove", ["remove"], ["systemctl is-enabled --quiet gpud.service", DISABLE_NOW, "gpud mps quit-all"]),
]


@pytest.mark.parametrize(("packager", "script", "args", "expected"), CONVENTIONS)
def test_the_scriptlets_follow_each_packagers_convention_where_systemd_runs(scriptlets, tmp_path, packager, script,
                                                                           args, expected):
    assert _run_script(scriptlets[packager][script], args, tmp_path, systemd_running=True) == expected


def test_the_rpm_first_install_starts_nothing_with_or_without_systemd(scriptlets, tmp_path):
    for running in (True, False):
        calls = _run_script(scriptlets["rpm"]["postinstall"], ["1"], tmp_path, systemd_running=running)
        assert calls == ["systemctl --no-reload preset gpud.service"], calls
        assert not [call for call in calls if re.search(r"\b(start|restart|--now|enable)\b", call)]


# -- every command the scriptlets and units run is a dependency's, the package's own, or guarded ----

SHELL = {"if", "elif", "else", "fi", "then", "for", "in", "do", "done", "while", "until", "case", "esac", "[", "test",
         "set", "command", "exit", "true", "false", ":", "continue", "break", "echo", "printf", "return", "shift"}


def scriptlet_commands(text: str) -> set[str]:
    """The commands a POSIX sh script runs: the first word of each simple command (after `exec` and
    assignments), command substitutions included; shell keywords and builtins left out. `"$var"`
    stays as written: a command chosen at run time."""
    found = set()
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line)
        line = re.sub(r"'[^']*'", "Q", line)  # quoted text is an argument, not a command
        line = re.sub(r'"[^"]*"', lambda m: m[0] if re.fullmatch(r'"\$\w+"', m[0]) else "Q", line)  # but "$var"
        pieces = [line, *re.findall(r"\$\(([^()]*)\)", line)]
        pieces[0] = re.sub(r"\$\([^()]*\)", "X", line)
        for piece in pieces:
            for segment in re.split(r"&&|\|\||[;|()]|(?<![^\s;])[{}](?![^\s;])", piece):
                words = shlex.split(segment, posix=False)
                while words and (words[0] in ("if", "elif", "while", "until", "then", "do", "else", "exec", "!")
                                 or re.match(r"^[A-Za-z_]\w*=", words[0])):
                    words.pop(0)
                if words and words[0] not in SHELL:
                    found.add(words[0])
    return found


def test_the_command_parser_finds_what_a_script_runs():
    script = 'set -e\nx=$(getent group a) || groupadd "b;c" \'d(e)\'  # c\nif [ -d /x ]; then\n    systemctl stop a\nfi\n' \
             'for p in a b; do\n    command -v "$p" >/dev/null || continue\n    exec "$p" -I\ndone\n! find /x\n'
    assert scriptlet_commands(script) == {"getent", "groupadd", "systemctl", '"$p"', "find"}


def _unit_commands() -> set[str]:
    from helpers import REPO
    found = set()
    for unit in (REPO / "systemd").glob("*.service"):
        for line in unit.read_text().splitlines():
            match = re.match(r"Exec\w+=[-@:+!]*(\S+)", line)
            if match:
                found.add(match[1])
    return found


def test_every_command_of_the_units_is_the_package_s_own(rpm_package):
    files = subprocess.run(["rpm", "-qlp", str(rpm_package)], capture_output=True, text=True, check=True,
                           timeout=60).stdout.split()
    commands = _unit_commands()
    assert "/usr/bin/gpud" in commands  # ExecStart=, ExecReload= (gpud reload: no kill(1), no procps)
    assert commands <= set(files), commands - set(files)


def _guarded_variables(text: str, commands: set[str]) -> set[str]:
    """Commands chosen at run time (`"$python"`), each one looked up first (`command -v "$python"`)."""
    variables = {command for command in commands if command.startswith('"$')}
    for variable in variables:
        assert f"command -v {variable} >/dev/null 2>&1 || continue" in text, variable
    return variables


def test_every_rpm_scriptlet_command_is_a_declared_dependency_s(rpm_package, repositories, scriptlets, tmp_path):
    """Installed by dnf from the RHEL 9 stand-ins: each command's file in the root belongs to a package
    that provides one of gpud's Requires (or to gpud)."""
    dnf = _dnf(tmp_path, repositories, "el9", ("baseos", "appstream"))
    assert dnf("install", "python3").returncode == 0
    assert dnf("install", str(rpm_package)).returncode == 0
    rpm = lambda *args: subprocess.run(["rpm", "--root", str(dnf.root), *args], capture_output=True,  # noqa: E731
                                       text=True, timeout=60)
    providers = {"gpud"}
    for requirement in rpm("-qR", "gpud").stdout.splitlines():
        if not requirement.startswith("rpmlib("):
            providers |= set(rpm("-q", "--whatprovides", requirement, "--qf", "%{NAME}\n").stdout.split())
    for name, text in scriptlets["rpm"].items():
        commands = scriptlet_commands(text)
        for command in sorted(commands - _guarded_variables(text, commands)):
            path = next((f"{d}/{command}" for d in ("/usr/sbin", "/usr/bin") if (dnf.root / d[1:] / command).exists()),
                        None)
            assert path, f"{name}: {command} is in no package gpud requires"
            owner = rpm("-qf", path, "--qf", "%{NAME}").stdout
            assert owner in providers, (name, command, owner, providers)


def test_every_deb_script_command_is_a_dependency_s_essential_or_guarded(rpm_package, scriptlets, tmp_path):
    """Debian 12 here: each command's owner (dpkg -S) is in the .deb's Depends or Essential: yes. The
    exception is systemctl, which the scripts run only where systemd runs or tolerate missing: they
    succeed with no systemd and no systemctl at all."""
    deb = rpm_package.parent / rpm_package.name.replace("-1.x86_64.rpm", "_amd64.deb").replace("gpud-", "gpud_")
    depends = subprocess.run(["dpkg-deb", "-f", str(deb), "Depends"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    declared = {re.split(r"[\s(]", d.strip())[0] for d in depends.split(",")}
    guarded = {"systemctl"}
    for name, text in scriptlets["deb"].items():
        commands = scriptlet_commands(text)
        for command in sorted(commands - _guarded_variables(text, commands) - guarded - {"gpud"}):
            path = shutil.which(command, path="/usr/sbin:/usr/bin:/sbin:/bin")
            owner = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, timeout=60)
            if owner.returncode != 0:  # dpkg knows the file by its pre-merge name
                owner = subprocess.run(["dpkg", "-S", path.removeprefix("/usr")], capture_output=True, text=True,
                                       timeout=60)
            package = owner.stdout.split(":")[0]
            essential = subprocess.run(["dpkg-query", "-W", "-f", "${Essential}", package], capture_output=True,
                                       text=True, timeout=60).stdout
            assert package in declared or essential == "yes", (name, command, package)
    for script, args in (("postinstall", ["configure", ""]), ("postinstall", ["configure", "0.0.9"]),
                         ("preremove", ["remove"]), ("postremove", ["remove"])):
        assert _run_script(scriptlets["deb"][script], args, tmp_path, systemd_running=False, without=("systemctl",)) \
            in ([], ["gpud mps quit-all"])
