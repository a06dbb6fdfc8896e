"""Builds gpud with the kubelet device plugin API's Python modules generated from its .proto (grpcio-tools,
a build requirement in pyproject.toml): wheels, `pip install -e .` and packaging/build.sh all generate them.
Everything else about the package is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO = Path("gpud/device_plugin/api.proto")


def generate_grpc_modules() -> None:
    """api_pb2.py and api_pb2_grpc.py beside the .proto, importable as gpud.device_plugin.api_pb2."""
    from grpc_tools import protoc

    args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--grpc_python_out={ROOT}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")


class BuildPyWithGrpc(build_py):
    def run(self):
        generate_grpc_modules()  # before the package's files are listed, so the generated ones are among them
        super().run()


setup(cmdclass={"build_py": BuildPyWithGrpc})
