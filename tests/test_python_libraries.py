"""gpud/python_libraries.py: what gpud says of the builds of its libraries, and the device plugin's refusal
on a Python without grpcio (the package's pure tree: packaging/README.md, "Interpreters")."""

from __future__ import annotations

import os
import sys

import aiohttp.web  # noqa: F401  (what the daemon imports: the libraries described)

from gpud import cli, python_libraries
from pure_python import ENV


def test_describe_says_whether_the_libraries_run_compiled_or_pure():
    said = python_libraries.describe()
    pure = os.environ.get(ENV) == "1"  # pytest --pure-python
    assert said["libraries"] == ("pure" if pure else "compiled"), said
    assert said["pure"] == (sorted(python_libraries.ACCELERATED) if pure else []), said
    assert said["version"].startswith("%d.%d." % sys.version_info[:2]) and said["implementation"] == "cpython"


def test_the_device_plugin_without_grpc_says_why_and_exits_127(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "grpc", None)  # `import grpc` raises ImportError, as on the pure tree
    assert cli.main(["device-plugin", "--kubelet-dir", str(tmp_path / "none")]) == 127
    said = capsys.readouterr()
    assert said.out == "" and "device-plugin needs grpcio" in said.err and "pip install grpcio" in said.err
    # from the package: which versions have it compiled, and how to run the plugin with one of them
    for tree in ("common", "cp310", "cp311", "cp312", "cp313", "pure"):
        (tmp_path / tree).mkdir()
    monkeypatch.setattr(python_libraries, "package_tree", lambda: tmp_path)
    assert cli.main(["device-plugin", "--kubelet-dir", str(tmp_path / "none")]) == 127
    err = capsys.readouterr().err
    assert "compiled for CPython 3.10, 3.11, 3.12, 3.13 " in err and f"{tmp_path}/pure" in err, err
    assert "GPUD_PYTHON=python3.13 gpud device-plugin" in err and "Environment=GPUD_PYTHON=python3.13" in err, err
