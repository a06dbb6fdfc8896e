"""Builds gpud with the kubelet APIs' Python modules (device plugin, PodResources, DRA) generated from their .proto (grpcio-tools,
a build requirement in pyproject.toml): wheels, `pip install -e .` and packaging/build.sh all generate them.
Everything else about the package is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# the kubelet's device plugin API v1beta1, and its PodResources API v1 (which pods hold which devices); its DRA
# plugin services v1 and v1beta1, the plugin watcher's registration API and the DRA resource health service
PROTOS = (Path("gpud/device_plugin/api.proto"), Path("gpud/device_plugin/podresources.proto"),
          Path("gpud/dra/dra_v1.proto"), Path("gpud/dra/dra_v1beta1.proto"),
          Path("gpud/dra/pluginregistration.proto"), Path("gpud/dra/dra_health.proto"))


def generate_grpc_modules() -> None:
    """<name>_pb2.py and <name>_pb2_grpc.py beside each .proto, importable as gpud.device_plugin.api_pb2."""
    from grpc_tools import protoc

    for proto in PROTOS:
        args = ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--grpc_python_out={ROOT}", str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPyWithGrpc(build_py):
    def run(self):
        generate_grpc_modules()  # before the package's files are listed, so the generated ones are among them
        super().run()


setup(cmdclass={"build_py": BuildPyWithGrpc})
