"""The streamed answer's HTTP response: server-sent events whose first chunk leaves with the headers."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStream(StreamingResponse):
    """``text/event-stream``: ``first`` (ready before the answer starts), then ``rest`` as it comes.

    Starlette's StreamingResponse sends the headers, starts a task group (the body, and a watcher that
    cancels it when the client goes away) and only then asks the body for its first chunk. On a loaded
    host the headers wake the client while the task group's start and the first chunk's work still
    lie ahead: the first token's text arrives a fraction of a millisecond later than it could. Here the
    headers and the first chunk go back to back; the rest streams exactly as StreamingResponse streams
    it, cancelled when the client goes away.
    """

    def __init__(self, first: bytes, rest: AsyncGenerator[bytes, None]) -> None:
        super().__init__(rest, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.first = first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        # Even when empty: the headers then still go out now (http11 holds them until the next write).
        await send({"type": "http.response.body", "body": self.first, "more_body": True})
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Cancelled while sending, the body is left at a yield: closing it runs its cleanup (the
            # backend stream's cancel) now rather than whenever it is collected.
            await self.body_iterator.aclose()

    async def stream_response(self, send: Send) -> None:
        # As StreamingResponse's, less the headers: __call__ has sent them.
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
