"""The first token's path out of the OpenAI service: a streamed answer's headers leave in one write with
its first chunk (stoker/openai_api/http11.py), and that chunk is ready before the headers go (sse.py)."""

from __future__ import annotations

import asyncio

import h11

from stoker.openai_api import triton_stream
from stoker.openai_api.generation import Generating
from stoker.openai_api.http11 import _HeadersWithFirstChunk
from stoker.openai_api.sse import EventStream


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str):
        return f"info:{name}"


def _response(headers: list[tuple[bytes, bytes]]) -> tuple[h11.Connection, bytes]:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    conn.next_event(), conn.next_event()
    return conn, conn.send(h11.Response(status_code=200, headers=headers))


def test_a_chunked_answers_headers_wait_for_its_first_chunk_and_leave_in_one_write():
    real = _Transport()
    t = _HeadersWithFirstChunk(real)
    conn, head = _response([(b"content-type", b"text/event-stream")])
    t.write(head)
    assert real.writes == []
    first = conn.send(h11.Data(data=b"data: 1\n\n"))
    t.write(first)
    t.write(conn.send(h11.Data(data=b"data: 2\n\n")))
    assert real.writes == [head + first, b"9\r\ndata: 2\n\n\r\n"]
    assert t.get_extra_info("peername") == "info:peername"  # the rest is the real transport's


def test_fixed_length_answers_are_written_as_they_come_and_close_flushes_held_headers():
    real = _Transport()
    t = _HeadersWithFirstChunk(real)
    _conn, head = _response([(b"content-length", b"2")])
    t.write(head)
    t.write(b"{}")
    assert real.writes == [head, b"{}"]
    _conn, chunked = _response([(b"content-type", b"text/event-stream")])
    t.write(chunked)
    t.close()
    assert real.writes[-1] == chunked and real.closed


class _Decoder:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _generating(first: triton_stream.Step) -> Generating:
    g = Generating.__new__(Generating)
    g.gen = triton_stream.Generation((1, 2), 4, True, 1.0, 1.0, 0, ())
    g.text = triton_stream.TextStream(_Decoder().decode)
    g.completion_tokens, g.finish, g._call, g._step = 0, None, None, first
    return g


def test_the_first_responses_text_is_ready_without_waiting_and_a_final_one_ends_it():
    g = _generating(triton_stream.Step((0, 1), False))
    assert g.ready() == ["a", "b"] and g.finish is None and g.completion_tokens == 2
    assert g.ready() == []  # nothing more read yet
    done = _generating(triton_stream.Step((2,), True))
    assert done.ready() == ["c"] and done.finish == "stop"


def test_the_event_stream_sends_headers_then_the_first_chunk_then_the_rest():
    async def rest():
        yield b"data: 2\n\n"

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    asyncio.run(EventStream(b"data: 1\n\n", rest())({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
    assert [s["type"] for s in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [s["body"] for s in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [s["more_body"] for s in sent[1:]] == [True, True, False]
