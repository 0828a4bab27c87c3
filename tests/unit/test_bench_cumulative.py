"""stoker bench's HTTP and gRPC transports on the LLM API's cumulative stream (each response the whole output so
far), with the endpoint replaced by canned responses: the recorded text is the model's final output, never the
responses joined or a revised part repeated, and only responses that add text count as chunks."""

from __future__ import annotations

import asyncio
import json

from tritonclient.grpc import service_pb2

from stoker.bench.grpc_transport import GrpcTransport
from stoker.bench.http_transport import HttpTransport
from stoker.bench.transport import TransportSpec
from stoker.protocol import ENSEMBLE, LLMAPI

# What the llmapi model streams: a character completed by the next token (U+FFFD until then), and a stop string
# streamed in part, then cut from the final output (as the stand-in's model does).
COMPLETED = ["caf\ufffd", "café", "café au lait"]
WITHDRAWN = ["alpha", "alpha g", "alpha ga", "alpha "]
INPUTS = {"text_input": ("BYTES", (1,)), "streaming": ("BOOL", (1,)), "sampling_param_max_tokens": ("INT32", (1,)),
          "sampling_param_exclude_input_from_output": ("BOOL", (1,)), "return_finish_reason": ("BOOL", (1,))}


class _Body:
    def __init__(self, lines: list[bytes]) -> None:
        self.status, self._lines = 200, lines

    @property
    def content(self):
        async def lines():
            for line in self._lines:
                yield line

        return lines()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class _Session:
    """aiohttp's session, answering every POST with the SSE lines given."""

    def __init__(self, texts: list[str]) -> None:
        self.lines = [line for t in texts for line in (b"data: " + json.dumps({"text_output": t}).encode() + b"\n",
                                                       b"\n")]

    def post(self, url, json):
        return _Body(self.lines)

    async def close(self):
        pass


def _http(texts: list[str], interface=LLMAPI):
    async def run():
        t = HttpTransport(TransportSpec(protocol="http", url="127.0.0.1:1", model=interface.model,
                                        interface=interface, inputs=INPUTS))
        t.session = _Session(texts)
        return await t.send("hi", 8, "r1", timeout_s=5)

    return asyncio.run(run())


def test_http_records_the_final_output_of_a_cumulative_stream():
    # Before the rule, a response that did not extend the text received was appended whole.
    ex = _http(COMPLETED)
    assert ex.error is None and ex.text.decode() == "café au lait"
    assert ex.chunks == 3 and len(ex.times) == 3 and ex.first_s == ex.times[0]
    ex = _http(WITHDRAWN)
    assert ex.text.decode() == "alpha "  # the model's answer, not "alpha gaalpha "
    assert ex.chunks == 3  # the last response added nothing
    assert _http(["tok0 ", "tok1 "], ENSEMBLE).text == b"tok0 tok1 "


class _Result:
    def __init__(self, text: str) -> None:
        self._response = service_pb2.ModelInferResponse()
        self._response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        raw = text.encode()
        self._response.raw_output_contents.append(len(raw).to_bytes(4, "little") + raw)

    def get_response(self):
        return self._response


class _Stream:
    def __init__(self, texts: list[str]) -> None:
        self._texts = texts

    def __aiter__(self):
        async def results():
            for t in self._texts:
                yield _Result(t), None

        return results()

    def cancel(self):
        pass


class _Client:
    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def stream_infer(self, requests, headers=None):
        return _Stream(self.texts)

    async def close(self):
        pass


def _grpc(texts: list[str], interface=LLMAPI):
    async def run():
        t = GrpcTransport(TransportSpec(protocol="grpc", url="127.0.0.1:1", model=interface.model,
                                        interface=interface, inputs=INPUTS))
        await t.client.close()
        t.client = _Client(texts)
        return await t.send("hi", 8, "r1", timeout_s=5)

    return asyncio.run(run())


def test_grpc_records_the_final_output_of_a_cumulative_stream():
    ex = _grpc(COMPLETED)
    assert ex.error is None and ex.text.decode() == "café au lait" and ex.chunks == 3
    ex = _grpc(WITHDRAWN)
    assert ex.text.decode() == "alpha " and ex.chunks == 3
    # a character completed only by the end: its response counts once the stream ends
    ex = _grpc(["x", "x\ufffd"])
    assert ex.text.decode() == "x\ufffd" and ex.chunks == 2
