"""Builds rollfleet's Python SDK, generating its gRPC stubs from the repository's proto.

The stubs (``rollfleet/v1/rollfleet_pb2.py``, its ``.pyi`` and ``rollfleet_pb2_grpc.py``) are
not checked in: the ``build_py`` step runs grpcio-tools' protoc on
``../proto/rollfleet/v1/rollfleet.proto`` (or ``$ROLLFLEET_PROTO_ROOT/rollfleet/v1/rollfleet.proto``)
and writes them into ``src/``, so that ``pip install python/`` and ``pip install -e python/`` both
see them. The runtime requirements follow the generator: the stubs need a grpcio at least as new
as the grpcio-tools that wrote them, and a protobuf at least as new as the one it came with.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
PROTO = Path("rollfleet") / "v1" / "rollfleet.proto"
OUT = HERE / "src"
GENERATED = OUT / "rollfleet" / "v1" / "rollfleet_pb2.py"


def proto_root() -> Path:
    """Where the ``rollfleet/v1/rollfleet.proto`` tree is: the repository's ``proto/``."""
    return Path(os.environ.get("ROLLFLEET_PROTO_ROOT", HERE.parent / "proto"))


def generate_stubs() -> None:
    """Runs protoc (from grpcio-tools) on the proto, writing the stubs under ``src/``."""
    root = proto_root()
    proto = root / PROTO
    if not proto.is_file():
        if GENERATED.is_file():
            # A source tree that carries its stubs already (an sdist).
            return
        raise SystemExit(
            f"rollfleet: cannot generate the gRPC stubs: {proto} does not exist; build the "
            "package from the rollfleet repository (pip install python/), or point "
            "ROLLFLEET_PROTO_ROOT at the directory holding rollfleet/v1/rollfleet.proto"
        )
    try:
        from grpc_tools import protoc
    except ImportError as e:
        raise SystemExit(
            "rollfleet: generating the gRPC stubs needs grpcio-tools (a build requirement: "
            f"pip installs it unless --no-build-isolation is given): {e}"
        ) from e
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"--proto_path={root}",
        f"--proto_path={well_known}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        str(proto),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"rollfleet: protoc failed on {proto} (its messages are above)")


def requirements() -> list[str]:
    """grpcio and protobuf, no older than what the stubs are generated for."""

    def installed(package: str, default: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return default

    # rollfleet_pb2_grpc.py refuses a grpcio older than the grpcio-tools that wrote it, and
    # rollfleet_pb2.py a protobuf runtime older than its generator's.
    return [
        f"grpcio>={installed('grpcio-tools', '1.60.0')}",
        f"protobuf>={installed('protobuf', '4.25.0')}",
    ]


class BuildPyWithStubs(build_py):
    """``build_py`` that generates the gRPC stubs first."""

    def run(self) -> None:
        generate_stubs()
        super().run()


setup(
    install_requires=requirements(),
    cmdclass={"build_py": BuildPyWithStubs},
)
