"""`pytest --pure-python`: the suite on the pure-Python builds of gpud's libraries, as the package's pure/
tree runs gpud on a CPython it has no compiled libraries for (packaging/README.md, "Interpreters").

tests/conftest.py calls install() before anything imports gpud or its libraries: an import hook refuses
every compiled (extension) module of the libraries below, whose pure-Python fallbacks then take over, and
the libraries' own switches are set (in the environment, which the gpud processes that tests start
inherit too). grpcio has no pure-Python build: a test module that imports it is skipped (conftest turns
its collection error into a skip); anything else importing it fails, the daemon's code above all.
loaded() says which refused modules got in anyway (conftest fails the session on any)."""

from __future__ import annotations

import importlib.machinery
import os
import sys


# Each library's compiled modules, refused, and its fallback. yaml: PyYAML's libyaml binding (yaml._yaml,
# and the top-level _yaml shim); google: protobuf's upb (google._upb._message, abi3).
LIBRARIES = ("aiohttp", "yarl", "multidict", "frozenlist", "propcache", "yaml", "_yaml", "google")
# The libraries' switches, each read when the library is imported: aiohttp/helpers.py, yarl/_quoting.py,
# multidict/_compat.py, frozenlist/__init__.py, propcache/_helpers.py,
# google/protobuf/internal/api_implementation.py (packaging/launch.py sets the same).
SWITCHES = {"AIOHTTP_NO_EXTENSIONS": "1", "YARL_NO_EXTENSIONS": "1", "MULTIDICT_NO_EXTENSIONS": "1",
            "FROZENLIST_NO_EXTENSIONS": "1", "PROPCACHE_NO_EXTENSIONS": "1",
            "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
ENV = "GPUD_TEST_PURE_PYTHON"  # set by the controlling pytest: its xdist workers install the hook too
GRPC_REFUSED = "grpcio has no pure-Python build (--pure-python)"
GRPC_REASON = "needs grpcio, which has no pure-Python build: the device plugin does not run on the pure tree"


class RefuseCompiled:
    """A meta path finder ahead of the others: a compiled module of LIBRARIES is not found; grpc skips."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top == "grpc":  # a test module importing it is skipped (conftest); gpud's own code must not
            raise ModuleNotFoundError(f"{fullname}: {GRPC_REFUSED}", name=fullname)
        if top not in LIBRARIES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            raise ModuleNotFoundError(f"{fullname}: compiled module refused (--pure-python)", name=fullname)
        return None


def install() -> None:
    early = loaded()
    assert not early, f"--pure-python: compiled modules imported before the hook: {early}"
    os.environ.update(SWITCHES)
    os.environ[ENV] = "1"
    if not any(isinstance(finder, RefuseCompiled) for finder in sys.meta_path):
        sys.meta_path.insert(0, RefuseCompiled())


def loaded() -> list[str]:
    """The compiled modules of LIBRARIES in this process, and grpc if it got in."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(name for name, module in list(sys.modules.items())
                  if name.partition(".")[0] == "grpc"
                  or (name.partition(".")[0] in LIBRARIES
                      and str(getattr(module, "__file__", None) or "").endswith(suffixes)))


def active() -> bool:
    """Whether this test run is --pure-python (the controlling pytest and its workers alike)."""
    return os.environ.get(ENV) == "1"


# Where aiohttp's Python parser (the pure tree's) answers garbage otherwise than its compiled one
# (llhttp): it waits for the end of a line that never comes (1 KiB of NUL bytes) until gpud's idle
# timeout closes the connection, where llhttp answers 400 at once. gpud stays up; packaging/README.md,
# "Interpreters", says so.
LAX_PARSER_GARBAGE = (b"\x00" * 1024,)
