"""packaging/repo.sh: an apt and a dnf repository of the built packages, signed with the operator's key,
checked with the real clients: apt-get and apt-cache with an apt configuration of their own, dnf with an
install root of its own, rpmkeys, gpgv. What it signs must verify with the exported key, and fail with
another key's repository or with metadata changed after signing. packaging/README.md, "Repositories"."""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import IN_CI, REPO
from test_packaging import build

from gpud import __version__

# The modules that build the packages into build/ and dist/ share one pytest-xdist worker, one after
# the other.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packages")]
REPO_SH = REPO / "packaging" / "repo.sh"
# tool: the Debian package CI installs it from (scripts/test-all)
TOOLS = {"gpg": "gnupg", "gpgv": "gpgv", "apt-ftparchive": "apt-utils", "createrepo_c": "createrepo-c",
         "dnf": "dnf", "rpmsign": "rpm", "rpmkeys": "rpm", "dpkg-deb": "dpkg"}


def needs_tools() -> None:
    missing = [f"{tool} ({package})" for tool, package in TOOLS.items() if shutil.which(tool) is None]
    if missing:
        if IN_CI:
            pytest.fail(f"CI installs {', '.join(missing)} (scripts/test-all)")
        pytest.skip(f"not installed: {', '.join(missing)}")


class Keyring:
    """A throwaway GNUPGHOME with one signing key and no passphrase, as short a path as gpg-agent's socket
    needs (under 108 bytes)."""

    def __init__(self, name: str, algorithm: str):
        self.home = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))
        self.home.chmod(0o700)
        self.env = {**os.environ, "GNUPGHOME": str(self.home)}
        self.gpg("--passphrase", "", "--quick-gen-key", f"{name} <{name.replace(' ', '.')}@example.org>",
                 algorithm, "sign", "never")
        listing = self.gpg("--with-colons", "--list-secret-keys").stdout
        self.fingerprint = re.search(r"^fpr:+([0-9A-F]{40}):", listing, re.M)[1]

    def gpg(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["gpg", "--batch", *args], env=self.env, capture_output=True, text=True, check=True,
                              timeout=120)

    def export(self) -> bytes:
        return subprocess.run(["gpg", "--batch", "--export", self.fingerprint], env=self.env, capture_output=True,
                              check=True, timeout=60).stdout

    def close(self) -> None:
        subprocess.run(["gpgconf", "--kill", "all"], env=self.env, capture_output=True, timeout=60)
        shutil.rmtree(self.home, ignore_errors=True)


def repo_sh(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO_SH), *args], capture_output=True, text=True, timeout=300,
                          env=env or os.environ.copy())


@pytest.fixture(scope="module")
def keys():
    needs_tools()
    # RSA, as RHEL 8's and 9's rpm verify it (the README recommends it); the other one is only the wrong key.
    mine, other = Keyring("gpud signing", "rsa3072"), Keyring("someone else", "ed25519")
    yield mine, other
    mine.close()
    other.close()


@pytest.fixture(scope="module")
def package_dir(keys, tmp_path_factory) -> Path:
    """The checkout's .deb and .rpm, alone in a directory (dist/ may hold other versions)."""
    deb, rpm = build()
    directory = tmp_path_factory.mktemp("packages")
    for package in (deb, rpm):
        shutil.copy2(package, directory)
    return directory


def make_repo(package_dir: Path, out: Path, key: Keyring) -> Path:
    result = repo_sh("--key", key.fingerprint, "--gnupghome", str(key.home), str(package_dir), str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == "", result.stderr
    return out


@pytest.fixture(scope="module")
def repo(keys, package_dir, tmp_path_factory) -> Path:
    return make_repo(package_dir, tmp_path_factory.mktemp("mirror") / "gpud", keys[0])


@pytest.fixture(scope="module")
def their_repo(keys, package_dir, tmp_path_factory) -> Path:
    """The same packages, signed with another key."""
    return make_repo(package_dir, tmp_path_factory.mktemp("theirs") / "gpud", keys[1])


def copy_without_packages(repo: Path, to: Path) -> Path:
    """The repository's metadata and keys, to tamper with (the package files are not needed for that), its
    client files pointed at the copy."""
    shutil.copytree(repo, to, ignore=shutil.ignore_patterns("*.deb", "*.rpm"))
    for client_file in ("gpud.list", "gpud.sources", "gpud.repo"):
        (to / client_file).write_text((repo / client_file).read_text().replace(str(repo), str(to)))
    return to


# -- what it makes, and its signatures read with gpgv --------------------------------------------

def gpgv(keyring: Path, *files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["gpgv", "--keyring", str(keyring), *map(str, files)], capture_output=True, text=True,
                          timeout=60)


def test_the_repositories_are_signed_with_the_operators_key_alone(repo, keys, package_dir):
    mine = keys[0]
    dists = repo / "apt/dists/stable"
    assert gpgv(repo / "gpud.gpg", dists / "InRelease").returncode == 0
    assert gpgv(repo / "gpud.gpg", dists / "Release.gpg", dists / "Release").returncode == 0
    assert gpgv(repo / "gpud.gpg", repo / "rpm/repodata/repomd.xml.asc", repo / "rpm/repodata/repomd.xml").returncode == 0
    # the exported key is that one key, in both forms, and nothing secret
    for export in ("gpud.gpg", "gpud.asc"):
        shown = mine.gpg("--with-colons", "--show-keys", str(repo / export)).stdout
        assert re.findall(r"^fpr:+([0-9A-F]{40}):", shown, re.M) == [mine.fingerprint], shown
        assert "sec:" not in shown
    # the other key cannot verify it
    other_keyring = repo.parent / "other.gpg"
    other_keyring.write_bytes(keys[1].export())
    assert gpgv(other_keyring, dists / "InRelease").returncode != 0
    # Release: SHA256 and SHA512 of each Packages file, right
    release = (dists / "Release").read_text()
    assert re.search(r"^Suite: stable$", release, re.M) and re.search(r"^Architectures: amd64$", release, re.M)
    for algorithm in ("SHA256", "SHA512"):
        section = re.search(rf"^{algorithm}:\n((?: .*\n?)+)", release, re.M)[1]
        listed = {name: (digest, int(size)) for digest, size, name in (line.split() for line in section.splitlines())}
        for name in ("main/binary-amd64/Packages", "main/binary-amd64/Packages.gz", "main/binary-amd64/Packages.xz"):
            data = (dists / name).read_bytes()
            assert listed[name] == (hashlib.new(algorithm.lower(), data).hexdigest(), len(data)), name
    packages = (dists / "main/binary-amd64/Packages").read_text()
    assert f"Version: {__version__}\n" in packages
    assert f"Filename: pool/main/g/gpud/gpud_{__version__}_amd64.deb\n" in packages
    # the packages directory is as it was: the .rpm signed is the repository's copy
    assert {p.name for p in package_dir.iterdir()} == {f"gpud_{__version__}_amd64.deb", f"gpud-{__version__}-1.x86_64.rpm"}
    assert (package_dir / f"gpud-{__version__}-1.x86_64.rpm").read_bytes() != \
        (repo / f"rpm/gpud-{__version__}-1.x86_64.rpm").read_bytes()
    assert (package_dir / f"gpud_{__version__}_amd64.deb").read_bytes() == \
        (repo / f"apt/pool/main/g/gpud/gpud_{__version__}_amd64.deb").read_bytes()


# -- apt -----------------------------------------------------------------------------------------

class Apt:
    """apt-get and apt-cache with a configuration, state and cache of their own: only the given source,
    only its signed-by key (no trusted.gpg), an empty dpkg status."""

    def __init__(self, where: Path, source_name: str, source_text: str):
        self.where = where
        empty = where / "empty"
        sources = where / "sources"
        for directory in (empty, sources, where / "state/lists/partial", where / "cache/archives/partial",
                          where / "downloads"):
            directory.mkdir(parents=True, exist_ok=True)
        (sources / source_name).write_text(source_text)
        (where / "status").write_text("")
        self.options = []
        for option, value in (("Dir::Etc::SourceList", "/dev/null"), ("Dir::Etc::SourceParts", sources),
                              ("Dir::State", where / "state"), ("Dir::State::status", where / "status"),
                              ("Dir::Cache", where / "cache"), ("Dir::Etc::Trusted", "/dev/null"),
                              ("Dir::Etc::TrustedParts", empty), ("Dir::Etc::Preferences", "/dev/null"),
                              ("Dir::Etc::PreferencesParts", empty), ("APT::Architecture", "amd64"),
                              ("APT::Architectures", "amd64"), ("APT::Sandbox::User", "root"),
                              ("Debug::NoLocking", "1")):
            self.options += ["-o", f"{option}={value}"]

    def __call__(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([tool, *self.options, *args], capture_output=True, text=True, timeout=300,
                              cwd=self.where / "downloads", env={**os.environ, "LANG": "C"})


def apt_for(repo: Path, where: Path, form: str = "list", key: Path | None = None) -> Apt:
    """apt with the source entry repo.sh wrote, its signed-by pointed at the exported key (or at key)."""
    text = (repo / f"gpud.{form}").read_text()
    assert text.count("/etc/apt/keyrings/gpud.gpg") == 1, text
    return Apt(where, f"gpud.{form}", text.replace("/etc/apt/keyrings/gpud.gpg", str(key or repo / "gpud.gpg")))


@pytest.mark.parametrize("form", ["list", "sources"])
def test_apt_verifies_the_repository_and_finds_gpud_at_the_built_version(repo, package_dir, tmp_path, form):
    apt = apt_for(repo, tmp_path, form)
    update = apt("apt-get", "update")
    assert update.returncode == 0, update.stdout + update.stderr
    # no warning at all: not "unsigned", not a weak digest or key, not a missing architecture
    assert not re.search(r"^[WE]:", update.stdout + update.stderr, re.M), update.stdout + update.stderr
    policy = apt("apt-cache", "policy", "gpud")
    assert f"Candidate: {__version__}\n" in policy.stdout, policy.stdout + policy.stderr
    download = apt("apt-get", "download", "gpud")
    assert download.returncode == 0, download.stdout + download.stderr
    downloaded = tmp_path / "downloads" / f"gpud_{__version__}_amd64.deb"
    assert downloaded.read_bytes() == (package_dir / downloaded.name).read_bytes()
    simulated = apt("apt-get", "install", "--simulate", "--no-install-recommends", "gpud")
    # an empty dpkg status: gpud's dependencies (python3, libc6) are not there, and apt says so, which
    # means it read gpud's own record from the repository
    assert "gpud : Depends: python3 (>= 3.10)" in simulated.stdout, simulated.stdout + simulated.stderr


def failed_update(apt: Apt) -> str:
    update = apt("apt-get", "update")
    output = update.stdout + update.stderr
    assert update.returncode != 0, output
    policy = apt("apt-cache", "policy", "gpud")
    assert "Candidate" not in policy.stdout, policy.stdout  # nothing from the repository was taken in
    return output


def test_apt_refuses_a_repository_signed_by_another_key(their_repo, repo, tmp_path):
    output = failed_update(apt_for(their_repo, tmp_path / "apt", key=repo / "gpud.gpg"))
    assert "NO_PUBKEY" in output and "is not signed" in output, output


def test_apt_refuses_a_changed_packages_file(repo, tmp_path):
    tampered = copy_without_packages(repo, tmp_path / "tampered")
    index = tampered / "apt/dists/stable/main/binary-amd64"
    # What an attacker would do: another version in Packages, compressed again in both forms.
    text = (index / "Packages").read_text().replace(f"Version: {__version__}\n", "Version: 99.0\n")
    (index / "Packages").write_text(text)
    (index / "Packages.gz").write_bytes(gzip.compress(text.encode()))
    (index / "Packages.xz").write_bytes(lzma.compress(text.encode()))
    output = failed_update(apt_for(tampered, tmp_path / "apt"))
    assert "Hash Sum mismatch" in output or "unexpected size" in output, output


def test_apt_refuses_a_changed_release_file(repo, tmp_path):
    tampered = copy_without_packages(repo, tmp_path / "tampered")
    dists = tampered / "apt/dists/stable"
    for name in ("InRelease", "Release"):
        (dists / name).write_text((dists / name).read_text().replace("Suite: stable", "Suite: stab1e"))
    output = failed_update(apt_for(tampered, tmp_path / "apt"))
    assert "BADSIG" in output, output


def test_apt_refuses_the_repository_without_its_signatures(repo, tmp_path):
    tampered = copy_without_packages(repo, tmp_path / "tampered")
    for name in ("InRelease", "Release.gpg"):
        (tampered / "apt/dists/stable" / name).unlink()
    output = failed_update(apt_for(tampered, tmp_path / "apt"))
    assert "is not signed" in output, output


# -- dnf and rpm ---------------------------------------------------------------------------------

def dnf(repo: Path, where: Path, *args: str) -> subprocess.CompletedProcess:
    """dnf with only repo.sh's gpud.repo (file:// URLs: --url was not given), in an install root of its own.
    -y: dnf asks before it takes the repository's key in, as a fleet's config management answers yes.
    skip_if_unavailable=False, as Fedora's and RHEL's dnf.conf have it (Debian's dnf skips a repository
    whose metadata fails, and exits 0)."""
    repos = where / "repos"
    repos.mkdir(parents=True, exist_ok=True)
    shutil.copy(repo / "gpud.repo", repos)
    return subprocess.run(["dnf", f"--installroot={where / 'root'}", f"--setopt=reposdir={repos}",
                           f"--setopt=cachedir={where / 'cache'}", "--setopt=skip_if_unavailable=False",
                           "--releasever=9", "--disablerepo=*",
                           "--enablerepo=gpud", "-y", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LANG": "C"})


def test_the_repo_file_asks_for_signed_packages_and_signed_metadata(repo):
    lines = (repo / "gpud.repo").read_text().splitlines()
    assert lines[0] == "[gpud]"
    assert {"gpgcheck=1", "repo_gpgcheck=1", f"gpgkey=file://{repo}/gpud.asc", f"baseurl=file://{repo}/rpm"} <= set(lines)


def test_dnf_verifies_the_metadata_and_finds_gpud_at_the_built_version(repo, tmp_path):
    makecache = dnf(repo, tmp_path, "makecache")
    assert makecache.returncode == 0, makecache.stdout + makecache.stderr
    assert "Importing GPG key" in makecache.stdout + makecache.stderr  # repo_gpgcheck=1 did check
    query = dnf(repo, tmp_path, "repoquery", "--qf", "%{name} %{version}-%{release} %{arch}", "gpud")
    assert query.returncode == 0, query.stdout + query.stderr
    assert f"gpud {__version__}-1 x86_64" in query.stdout.splitlines(), query.stdout


def test_dnf_refuses_a_changed_repomd(repo, tmp_path):
    tampered = copy_without_packages(repo, tmp_path / "tampered")
    repomd = tampered / "rpm/repodata/repomd.xml"
    repomd.write_text(repomd.read_text().replace("<revision>", "<revision>1"))
    result = dnf(tampered, tmp_path, "makecache")
    assert result.returncode != 0, result.stdout + result.stderr
    assert "repomd.xml GPG signature verification error: Bad GPG signature" in result.stderr, result.stderr


def test_dnf_refuses_metadata_signed_by_another_key(their_repo, repo, tmp_path):
    theirs = copy_without_packages(their_repo, tmp_path / "theirs")
    # their repository, our key
    (theirs / "gpud.repo").write_text((theirs / "gpud.repo").read_text().replace(
        f"gpgkey=file://{theirs}/gpud.asc", f"gpgkey=file://{repo}/gpud.asc"))
    result = dnf(theirs, tmp_path, "makecache")
    assert result.returncode != 0, result.stdout + result.stderr
    assert "repomd.xml GPG signature verification error" in result.stderr, result.stderr


def test_key_rotation_clients_holding_both_keys_take_the_repository_signed_with_the_new_one(repo, their_repo,
                                                                                           tmp_path):
    """packaging/README.md's rotation: the new key goes to the clients beside the old one first; then the
    repository is signed with the new key (here: their_repo's), and both clients keep working."""
    both = tmp_path / "both.gpg"
    both.write_bytes((repo / "gpud.gpg").read_bytes() + (their_repo / "gpud.gpg").read_bytes())
    apt = apt_for(their_repo, tmp_path / "apt", key=both)
    update = apt("apt-get", "update")
    assert update.returncode == 0 and not re.search(r"^[WE]:", update.stdout + update.stderr, re.M), \
        update.stdout + update.stderr
    assert f"Candidate: {__version__}\n" in apt("apt-cache", "policy", "gpud").stdout
    theirs = copy_without_packages(their_repo, tmp_path / "theirs")
    (theirs / "gpud.repo").write_text((theirs / "gpud.repo").read_text().replace(
        f"gpgkey=file://{theirs}/gpud.asc", f"gpgkey=file://{repo}/gpud.asc file://{theirs}/gpud.asc"))
    makecache = dnf(theirs, tmp_path / "dnf", "makecache")
    assert makecache.returncode == 0, makecache.stdout + makecache.stderr


def test_the_rpm_is_signed_and_verifies_with_the_exported_key_only(repo, keys, tmp_path):
    rpm = repo / f"rpm/gpud-{__version__}-1.x86_64.rpm"
    root = tmp_path / "rpmroot"
    root.mkdir()

    def checksig() -> subprocess.CompletedProcess:
        return subprocess.run(["rpmkeys", "--root", str(root), "--checksig", str(rpm)], capture_output=True,
                              text=True, timeout=60)

    unknown = checksig()  # the key not imported: what dnf's gpgcheck=1 refuses
    assert unknown.returncode != 0 and "SIGNATURES NOT OK" in unknown.stdout, unknown.stdout + unknown.stderr
    subprocess.run(["rpmkeys", "--root", str(root), "--import", str(repo / "gpud.asc")], check=True,
                   capture_output=True, timeout=60)
    known = checksig()
    assert known.returncode == 0 and known.stdout.strip().endswith("digests signatures OK"), known.stdout
    info = subprocess.run(["rpm", "-qp", "--qf", "%{SIGPGP:pgpsig}\n%{RSAHEADER:pgpsig}\n", str(rpm)],
                          capture_output=True, text=True, timeout=60).stdout
    assert f"Key ID {keys[0].fingerprint[-16:].lower()}" in info, info


def test_the_readme_shows_what_repo_sh_writes(keys, package_dir, tmp_path):
    """README.md's "From your own mirror": the apt source line and the .repo file, for its example URL."""
    out = tmp_path / "public"
    result = repo_sh("--key", keys[0].fingerprint, "--gnupghome", str(keys[0].home), "--url",
                     "https://mirror.example.com/gpud/", str(package_dir), str(out))
    assert result.returncode == 0, result.stderr
    readme = (REPO / "README.md").read_text().split("### From your own mirror", 1)[1].split("\n## ", 1)[0]
    source = (out / "gpud.list").read_text().strip()
    assert f"/etc/apt/sources.list.d/gpud.list        {source}\n" in readme, source
    shown = readme.split("```ini\n", 1)[1].split("```", 1)[0]
    written = (out / "gpud.repo").read_text()
    assert "gpgkey=https://mirror.example.com/gpud/gpud.asc\n" in written
    assert "gpgkey=https://mirror.example.com/gpud/gpud.asc" in shown
    assert written.replace("gpgkey=https://mirror.example.com/gpud/gpud.asc",
                           "gpgkey=file:///etc/pki/rpm-gpg/RPM-GPG-KEY-gpud") in shown


# -- what it refuses -----------------------------------------------------------------------------

def test_refusals_say_why_and_exit_2(keys, tmp_path):
    mine = keys[0]
    packages = tmp_path / "packages"
    packages.mkdir()
    key = ["--key", mine.fingerprint, "--gnupghome", str(mine.home)]

    def refused(*args: str, env: dict | None = None) -> str:
        result = repo_sh(*args, env=env)
        assert result.returncode == 2, (args, result.returncode, result.stdout, result.stderr)
        assert not (tmp_path / "out").exists()
        return result.stderr

    assert "no .deb or .rpm in" in refused(*key, str(packages), str(tmp_path / "out"))
    (packages / "gpud_1_amd64.deb").write_bytes(b"not read before the checks")
    (packages / "gpud-1-1.x86_64.rpm").write_bytes(b"not read before the checks")
    assert "--key is required" in refused(str(packages), str(tmp_path / "out"))
    assert "no secret key 'nobody@example.org'" in refused("--key", "nobody@example.org", "--gnupghome",
                                                          str(mine.home), str(packages), str(tmp_path / "out"))
    # the public key alone is not enough
    public_only = Keyring.__new__(Keyring)
    public_only.home = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))
    public_only.env = {**os.environ, "GNUPGHOME": str(public_only.home)}
    try:
        subprocess.run(["gpg", "--batch", "--import"], input=mine.export(), env=public_only.env, capture_output=True,
                       check=True, timeout=60)
        assert "no secret key" in refused("--key", mine.fingerprint, "--gnupghome", str(public_only.home),
                                          str(packages), str(tmp_path / "out"))
    finally:
        public_only.close()
    inside = refused(*key, str(packages), str(packages / "repo"))
    assert "is inside the packages directory" in inside
    assert not (packages / "repo").exists()
    # a directory that repo.sh did not make is not replaced
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep").write_text("the operator's")
    assert "was not made by repo.sh" in refused(*key, str(packages), str(foreign))
    assert (foreign / "keep").read_text() == "the operator's"
    # a missing tool, named with the packages that provide it
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        for tool in os.listdir(directory):
            if tool not in ("createrepo_c",) and not (bin_dir / tool).exists():
                (bin_dir / tool).symlink_to(Path(directory) / tool)
    stderr = refused(*key, str(packages), str(tmp_path / "out"), env={**os.environ, "PATH": str(bin_dir)})
    assert "createrepo_c is missing" in stderr and "apt-get install createrepo-c" in stderr \
        and "dnf install createrepo_c" in stderr, stderr
