#!/usr/bin/env bash
# Builds a signed apt repository and a signed dnf/yum repository from a directory of packages, for an
# operator's own mirror (packaging/README.md, "Repositories").
#
#   packaging/repo.sh --key KEY [--gnupghome DIR] [--url URL] [--suite SUITE] PACKAGES_DIR OUTPUT_DIR
#
#   --key KEY        the OpenPGP key that signs (key id, fingerprint or user id known to gpg); its
#                    secret key must be in the keyring and usable without a prompt (gpg-agent holds
#                    its passphrase, or it has none)
#   --gnupghome DIR  gpg's home directory (default: $GNUPGHOME, else ~/.gnupg)
#   --url URL        where OUTPUT_DIR will be served from, written into the client files below
#                    (default: file://OUTPUT_DIR, which works on this machine only)
#   --suite SUITE    the apt suite (default: stable); the component is always "main"
#   PACKAGES_DIR     holds the .deb and .rpm files (not searched recursively); it is not modified
#   OUTPUT_DIR       made, or replaced if an earlier run of this script made it (marker file
#                    .gpud-repo); anything else there is refused. It must not lie inside PACKAGES_DIR.
#
# OUTPUT_DIR afterwards, to publish as it is (rsync it to the mirror):
#   gpud.gpg, gpud.asc   the public key, binary (apt's signed-by=) and armored (dnf's gpgkey=)
#   apt/                 dists/SUITE/{Release,InRelease,Release.gpg}
#                        dists/SUITE/main/binary-ARCH/Packages{,.gz,.xz}, pool/main/<p>/<package>/*.deb
#   rpm/                 the .rpm files, signed (rpmsign --addsign), repodata/ (createrepo_c) with
#                        repodata/repomd.xml.asc, a detached signature of repomd.xml
#   gpud.list, gpud.sources   apt's source entry, one-line and deb822 forms, signed-by /etc/apt/keyrings/gpud.gpg
#   gpud.repo            dnf/yum's repository file: gpgcheck=1, repo_gpgcheck=1, gpgkey=URL/gpud.asc
#
# Signed: apt's Release (InRelease clearsigned, Release.gpg detached), which carries the SHA256 and
# SHA512 of every Packages file, which carry those of every .deb; dnf's repomd.xml (repomd.xml.asc),
# which carries the checksums of the other metadata, which carry those of every .rpm; and every .rpm
# itself, in its header. The .deb files carry no signature of their own (apt does not check one).
#
# Exit status: 0 done; 2 refused (bad arguments, no such secret key, no packages, OUTPUT_DIR inside
# PACKAGES_DIR or not ours, a tool missing), with a message on stderr; other: a tool failed.
set -euo pipefail

usage="usage: packaging/repo.sh --key KEY [--gnupghome DIR] [--url URL] [--suite SUITE] PACKAGES_DIR OUTPUT_DIR"
refuse() { echo "repo.sh: $*" >&2; exit 2; }

key='' url='' suite=stable
positional=()
while [ $# -gt 0 ]; do
    case $1 in
        --key) [ $# -ge 2 ] || refuse "--key needs a value; $usage"; key=$2; shift 2 ;;
        --gnupghome) [ $# -ge 2 ] || refuse "--gnupghome needs a value; $usage"; export GNUPGHOME=$2; shift 2 ;;
        --url) [ $# -ge 2 ] || refuse "--url needs a value; $usage"; url=${2%/}; shift 2 ;;
        --suite) [ $# -ge 2 ] || refuse "--suite needs a value; $usage"; suite=$2; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        --) shift; positional+=("$@"); break ;;
        -*) refuse "unknown option $1; $usage" ;;
        *) positional+=("$1"); shift ;;
    esac
done
[ ${#positional[@]} -eq 2 ] || refuse "$usage"
[ -n "$key" ] || refuse "--key is required: the operator's signing key (gpg --list-secret-keys); $usage"
[[ $suite =~ ^[A-Za-z0-9._-]+$ ]] || refuse "--suite $suite: letters, digits, '.', '_' and '-' only"

# tool, Debian package, Fedora package
need() {
    command -v "$1" >/dev/null 2>&1 || refuse "$1 is missing: install it (Debian: apt-get install $2; Fedora: dnf install $3)"
}
need gpg gnupg gnupg2
need realpath coreutils coreutils

packages=$(realpath -e -- "${positional[0]}" 2>/dev/null) || refuse "no packages directory ${positional[0]}"
[ -d "$packages" ] || refuse "$packages is not a directory"
out=$(realpath -m -- "${positional[1]}")
case $out/ in
    "$packages"/*) refuse "the output directory $out is inside the packages directory $packages" ;;
esac
case $packages/ in
    "$out"/*) refuse "the packages directory $packages is inside the output directory $out (it is replaced)" ;;
esac
shopt -s nullglob
debs=("$packages"/*.deb)
rpms=("$packages"/*.rpm)
shopt -u nullglob
[ ${#debs[@]} -gt 0 ] || [ ${#rpms[@]} -gt 0 ] || refuse "no .deb or .rpm in $packages"
if [ ${#debs[@]} -gt 0 ]; then
    need apt-ftparchive apt-utils "(none: build the apt repository on Debian or Ubuntu)"
    need dpkg-deb dpkg dpkg
    need gzip gzip gzip
    need xz xz-utils xz
fi
if [ ${#rpms[@]} -gt 0 ]; then
    need createrepo_c createrepo-c createrepo_c
    need rpmsign rpm rpm-sign
fi
if [ -e "$out" ]; then
    [ -d "$out" ] || refuse "$out exists and is not a directory"
    if [ ! -e "$out/.gpud-repo" ] && [ -n "$(ls -A "$out")" ]; then
        refuse "$out is not empty and was not made by repo.sh (no $out/.gpud-repo): not replacing it"
    fi
fi

# The key: one secret key, named by its primary key's fingerprint from here on; gpg signs with its
# signing subkey where it has one (the primary key may be kept offline).
listing=$(gpg --batch --with-colons --list-secret-keys -- "$key" 2>/dev/null) \
    || refuse "no secret key '$key' in ${GNUPGHOME:-$HOME/.gnupg} (gpg --list-secret-keys)"
fingerprints=$(awk -F: '$1 == "sec" { primary = 1; next } $1 == "ssb" { primary = 0 } $1 == "fpr" && primary { print $10; primary = 0 }' <<<"$listing")
[ "$(wc -l <<<"$fingerprints")" -eq 1 ] || refuse "'$key' names more than one secret key: give a fingerprint"
fpr=$fingerprints
sign() {  # sign MODE OUTPUT INPUT (MODE: --clearsign or --detach-sign)
    gpg --batch --yes --quiet --local-user "$fpr" --digest-algo SHA512 --armor "$1" --output "$2" "$3"
}
# Fail now, before anything is made, if the key cannot sign without a prompt (expired, passphrase).
probe=$(mktemp)
trap 'rm -f "$probe" "$probe.asc"' EXIT
sign --detach-sign "$probe.asc" "$probe" || refuse "gpg cannot sign with $fpr (expired, revoked, or a passphrase gpg-agent does not hold)"

url=${url:-file://$out}
stage=$(mktemp -d "$(dirname "$out")/.repo.XXXXXX")
trap 'rm -rf "$stage"; rm -f "$probe" "$probe.asc"' EXIT
chmod 0755 "$stage"
touch "$stage/.gpud-repo"
gpg --batch --export-options export-minimal --export "$fpr" >"$stage/gpud.gpg"
gpg --batch --export-options export-minimal --armor --export "$fpr" >"$stage/gpud.asc"

if [ ${#debs[@]} -gt 0 ]; then
    apt=$stage/apt
    archs=()
    for deb in "${debs[@]}"; do
        name=$(dpkg-deb --field "$deb" Package)
        arch=$(dpkg-deb --field "$deb" Architecture)
        [ "$arch" = all ] || archs+=("$arch")
        prefix=${name:0:1}; [[ $name == lib?* ]] && prefix=${name:0:4}
        mkdir -p "$apt/pool/main/$prefix/$name"
        cp -- "$deb" "$apt/pool/main/$prefix/$name/"
    done
    [ ${#archs[@]} -gt 0 ] || archs=(amd64)  # only Architecture: all packages
    mapfile -t archs < <(printf '%s\n' "${archs[@]}" | sort -u)
    dists=$apt/dists/$suite
    for arch in "${archs[@]}"; do
        index=$dists/main/binary-$arch
        mkdir -p "$index"
        # paths relative to apt/ (the Filename: field), the packages of this architecture and of "all"
        (cd "$apt" && apt-ftparchive --arch "$arch" packages pool/main) >"$index/Packages"
        gzip -9nk "$index/Packages"
        xz -k "$index/Packages"
    done
    # Release: its fields, and MD5Sum/SHA1/SHA256/SHA512 of every index (apt needs SHA256 or better;
    # apt-ftparchive's Release has no SHA512 unless asked).
    (cd "$dists" && apt-ftparchive --sha512 \
        -o APT::FTPArchive::Release::Origin=gpud -o APT::FTPArchive::Release::Label=gpud \
        -o APT::FTPArchive::Release::Suite="$suite" -o APT::FTPArchive::Release::Codename="$suite" \
        -o APT::FTPArchive::Release::Architectures="${archs[*]}" \
        -o APT::FTPArchive::Release::Components=main \
        -o APT::FTPArchive::Release::Description="gpud packages" \
        release .) >"$stage/Release"
    mv "$stage/Release" "$dists/Release"
    sign --clearsign "$dists/InRelease" "$dists/Release"
    sign --detach-sign "$dists/Release.gpg" "$dists/Release"
    # arch=: a host with foreign architectures configured (multiarch) asks for no index that is not here
    cat >"$stage/gpud.list" <<EOF
deb [arch=${archs[*]// /,} signed-by=/etc/apt/keyrings/gpud.gpg] $url/apt $suite main
EOF
    cat >"$stage/gpud.sources" <<EOF
Types: deb
URIs: $url/apt
Suites: $suite
Components: main
Architectures: ${archs[*]}
Signed-By: /etc/apt/keyrings/gpud.gpg
EOF
fi

if [ ${#rpms[@]} -gt 0 ]; then
    mkdir -p "$stage/rpm"
    cp -- "${rpms[@]}" "$stage/rpm/"
    # Each package signed in its header, as dnf's gpgcheck=1 checks it (the copies: PACKAGES_DIR stays as it was).
    # %__gpg: Debian's rpm names /usr/bin/gpg2, which Debian does not have.
    # GPG_TTY: rpmsign warns when it is unset and stdin is no terminal; gpg-agent needs none.
    GPG_TTY=${GPG_TTY:-/dev/null} rpmsign --define "__gpg $(command -v gpg)" --define "_gpg_path ${GNUPGHOME:-$HOME/.gnupg}" --define "_gpg_name $fpr" \
        --define "_gpg_digest_algo sha512" --addsign "$stage"/rpm/*.rpm >/dev/null
    createrepo_c --quiet "$stage/rpm"
    sign --detach-sign "$stage/rpm/repodata/repomd.xml.asc" "$stage/rpm/repodata/repomd.xml"
    cat >"$stage/gpud.repo" <<EOF
[gpud]
name=gpud
baseurl=$url/rpm
enabled=1
gpgcheck=1
repo_gpgcheck=1
gpgkey=$url/gpud.asc
EOF
fi

find "$stage" -type d -exec chmod 0755 {} + && find "$stage" -type f -exec chmod 0644 {} +
if [ -e "$out" ]; then
    old=$(mktemp -d "$(dirname "$out")/.repo-old.XXXXXX")
    mv "$out" "$old/"
    mv "$stage" "$out"
    rm -rf "$old"
else
    mv "$stage" "$out"
fi
trap 'rm -f "$probe" "$probe.asc"' EXIT
echo "repo.sh: signed with $fpr: $out"
