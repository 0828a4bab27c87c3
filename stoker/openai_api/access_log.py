"""The OpenAI service's access log: one line per request (method, path, status, milliseconds), to the service's log
(the container's, rotated by Docker: engine.LOG_CONFIG). Never a body, a query string or a header: a request's
authorization (an API key) and its prompt stay out of the log.

An ASGI wrapper rather than uvicorn's access log: the milliseconds count until the last byte of a streamed answer,
and the status is the one the client got.
"""

from __future__ import annotations

import logging
import time

LOG = logging.getLogger("stoker_openai.access")


class AccessLog:
    """Wraps an ASGI app; logs each HTTP request once it is answered (or broken off)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def sending(message) -> None:
            if message.get("type") == "http.response.start":
                status[0] = int(message.get("status", 0))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            # 0: the app raised before answering (the server then answers 500 on its own, or the client left).
            LOG.info("%s %s %s %.0f ms", scope.get("method", "-"), scope.get("path", "-"), status[0] or "-",
                     (time.perf_counter() - t0) * 1000)
