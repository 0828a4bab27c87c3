"""Picks the transport for a protocol.

Kept apart from stoker.bench.transport, which every implementation imports: the base must not import them back.
Each implementation is imported on demand: an HTTP or OpenAI run never loads grpc and tritonclient, a gRPC run
never loads aiohttp.
"""

from __future__ import annotations

from .errors import InvalidBenchmarkConfig
from .transport import Transport, TransportSpec


def open_transport(spec: TransportSpec) -> Transport:
    if spec.protocol == "grpc":
        from .grpc_transport import GrpcTransport

        return GrpcTransport(spec)
    if spec.protocol == "http":
        from .http_transport import HttpTransport

        return HttpTransport(spec)
    if spec.protocol == "openai":
        from .openai_transport import OpenAiTransport

        return OpenAiTransport(spec)
    raise InvalidBenchmarkConfig(f"unknown protocol {spec.protocol!r}: use grpc, http or openai")
