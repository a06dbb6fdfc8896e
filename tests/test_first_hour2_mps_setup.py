"""The README's set-up installs what its MPS examples run (issue 39): NVIDIA's nvidia-cuda-mps from Debian's
non-free component, which scripts/enable-non-free adds to Debian's own entries of apt's sources as a fresh
Debian 12 has them (debootstrap's one-line /etc/apt/sources.list, or a cloud image's deb822
debian.sources), once, leaving every other repository's entry alone. apt itself reads the result."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, SYSTEM_PATH, need
from nspawn_root import apt_mirror

SCRIPT = REPO / "scripts" / "enable-non-free"

# debootstrap bookworm writes exactly this (debootstrap's functions, setup_apt_sources: one line, main).
DEBOOTSTRAP = "deb http://deb.debian.org/debian bookworm main\n"
# Debian's container and cloud images: deb822, `Components: main` (debuerreotype; debian-cloud-images).
CLOUD = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
# Debian's installer: non-free-firmware, source lines, a commented-out CD-ROM, a mirror of its own.
INSTALLER = """\
#deb cdrom:[Debian GNU/Linux 12.5.0 _Bookworm_ - Official amd64 NETINST]/ bookworm main non-free-firmware

deb http://ftp.de.debian.org/debian/ bookworm main non-free-firmware
deb-src http://ftp.de.debian.org/debian/ bookworm main non-free-firmware
deb [arch=amd64] http://mirror.example.org/debian bookworm-updates main contrib # the local mirror
"""
# The operator's other repositories: never touched, though one has main and one a .../debian path.
OTHERS_LIST = ("deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.gpg] https://download.docker.com/linux/debian "
               "bookworm stable\ndeb http://apt.postgresql.org/pub/repos/apt bookworm-pgdg main\n")
OTHERS_SOURCES = """\
Types: deb
URIs: https://packages.example.com/apt
Suites: bookworm
Components: main
"""


def apt_etc(tmp_path: Path, sources_list: str | None, parts: dict[str, str]) -> Path:
    etc = tmp_path / "apt"
    (etc / "sources.list.d").mkdir(parents=True)
    if sources_list is not None:
        (etc / "sources.list").write_text(sources_list)
    for name, text in parts.items():
        (etc / "sources.list.d" / name).write_text(text)
    return etc


def enable(etc: Path) -> str:
    return subprocess.run([str(SCRIPT), str(etc)], capture_output=True, text=True, check=True, timeout=60).stdout


def index_targets(etc: Path) -> set[tuple[str, str, str]]:
    """(site, suite, component) of each index apt would fetch: apt's own reading of the sources."""
    if shutil.which("apt-get") is None:
        pytest.skip("needs Debian's apt")
    listed = subprocess.run(["apt-get", "indextargets", "--no-release-info", "--format", "$(SITE) $(RELEASE) $(COMPONENT)",
                             "-o", f"Dir::Etc::SourceList={etc / 'sources.list'}",
                             "-o", f"Dir::Etc::SourceParts={etc / 'sources.list.d'}"],
                            capture_output=True, text=True, check=True, timeout=60)
    assert "E:" not in listed.stderr, listed.stderr
    return {tuple(line.split()) for line in listed.stdout.splitlines() if line}


def components(targets: set, site: str, suite: str) -> set[str]:
    return {component for s, r, component in targets if (s, r) == (site, suite)}


FULL = {"main", "contrib", "non-free"}


@pytest.mark.parametrize("form", ["debootstrap", "cloud"])
def test_a_fresh_debian_12_gets_non_free_once_and_other_repositories_stay(tmp_path, form):
    others = {"docker.list": OTHERS_LIST, "example.sources": OTHERS_SOURCES}
    if form == "debootstrap":
        etc = apt_etc(tmp_path, DEBOOTSTRAP, others)
    else:
        etc = apt_etc(tmp_path, None, {"debian.sources": CLOUD, **others})
    (etc / "sources.list.d" / "docker.list").chmod(0o600)
    before = index_targets(etc)
    assert "non-free" not in {component for _, _, component in before}

    said = enable(etc)
    assert ("sources.list:" if form == "debootstrap" else "debian.sources:") in said
    after = index_targets(etc)
    suites = ["bookworm"] if form == "debootstrap" else ["bookworm", "bookworm-updates"]
    for suite in suites:
        assert components(after, "http://deb.debian.org/debian", suite) == FULL
    if form == "cloud":
        assert components(after, "http://deb.debian.org/debian-security", "bookworm-security") == FULL
        text = (etc / "sources.list.d" / "debian.sources").read_text()
        assert "# http://snapshot.debian.org/archive/debian/20250520T000000Z\n" in text  # comments stay
        assert text.count("Components: main contrib non-free\n") == 2
    other = {t for t in after if "debian.org" not in t[0]}
    assert other == {t for t in before if "debian.org" not in t[0]}  # the operator's own, as they were
    assert (etc / "sources.list.d" / "docker.list").read_text() == OTHERS_LIST
    assert (etc / "sources.list.d" / "docker.list").stat().st_mode & 0o777 == 0o600
    assert (etc / "sources.list.d" / "example.sources").read_text() == OTHERS_SOURCES

    files = {path: path.read_bytes() for path in etc.rglob("*") if path.is_file()}
    assert enable(etc) == ""  # a second run: nothing to add, nothing written
    assert {path: path.read_bytes() for path in files} == files


def test_the_installers_sources_keep_their_comments_firmware_and_source_lines(tmp_path):
    etc = apt_etc(tmp_path, INSTALLER, {})
    enable(etc)
    lines = (etc / "sources.list").read_text().splitlines()
    assert lines[0].startswith("#deb cdrom:") and lines[0].endswith("main non-free-firmware")  # a comment
    assert lines[2] == "deb http://ftp.de.debian.org/debian/ bookworm main non-free-firmware contrib non-free"
    assert lines[3] == "deb-src http://ftp.de.debian.org/debian/ bookworm main non-free-firmware"
    assert lines[4] == "deb [arch=amd64] http://mirror.example.org/debian bookworm-updates main contrib non-free " \
                       "# the local mirror"
    targets = index_targets(etc)
    assert components(targets, "http://ftp.de.debian.org/debian", "bookworm") == FULL | {"non-free-firmware"}
    assert components(targets, "http://mirror.example.org/debian", "bookworm-updates") == FULL


def test_the_setup_installs_nvidia_cuda_mps_through_install_deps_and_the_readme_says_so():
    install = (REPO / "scripts" / "install-deps").read_text()
    packages = re.search(r"apt-get install -y -q --no-install-recommends ([^\n]+)", install)[1].split()
    assert {"nvidia-cuda-mps", "libnvidia-ml1", "python3-venv", "git", "curl"} <= set(packages)
    assert install.index("scripts/enable-non-free") < install.index("apt-get update")
    assert "./scripts/install-deps" in (REPO / "scripts" / "test-all").read_text()
    setup = (REPO / "README.md").read_text().split("## Set-up on a fresh Debian 12 machine", 1)[1].split("\n## ", 1)[0]
    assert "nvidia-cuda-mps" in setup and "./scripts/install-deps" in setup and "non-free" in setup


CLOUD_MAIN_ONLY = CLOUD.replace("# http://snapshot.debian.org/archive/debian/20250520T000000Z\n", "")


@pytest.mark.slow
def test_a_debootstrapped_debian_12_installs_nvidia_cuda_mps_after_enable_non_free_in_both_forms(tmp_path):
    """A fresh Debian 12 root as debootstrap makes it (main only), then the same with a cloud image's
    deb822 sources: apt cannot find nvidia-cuda-mps, and can, with what it needs from contrib, after the
    script."""
    need(os.geteuid() == 0 and shutil.which("debootstrap", path=SYSTEM_PATH) is not None,
         "needs root and debootstrap (scripts/test-all installs it)")
    root = tmp_path / "bookworm"
    subprocess.run([shutil.which("debootstrap", path=SYSTEM_PATH), "--variant=minbase", "bookworm", str(root),
                    apt_mirror()], check=True, capture_output=True, timeout=1200)
    shutil.copy(SCRIPT, root / "root" / "enable-non-free")

    def chroot(command: str) -> subprocess.CompletedProcess:
        return subprocess.run([shutil.which("chroot", path=SYSTEM_PATH), str(root), "/bin/bash", "-c", command],
                              capture_output=True, text=True, timeout=600, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})

    simulate = "apt-get update -q >/dev/null && apt-get install -s --no-install-recommends nvidia-cuda-mps libnvidia-ml1"
    for form in ("debootstrap", "cloud"):
        if form == "cloud":
            mirror = (root / "etc/apt/sources.list").read_text().split()[1]
            (root / "etc/apt/sources.list").unlink()
            (root / "etc/apt/sources.list.d/debian.sources").write_text(
                CLOUD_MAIN_ONLY.replace("http://deb.debian.org/debian", mirror, 1))
            chroot("rm -rf /var/lib/apt/lists/*")
        before = chroot(simulate)
        assert before.returncode != 0 and "Unable to locate package nvidia-cuda-mps" in before.stderr, before
        assert chroot("/root/enable-non-free").stdout.startswith("enable-non-free: /etc/apt/sources.list")
        after = chroot(simulate)
        assert after.returncode == 0, after.stderr
        installs = {line.split()[1] for line in after.stdout.splitlines() if line.startswith("Inst ")}
        assert {"nvidia-cuda-mps", "libnvidia-ml1", "glx-alternative-nvidia"} <= installs, after.stdout  # contrib's too
        assert chroot("/root/enable-non-free").stdout == ""
