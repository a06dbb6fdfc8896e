"""Which builds of its libraries this gpud runs on, and what cannot run without the compiled ones.

The package carries compiled builds of aiohttp, yarl, multidict, frozenlist and propcache for each
CPython it was built for (/usr/lib/gpud/cp3XY/), and pure-Python builds of the same libraries
(/usr/lib/gpud/pure/) for any other CPython 3.10 or newer: /usr/lib/gpud/launch.py picks one
(packaging/README.md, "Interpreters"). gpud says which at start (the `python_libraries` log line) and
in GET /v1/node. grpcio has no pure-Python build: the device plugin cannot run on the pure tree.
Standard library only."""

from __future__ import annotations

import importlib.machinery
import os
import platform
import sys
from pathlib import Path

# The libraries with compiled modules that gpud's daemon imports (through aiohttp), each with a
# pure-Python fallback of its own.
ACCELERATED = ("aiohttp", "yarl", "multidict", "frozenlist", "propcache")
# Exit code of a command that this interpreter cannot run with the libraries it has (also the launcher's
# when it finds no Python 3.10 or newer, and launch.py's when the package has no tree for this one).
EXIT_NO_LIBRARIES = 127


def compiled_modules(libraries: tuple[str, ...] = ACCELERATED) -> list[str]:
    """The compiled (extension) modules of `libraries` loaded in this process."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    return sorted(name for name, module in list(sys.modules.items())
                  if name.partition(".")[0] in libraries
                  and str(getattr(module, "__file__", None) or "").endswith(suffixes))


def describe() -> dict:
    """What the `python_libraries` log line and /v1/node say: the interpreter, and whether the libraries
    run compiled or pure Python (measured on the modules loaded, after aiohttp is imported)."""
    loaded = [name for name in ACCELERATED if name in sys.modules]
    compiled = {name.partition(".")[0] for name in compiled_modules()}
    mode = "compiled" if compiled and compiled >= set(loaded) else "pure" if not compiled else "mixed"
    aiohttp = sys.modules.get("aiohttp")
    where = os.path.dirname(os.path.dirname(aiohttp.__file__)) if aiohttp and aiohttp.__file__ else None
    return {"version": platform.python_version(), "implementation": sys.implementation.name,
            "libraries": mode, "libraries_path": where,
            "pure": sorted(set(loaded) - compiled)}


def package_tree() -> Path | None:
    """/usr/lib/gpud when this gpud runs from the package (gpud itself is in its common/), else None."""
    top = Path(os.path.abspath(__file__)).parents[1]  # as on sys.path: the tree launch.py chose
    return top.parent if top.name == "common" and (top.parent / "launch.py").is_file() else None


def compiled_versions(tree: Path) -> list[str]:
    """The CPython versions the package at `tree` has compiled libraries for: cp310 -> 3.10."""
    tags = (entry.name[2:] for entry in tree.iterdir() if entry.name.startswith("cp3") and entry.name[2:].isdigit())
    return [f"{tag[0]}.{tag[1:]}" for tag in sorted(tags, key=int)]


def grpc_missing_message(command: str, error: BaseException) -> str:
    """Why `command` (the device plugin: grpcio has no pure-Python build) cannot run here, and what to do."""
    tree = package_tree()
    if tree is None:  # a checkout or a venv: grpcio is simply not installed for this interpreter
        return (f"gpud: {command} needs grpcio, which this Python {platform.python_version()} cannot import "
                f"({error}): install it (pip install grpcio)")
    versions = compiled_versions(tree)
    newest = versions[-1] if versions else "3.13"
    return (f"gpud: {command} needs grpcio, which has no pure-Python build. This package has it compiled for "
            f"CPython {', '.join(versions) or 'none'} ({tree}/cp3XY); this is Python {platform.python_version()}, "
            f"which runs gpud on the pure-Python libraries of {tree}/pure. Install one of those versions (e.g. "
            f"python{newest}) and run the command with it: GPUD_PYTHON=python{newest} gpud {command} (for the "
            f"systemd unit: `systemctl edit gpud-device-plugin`, then [Service] Environment=GPUD_PYTHON="
            f"python{newest}).")
