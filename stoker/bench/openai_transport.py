"""OpenAI transport: streamed `/v1/completions` (server-sent events) of any OpenAI-compatible server.

The request: ``model``, ``prompt``, ``max_tokens``, ``stream: true`` with ``stream_options.include_usage``, the
``--extra-input`` fields as they are, and with ``--ignore-eos`` ``min_tokens = max_tokens`` (vLLM's field, which
stoker's OpenAI service honours too): the same request the Triton transports make, in OpenAI's words.

What is timed, so that the figures mean what they mean on the Triton routes:
- a *response* is an SSE event carrying a choice (its text may be empty: what the wire carried, as there);
- the closing chunk (empty text plus ``finish_reason``), the usage chunk and ``[DONE]`` are trailers the service
  writes after the model's last response; Triton's routes send nothing for it, so they are not timed and e2e ends
  at the last text, as there (and as in AIPerf);
- first token = the first event whose text is non-empty.
Output tokens are counted exactly as on the other routes (the tokenizer over the concatenated text, or chunks
with --count-chunks); the server's ``usage.completion_tokens`` is kept beside it (``reported_tokens``), a check
of the client's count, never a substitute for it.

Servers answer failures in OpenAI's error shape (``{"error": {"message": …}}``): as an HTTP status before the
stream starts, or as an event inside it once streaming has begun; both end the request as that error.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterable, Callable
from typing import Any
from urllib.parse import urlparse

import aiohttp

from .errors import EndpointUnreachable, ModelUnavailable
from .transport import PREFLIGHT_TIMEOUT_S, Exchange, TransportSpec, auth_headers, one_line

DONE = b"[DONE]"


def base_url(url: str) -> str:
    """``http://host:port/v1`` from what a user types: a scheme is added when missing, ``/v1`` when no path."""
    full = url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"
    return full if urlparse(full).path not in ("", "/") else f"{full.rstrip('/')}/v1"


def request_body(spec: TransportSpec, text: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": spec.model, "prompt": text, "max_tokens": max_tokens, **spec.extra_inputs}
    if spec.min_tokens:
        body["min_tokens"] = max_tokens
    if spec.response_format is not None:
        body["response_format"] = dict(spec.response_format)
    body["stream"] = spec.streaming
    if spec.streaming:
        body["stream_options"] = {"include_usage": True}
    return body


def error_of(obj: Any) -> str | None:
    """The one-line message of an OpenAI error body (or of any body with an "error" key)."""
    if not isinstance(obj, dict) or "error" not in obj:
        return None
    err = obj["error"]
    return one_line(err.get("message") or err if isinstance(err, dict) else err)


def _choice(obj: dict) -> dict | None:
    choices = obj.get("choices") or []
    return choices[0] if choices and isinstance(choices[0], dict) else None


def _usage(obj: dict) -> int | None:
    usage = obj.get("usage")
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) else None


def take_event(ex: Exchange, pieces: list[bytes], data: bytes, now: float) -> bool:
    """Apply one SSE ``data:`` payload to ``ex``; False when the stream is over ([DONE] or an error)."""
    if data.strip() == DONE:
        return False
    obj = json.loads(data)
    if (error := error_of(obj)) is not None:
        ex.error, ex.failed_s = error, now
        return False
    if (reported := _usage(obj)) is not None:
        ex.reported_tokens = reported
    choice = _choice(obj)
    if choice is None:
        return True  # the usage chunk (no choices): a trailer
    piece = str(choice.get("text") or "").encode("utf-8")
    if not piece and choice.get("finish_reason") is not None:
        return True  # the closing chunk: a trailer
    ex.times.append(now)
    if piece:
        pieces.append(piece)
        ex.chunks += 1
        if ex.first_s is None:
            ex.first_s = now
    return True


async def read_stream(lines: AsyncIterable[bytes], ex: Exchange,
                      clock: Callable[[], float] = time.perf_counter) -> None:
    """Fill ``ex`` from an SSE body, stamping each event as its line is read."""
    pieces: list[bytes] = []
    try:
        async for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            if not take_event(ex, pieces, line[5:], clock()):
                break
        else:
            if ex.error is None and not pieces and not ex.times:
                ex.error, ex.failed_s = "the stream ended without a completion chunk", clock()
    finally:
        ex.text = b"".join(pieces)


def take_body(ex: Exchange, status: int, raw: bytes, now: float) -> None:
    """A whole (non-streamed, or refused) answer: one response, or the error it carries."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        obj = None
    error = error_of(obj)
    if status != 200 or error is not None or not isinstance(obj, dict):
        detail = error or raw[:200].decode(errors="replace").strip()
        ex.error, ex.failed_s = f"HTTP {status}: {detail}" if status != 200 else detail or "no JSON body", now
        return
    ex.reported_tokens = _usage(obj)
    choice = _choice(obj) or {}
    text = str(choice.get("text") or "").encode("utf-8")
    ex.times.append(now)
    ex.text = text
    if text:
        ex.chunks, ex.first_s = 1, now


class OpenAiTransport:
    def __init__(self, spec: TransportSpec) -> None:
        self.spec = spec
        self.base = base_url(spec.url)
        self.session: aiohttp.ClientSession | None = None

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            # No connection cap: the load generator, not aiohttp's pool, decides what is in flight.
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                                 headers=auth_headers())
        return self.session

    async def _models(self) -> tuple[int, Any]:
        timeout = aiohttp.ClientTimeout(total=PREFLIGHT_TIMEOUT_S)
        async with self._session().get(f"{self.base}/models", timeout=timeout) as r:
            raw = await r.read()
        try:
            return r.status, json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return r.status, None

    async def preflight(self) -> TransportSpec:
        """The server answers GET /v1/models and lists the model; raises EndpointUnreachable or ModelUnavailable."""
        try:
            status, listing = await self._models()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EndpointUnreachable(f"OpenAI server at {self.base} is unreachable: "
                                      f"{one_line(f'{type(exc).__name__}: {exc}')}") from None
        data = listing.get("data") if isinstance(listing, dict) else None
        if status != 200 or not isinstance(data, list):
            why = error_of(listing) or ("not an OpenAI model list" if status == 200 else "")
            raise EndpointUnreachable(f"{self.base}/models answers HTTP {status}{': ' + why if why else ''} "
                                      "(is --url an OpenAI-compatible server's /v1?)")
        names = [str(m.get("id")) for m in data if isinstance(m, dict)]
        if self.spec.model not in names:
            raise ModelUnavailable(f"model '{self.spec.model}' is not served at {self.base} "
                                   f"(models: {', '.join(sorted(names)) or 'none'}; give --model)")
        return self.spec

    async def connect(self) -> None:
        await self._models()

    async def send(self, text: str, max_tokens: int, request_id: str, timeout_s: float) -> Exchange:
        body = request_body(self.spec, text, max_tokens)
        ex = Exchange(start_s=time.perf_counter())
        try:
            async with asyncio.timeout(timeout_s):
                async with self._session().post(f"{self.base}/completions", json=body,
                                                headers={"X-Request-Id": request_id}) as r:
                    if self.spec.streaming and r.status == 200:
                        await read_stream(r.content, ex)
                    else:
                        raw = await r.read()
                        take_body(ex, r.status, raw, time.perf_counter())
        except TimeoutError:
            ex.error, ex.failed_s = f"timed out after {timeout_s:g} s", time.perf_counter()
        except Exception as exc:  # noqa: BLE001 -- one request's failure must not stop the level
            ex.error, ex.failed_s = one_line(f"{type(exc).__name__}: {exc}"), time.perf_counter()
        return ex

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
