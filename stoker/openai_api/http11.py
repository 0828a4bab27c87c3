"""uvicorn's HTTP/1.1 protocol (h11), with a streamed answer's headers written together with its first chunk.

Through ASGI a streamed response's status line and headers are one message and its first chunk
another, and uvicorn writes each to the socket at once: two writes, two wake-ups of the client. On
a loaded host (the backend generating the next token on one core) the client, woken by the headers
alone, takes the service's core while it parses them, and the first token's text waits behind it;
the profile showed that write alone at 0.4-0.8 ms of the first token's latency. Holding the header
block of a chunked (streamed) response until the next write sends both in one. Nothing else changes:
fixed-length answers, and every later chunk, are written as uvicorn writes them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_STATUS_LINE = b"HTTP/1.1 "
_CHUNKED = b"\r\ntransfer-encoding: chunked\r\n"


class _HeadersWithFirstChunk:
    """A transport that holds a chunked response's header block until the next write (or close)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held = b""

    def write(self, data: bytes) -> None:
        if self._held:
            data, self._held = self._held + data, b""
        elif data.startswith(_STATUS_LINE) and data.endswith(b"\r\n\r\n") and _CHUNKED in data.lower():
            # h11 writes a response's headers as one block; a chunked one's body follows at once.
            self._held = data
            return
        self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def _flush(self) -> None:
        if self._held:
            data, self._held = self._held, b""
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:  # everything else is the socket transport's
        return getattr(self._transport, name)


class H11HeadersWithFirstChunk(H11Protocol):
    """uvicorn's h11 protocol writing through ``_HeadersWithFirstChunk``: ``uvicorn.run(app, http=this)``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeadersWithFirstChunk(transport))  # type: ignore[arg-type]
