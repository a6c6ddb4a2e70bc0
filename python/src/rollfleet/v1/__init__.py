"""The generated messages of the ``rollfleet.v1`` gRPC contract.

``rollfleet_pb2`` (messages, with a ``.pyi`` for type checkers) and ``rollfleet_pb2_grpc``
(grpcio's stubs) are generated from ``proto/rollfleet/v1/rollfleet.proto`` when the package is
built (``setup.py``); they are not checked in. The SDK's own clients (``rollfleet.Trainer``,
``rollfleet.JobClient``) use the messages only, and call the services by the method names the
proto's descriptors give.
"""

try:
    from rollfleet.v1 import rollfleet_pb2 as rollfleet_pb2
except ModuleNotFoundError as e:  # pragma: no cover - only on a tree that was never built
    if e.name != "rollfleet.v1.rollfleet_pb2":
        raise
    raise ModuleNotFoundError(
        "rollfleet's gRPC stubs have not been generated: install the package with pip "
        "(pip install -e python/ from the repository), which generates them from "
        "proto/rollfleet/v1/rollfleet.proto",
        name=e.name,
    ) from e

__all__ = ["rollfleet_pb2"]
