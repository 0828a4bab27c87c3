"""gRPC transport: one `stream_infer` call per request (tritonclient.grpc.aio).

Each request is its own bidirectional stream, so a stream's end is that request's end, and a slow or
failed request never holds up another. Responses are read from the raw protobuf bytes rather than
through numpy, which keeps the client's cost per response low.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from .errors import EndpointUnreachable, ModelUnavailable
from .transport import (
    PREFLIGHT_TIMEOUT_S,
    TEXT_OUTPUT,
    Exchange,
    TransportSpec,
    auth_headers,
    check_interface,
    one_line,
    why_not_ready,
)

_NUMPY_TYPES = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


def grpc_target(url: str) -> str:
    """tritonclient wants host:port; accept grpc:// URLs too."""
    return url.removeprefix("grpc://")


def describe_exception(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return one_line(f"{exc.code().name}: {exc.details()}")
    if isinstance(exc, InferenceServerException):
        return one_line(exc.message() or str(exc))
    return one_line(f"{type(exc).__name__}: {exc}")


def _bytes_tensor(raw: bytes) -> bytes:
    """Concatenated elements of a serialized BYTES tensor (each: 4-byte little-endian length, then data)."""
    out, i = [], 0
    while i + 4 <= len(raw):
        (n,) = struct.unpack_from("<I", raw, i)
        out.append(raw[i + 4 : i + 4 + n])
        i += 4 + n
    return b"".join(out)


def _text_bytes(result: Any) -> bytes:
    """The response's text_output as raw bytes; joined before decoding, as a token may split a character."""
    response = result.get_response()
    for index, output in enumerate(response.outputs):
        if output.name == TEXT_OUTPUT:
            if index < len(response.raw_output_contents):
                return _bytes_tensor(response.raw_output_contents[index])
            array = result.as_numpy(TEXT_OUTPUT)  # a server that used typed contents instead of raw
            return b"" if array is None else b"".join(
                v if isinstance(v, bytes) else str(v).encode() for v in array.ravel()
            )
    return b""


def _take(ex: Exchange, piece: bytes, now: float) -> None:
    """Count a response that added text (a chunk); the first one is the first token's time."""
    if piece:
        ex.chunks += 1
        if ex.first_s is None:
            ex.first_s = now


class GrpcTransport:
    def __init__(self, spec: TransportSpec) -> None:
        self.spec = spec
        self.client = InferenceServerClient(grpc_target(spec.url))

    async def preflight(self) -> TransportSpec:
        client, url, model = self.client, self.spec.url, self.spec.model
        try:
            live = await client.is_server_live(client_timeout=PREFLIGHT_TIMEOUT_S, headers=auth_headers() or None)
        except InferenceServerException as exc:
            raise EndpointUnreachable(f"Triton at {url} is unreachable: {describe_exception(exc)}") from None
        if not live:
            raise EndpointUnreachable(f"Triton at {url} answers but is not live")
        try:
            ready = await client.is_model_ready(model, client_timeout=PREFLIGHT_TIMEOUT_S,
                                                headers=auth_headers() or None)
        except InferenceServerException:
            ready = False
        if not ready:
            try:
                index = await client.get_model_repository_index(as_json=True, client_timeout=PREFLIGHT_TIMEOUT_S,
                                                                headers=auth_headers() or None)
            except InferenceServerException as exc:
                raise ModelUnavailable(f"model '{model}' is not ready at {url} ({describe_exception(exc)})") from None
            raise ModelUnavailable(why_not_ready(index, url, model))
        try:
            meta = await client.get_model_metadata(model, as_json=True, client_timeout=PREFLIGHT_TIMEOUT_S,
                                                  headers=auth_headers() or None)
        except InferenceServerException as exc:
            raise ModelUnavailable(f"model '{model}' metadata unavailable: {describe_exception(exc)}") from None
        self.spec = check_interface(self.spec, meta)
        return self.spec

    async def connect(self) -> None:
        await self.client.is_server_live(client_timeout=PREFLIGHT_TIMEOUT_S, headers=auth_headers() or None)

    def _inputs(self, text: str, max_tokens: int) -> list[InferInput]:
        tensors = []
        for name, value in self.spec.request_values(text, max_tokens).items():
            datatype, shape = self.spec.inputs[name]
            tensor = InferInput(name, list(shape), datatype)
            if datatype == "BYTES":
                tensor.set_data_from_numpy(np.full(shape, value.encode("utf-8"), dtype=object))
            else:
                tensor.set_data_from_numpy(np.full(shape, value, dtype=_NUMPY_TYPES[datatype]))
            tensors.append(tensor)
        return tensors

    async def send(self, text: str, max_tokens: int, request_id: str, timeout_s: float) -> Exchange:
        ex = Exchange(start_s=time.perf_counter())
        answer = self.spec.interface.answer()  # each response's new part, however the layout streams
        finished = False
        stream = None
        try:
            request = {
                "model_name": self.spec.model,
                "inputs": self._inputs(text, max_tokens),
                "outputs": [InferRequestedOutput(TEXT_OUTPUT)],
                "request_id": request_id,
            }

            async def request_stream() -> AsyncIterator[dict[str, Any]]:
                # Stamped as late as we can: gRPC serializes and writes the request right after this yield.
                ex.start_s = time.perf_counter()
                yield request

            async with asyncio.timeout(timeout_s):
                stream = self.client.stream_infer(request_stream(), headers=auth_headers() or None)
                async for result, err in stream:
                    now = time.perf_counter()
                    if err is not None:
                        ex.error, ex.failed_s = describe_exception(err), now
                        break
                    ex.times.append(now)
                    _take(ex, answer.add(_text_bytes(result)), now)
                else:
                    finished = True
                    _take(ex, answer.end(), ex.times[-1] if ex.times else time.perf_counter())
        except TimeoutError:
            ex.error, ex.failed_s = f"timed out after {timeout_s:g} s", time.perf_counter()
        except Exception as exc:  # noqa: BLE001 -- one request's failure must not stop the level
            ex.error, ex.failed_s = describe_exception(exc), time.perf_counter()
        finally:
            if stream is not None and not finished:
                stream.cancel()  # frees the server slot of an abandoned request
        # The answer as the model last stood by it: a cumulative stream's revisions applied, not repeated.
        ex.text = answer.text
        return ex

    async def close(self) -> None:
        await self.client.close()
