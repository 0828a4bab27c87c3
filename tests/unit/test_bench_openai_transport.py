"""stoker bench's OpenAI transport on canned SSE bodies with a fake clock: what is timed, counted and refused."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from stoker.bench.openai_transport import base_url, read_stream, request_body, take_body
from stoker.bench.transport import Exchange, TransportSpec
from stoker.bench.transports import open_transport


def _chunk(text: str, finish: str | None = None) -> bytes:
    obj = {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": text, "index": 0, "finish_reason": finish}],
           "usage": None}
    return b"data: " + json.dumps(obj).encode() + b"\n"


USAGE = b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n'
DONE = b"data: [DONE]\n"


def _read(lines: list[bytes]) -> Exchange:
    """Each line is read at the next whole second of a fake clock (the first at 1.0)."""
    clock = itertools.count(1.0)

    async def body():
        for line in lines:
            yield line

    ex = Exchange(start_s=0.0)
    asyncio.run(read_stream(body(), ex, clock=lambda: next(clock)))
    return ex


def _sse(*events: bytes) -> list[bytes]:
    return [line for e in events for line in (e, b"\n")]  # each event, then its blank separator


def test_stream_timing_text_and_usage():
    ex = _read(_sse(_chunk(""), _chunk(" one"), _chunk(" two"), _chunk(" three"), _chunk("", "length"), USAGE, DONE))
    assert ex.error is None and ex.text == b" one two three"
    # Responses: every chunk carrying a choice (the empty first one too); the closing chunk, usage and [DONE]
    # are trailers, so e2e ends at the last text, as on Triton's routes.
    assert ex.times == [1.0, 2.0, 3.0, 4.0] and ex.first_s == 2.0 and ex.end_s == 4.0
    assert ex.chunks == 3 and ex.reported_tokens == 3


def test_finish_reason_on_a_text_chunk_is_a_response():
    ex = _read(_sse(_chunk(" a"), _chunk(" b", "stop"), DONE))  # vLLM puts finish_reason on the last text
    assert ex.times == [1.0, 2.0] and ex.text == b" a b" and ex.reported_tokens is None


def test_error_event_inside_the_stream_ends_the_request():
    err = b'data: {"error":{"message":"the model backend failed:\\n boom","type":"server_error"}}\n'
    ex = _read(_sse(_chunk(" a"), err, _chunk(" never")))
    assert ex.error == "the model backend failed: boom" and ex.failed_s == 2.0 and ex.end_s == 2.0
    assert ex.text == b" a"


def test_stream_without_any_chunk_is_an_error():
    ex = _read([b": keep-alive\n", b"\n"])
    assert ex.error == "the stream ended without a completion chunk"


def test_whole_bodies():
    ok = Exchange(start_s=0.0)
    take_body(ok, 200, json.dumps({"choices": [{"text": " hi there", "finish_reason": "length"}],
                                   "usage": {"completion_tokens": 2}}).encode(), 5.0)
    assert (ok.text, ok.first_s, ok.end_s, ok.chunks, ok.reported_tokens) == (b" hi there", 5.0, 5.0, 1, 2)
    refused = Exchange(start_s=0.0)
    take_body(refused, 404, b'{"error":{"message":"The model `x` does not exist.","code":"model_not_found"}}', 1.0)
    assert refused.error == "HTTP 404: The model `x` does not exist." and refused.end_s == 1.0
    garbage = Exchange(start_s=0.0)
    take_body(garbage, 502, b"<html>Bad Gateway</html>", 1.0)
    assert garbage.error == "HTTP 502: <html>Bad Gateway</html>"


def test_request_body():
    spec = TransportSpec("openai", "http://h:1/v1", "tiny", extra_inputs={"temperature": 0}, min_tokens=True)
    assert request_body(spec, "hello", 8) == {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0,
                                              "min_tokens": 8, "stream": True,
                                              "stream_options": {"include_usage": True}}
    unary = TransportSpec("openai", "http://h:1/v1", "tiny", streaming=False)
    assert request_body(unary, "hello", 4) == {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": False}


@pytest.mark.parametrize("url, base", [
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
    ("127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
    ("https://api.example/openai/v1", "https://api.example/openai/v1"),
])
def test_base_url(url, base):
    assert base_url(url) == base


def test_open_transport_and_cli_protocol():
    from stoker.commands.bench import _protocol_of

    assert type(open_transport(TransportSpec("openai", "http://h:1/v1", "tiny"))).__name__ == "OpenAiTransport"
    assert _protocol_of("http://h:1/v1") == "openai" and _protocol_of("http://h:1") == "http"
    assert _protocol_of("h:8001") == "grpc"


def test_a_response_format_goes_with_every_request_and_only_over_openai():
    from stoker.bench.client import BenchConfig, validate
    from stoker.bench.errors import InvalidBenchmarkConfig
    from stoker.bench.session import Level
    from stoker.bench.workload import Prompt

    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": True}}
    config = BenchConfig(url="http://h/v1", model="m", levels=[Level(concurrency=1)], max_tokens=8,
                         protocol="openai", response_format=fmt)
    body = request_body(config.transport_spec(), "hi", 8)
    assert body["response_format"] == fmt and body["prompt"] == "hi"
    assert "response_format" not in request_body(TransportSpec(protocol="openai", url="u", model="m"), "hi", 8)
    validate(config, [Prompt("hi", 1)])
    from dataclasses import replace

    with pytest.raises(InvalidBenchmarkConfig, match="use --protocol openai"):
        validate(replace(config, protocol="grpc"), [Prompt("hi", 1)])


def test_the_constraints_cost_line_per_level():
    from stoker.bench.output import cost_lines

    level = {"mode": "concurrency", "concurrency": 4, "output_tokens_per_s": 90.0, "ttft_ms": {"p50": 30.0}}
    free = {**level, "output_tokens_per_s": 100.0, "ttft_ms": {"p50": 25.0}}
    assert cost_lines({"levels": [level]}, {"levels": [free]}) == [
        "concurrency 4: constrained 0.900x the free output tok/s (90.0 vs 100.0); TTFT p50 30.0 ms vs 25.0 ms"]
