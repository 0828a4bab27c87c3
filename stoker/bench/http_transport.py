"""HTTP transport: Triton's generate extension, `generate_stream` (server-sent events) or `generate`.

Triton answers HTTP 200 and puts the failure in the body in two cases that matter here: an error
event inside an SSE stream, and `/generate` on a model that sends more than one response. Every
event and body is therefore checked for an "error" key; the status code alone proves nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from ..protocol import StreamedAnswer
from .errors import EndpointUnreachable, ModelUnavailable
from .transport import (
    PREFLIGHT_TIMEOUT_S,
    Exchange,
    TransportSpec,
    auth_headers,
    check_interface,
    one_line,
    why_not_ready,
)


def _base(url: str) -> str:
    return url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"


def _body_error(obj: Any) -> str | None:
    if isinstance(obj, dict) and "error" in obj:
        return one_line(obj["error"])
    return None


def _take(ex: Exchange, piece: bytes, now: float) -> None:
    """Count a response that added text (a chunk); the first one is the first token's time."""
    if piece:
        ex.chunks += 1
        if ex.first_s is None:
            ex.first_s = now


class HttpTransport:
    def __init__(self, spec: TransportSpec) -> None:
        self.spec = spec
        self.base = _base(spec.url)
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            # No connection cap: the load generator, not aiohttp's pool, decides what is in flight.
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                                 headers=auth_headers())
        return self.session

    async def _get(self, path: str, method: str = "GET") -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=PREFLIGHT_TIMEOUT_S)
        async with self._session().request(method, f"{self.base}{path}", timeout=timeout) as r:
            raw = await r.read()
        try:
            return r.status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return r.status, raw.decode(errors="replace")

    async def preflight(self) -> TransportSpec:
        url, model = self.base, self.spec.model
        try:
            status, _ = await self._get("/v2/health/live")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EndpointUnreachable(f"Triton at {url} is unreachable: {one_line(f'{type(exc).__name__}: {exc}')}") from None
        if status != 200:
            raise EndpointUnreachable(f"Triton at {url} answers but is not live (HTTP {status})")
        status, _ = await self._get(f"/v2/models/{model}/ready")
        if status != 200:
            status, index = await self._get("/v2/repository/index", method="POST")
            if status != 200:
                raise ModelUnavailable(f"model '{model}' is not ready at {url} (HTTP {status})")
            raise ModelUnavailable(why_not_ready(index, url, model))
        status, meta = await self._get(f"/v2/models/{model}")
        if status != 200 or not isinstance(meta, dict):
            raise ModelUnavailable(f"model '{model}' metadata unavailable: HTTP {status} {_body_error(meta) or ''}".strip())
        self.spec = check_interface(self.spec, meta)
        return self.spec

    async def connect(self) -> None:
        await self._get("/v2/health/live")

    async def send(self, text: str, max_tokens: int, request_id: str, timeout_s: float) -> Exchange:
        body = {**self.spec.request_values(text, max_tokens), "id": request_id}
        path = "generate_stream" if self.spec.streaming else "generate"
        ex = Exchange(start_s=time.perf_counter())
        answer = self.spec.interface.answer()  # each response's new part, however the layout streams
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session().post(f"{self.base}/v2/models/{self.spec.model}/{path}", json=body) as r:
                    if self.spec.streaming and r.status == 200:
                        async for line in r.content:
                            if not line.startswith(b"data:"):
                                continue  # blank separators and comments
                            now = time.perf_counter()
                            obj = json.loads(line[5:])
                            if (error := _body_error(obj)) is not None:
                                ex.error, ex.failed_s = error, now
                                break
                            self._piece(ex, answer, obj, now)
                    else:
                        raw = await r.read()
                        now = time.perf_counter()
                        try:
                            obj = json.loads(raw)
                        except json.JSONDecodeError:
                            obj = {"error": f"HTTP {r.status}: {raw[:200].decode(errors='replace')}"}
                        if (error := _body_error(obj)) is not None or r.status != 200:
                            ex.error, ex.failed_s = error or f"HTTP {r.status}", now
                        else:
                            self._piece(ex, answer, obj, now)
            if ex.error is None:
                _take(ex, answer.end(), ex.times[-1] if ex.times else time.perf_counter())
        except TimeoutError:
            ex.error, ex.failed_s = f"timed out after {timeout_s:g} s", time.perf_counter()
        except Exception as exc:  # noqa: BLE001 -- one request's failure must not stop the level
            ex.error, ex.failed_s = one_line(f"{type(exc).__name__}: {exc}"), time.perf_counter()
        # The answer as the model last stood by it: a cumulative stream's revisions applied, not repeated.
        ex.text = answer.text
        return ex

    def _piece(self, ex: Exchange, answer: StreamedAnswer, obj: Any, now: float) -> None:
        ex.times.append(now)
        text = self.spec.interface.text_of(obj) if isinstance(obj, dict) else b""
        _take(ex, answer.add(text), now)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
