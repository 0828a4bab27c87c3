"""1,000 bad requests against the OpenAI service, then a valid one: every refusal in OpenAI's error shape, the
answer unchanged, and neither the service's memory nor Triton's grown (issue 14).

The service runs as its own process (``python -m stoker.openai_api``, as in its container) in front of the
real tritonserver serving the tiny Llama, so the memory read is the resident set of that process, and of
tritonserver with its python backend stubs (``/proc/<pid>/status``). Each kind of bad input is checked once
in detail in test_openai_served.py; this test is about volume.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

pytest.importorskip("pytriton")
httpx = pytest.importorskip("httpx")

from grpc_stream import serve_checkpoint
from openai_process import openai_service

from stoker.workers.tinymodel import MAX_POSITIONS, make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
WARM_UP = 200
ROUNDS = 1000
CONCURRENCY = 4
HUGE_EVERY = 50  # a several-MB body costs ~0.1 s to send: often enough to matter, rarely enough to stay fast
LEAVE_EVERY = 25  # the odd multiples of 25 (the even ones are HUGE_EVERY's): 20 in 1,000
ERROR_FIELDS = {"message", "type", "param", "code"}
RSS_BOUND_KIB = 8 << 10  # why this much: at the assertion


@dataclass(frozen=True)
class Bad:
    """One kind of bad request and how the service must refuse it."""

    path: str
    body: dict | bytes
    status: int
    param: str | None
    code: str | None


BAD = {
    "unknown model": Bad("/chat/completions", {"model": "gpt-4o", "messages": MESSAGES}, 404, "model",
                         "model_not_found"),
    "max_tokens 0": Bad("/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400,
                        "max_tokens", "invalid_value"),
    "max_tokens negative": Bad("/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -7}, 400,
                               "max_tokens", "invalid_value"),
    "max_tokens over the context": Bad("/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                             "max_tokens": MAX_POSITIONS}, 400, "max_tokens",
                                       "context_length_exceeded"),
    "empty messages": Bad("/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "empty_array"),
    "unknown role": Bad("/chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "hi"}]},
                        400, "messages[0].role", "invalid_value"),
    "malformed JSON": Bad("/chat/completions", b'{"model": "tiny", "messages": [', 400, None, "invalid_json"),
    "JSON nested too deep": Bad("/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, None, "invalid_json"),
    "lone surrogate": Bad("/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": '
                          b'"\\ud800"}]}', 400, None, "invalid_json"),
    "prompt over the context": Bad("/completions", {"model": MODEL, "prompt": "x " * MAX_POSITIONS,
                                                    "max_tokens": 4}, 400, "prompt", "context_length_exceeded"),
}
# 6 MiB, over the service's 4 MiB limit: refused by its Content-Length, or while read when sent chunked.
HUGE = b'{"model": "tiny", "prompt": "' + b"a" * (6 << 20) + b'"}'
HUGE_BAD = Bad("/completions", HUGE, 413, None, "request_too_large")
HUGE_KINDS = ("huge body", "huge body, chunked")


def _schedule(n: int) -> list[str]:
    """``n`` request kinds: the small ones in turn, a huge body every HUGE_EVERY, a disconnect every LEAVE_EVERY."""
    small, huge = itertools.cycle(BAD), itertools.cycle(HUGE_KINDS)
    out = []
    for i in range(1, n + 1):
        out.append(next(huge) if i % HUGE_EVERY == 0 else "disconnect" if i % LEAVE_EVERY == 0 else next(small))
    return out


# ---------------------------------------------------------------- memory


def _rss_kib(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone since it was listed
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0  # a zombie has no VmRSS


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (tritonserver starts a stub process per python model instance)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += parents.get(p, [])
    return out


def _tree_rss_kib(pid: int) -> int:
    tree = _tree(pid)
    assert len(tree) > 1, "no python backend stub under tritonserver: the reading would miss the model"
    return sum(_rss_kib(p) for p in tree)


# ---------------------------------------------------------------- requests


async def _refused(client: httpx.AsyncClient, kind: str) -> None:
    bad = HUGE_BAD if kind in HUGE_KINDS else BAD[kind]
    if isinstance(bad.body, dict):
        r = await client.post(bad.path, json=bad.body)
    elif kind == "huge body, chunked":
        async def chunks():  # no Content-Length: the service must count what it reads
            for i in range(0, len(bad.body), 1 << 20):
                yield bad.body[i:i + (1 << 20)]
        r = await client.post(bad.path, content=chunks(), headers={"content-type": "application/json"})
    else:
        r = await client.post(bad.path, content=bad.body, headers={"content-type": "application/json"})
    body = r.json()
    assert r.status_code == bad.status, (kind, r.status_code, body)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, (kind, body)
    assert (body["error"]["param"], body["error"]["code"]) == (bad.param, bad.code), (kind, body)
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"], (kind, body)


async def _leave_mid_stream(client: httpx.AsyncClient) -> None:
    """Ask for (nearly) the whole context, read the first chunk, hang up."""
    body = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": MAX_POSITIONS - 16, "temperature": 0,
            "stream": True}
    async with client.stream("POST", "/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                assert json.loads(line[6:])["object"] == "text_completion"
                break
    # Leaving the block with the body unread closes the connection: the service sees a disconnect.


async def _abuse(base: str, kinds: list[str]) -> dict[str, int]:
    """Send ``kinds`` over CONCURRENCY connections; how many of each were sent (each checked)."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for k in kinds:
        queue.put_nowait(k)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            kind = queue.get_nowait()
            await (_leave_mid_stream(client) if kind == "disconnect" else _refused(client, kind))

    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    return {k: kinds.count(k) for k in sorted(set(kinds))}


def _answer(base: str) -> tuple[str, str, dict]:
    """One valid greedy chat request, not streamed and streamed: (text, streamed text, usage)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=base, timeout=60) as h:
        r = h.post("/chat/completions", json=body)
        assert r.status_code == 200, r.text
        whole = r.json()
        streamed = []
        with h.stream("POST", "/chat/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            streamed.append(chunk["choices"][0]["delta"].get("content") or "")
    return whole["choices"][0]["message"]["content"], "".join(streamed), whole["usage"]


# ---------------------------------------------------------------- the service as its own process


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("abuse")
    make_tiny_model(root / "checkpoint", seed=0)
    log = root / "openai.log"
    with serve_checkpoint(root / "checkpoint", root) as (server, artifact), \
            openai_service(MODEL, server.grpc_url, artifact, log=log) as (base, service):
        yield {"base": base, "service": service, "triton": server.process, "log": log}


def test_a_thousand_bad_requests_change_nothing(stack):
    base = stack["base"]
    t0 = time.monotonic()
    text, streamed, use = _answer(base)
    before_s = time.monotonic() - t0
    assert text and text == streamed
    # Warm-up: every code path once and then some, so allocator arenas, caches and gRPC buffers are at
    # their working size before the first reading.
    asyncio.run(_abuse(base, _schedule(WARM_UP)))
    service_before = _rss_kib(stack["service"].pid)
    triton_before = _tree_rss_kib(stack["triton"].pid)

    t0 = time.monotonic()
    sent = asyncio.run(_abuse(base, _schedule(ROUNDS)))
    took_s = time.monotonic() - t0
    assert sum(sent.values()) == ROUNDS and set(sent) == {*BAD, *HUGE_KINDS, "disconnect"}

    # Every disconnect cancelled its generation: one model instance generates one request at a time, so
    # had any of the 20 abandoned ~2,000-token generations kept going, this answer would queue behind it.
    t0 = time.monotonic()
    assert _answer(base) == (text, streamed, use)
    answer_s = time.monotonic() - t0
    service_after = _rss_kib(stack["service"].pid)
    triton_after = _tree_rss_kib(stack["triton"].pid)
    print(f"\n{ROUNDS} bad requests in {took_s:.1f} s {sent}; valid answer in {answer_s:.2f} s "
          f"(before: {before_s:.2f} s); RSS KiB: "
          f"service {service_before} -> {service_after}, triton tree {triton_before} -> {triton_after}")
    # A deadline, not a speed claim: 10x the same answer before the abuse (and never under the old 3 s). One
    # generation left running (~2,000 tokens) would queue it for far longer: 80x the 24 tokens of _answer.
    # The service's latency is measured by benchmarks/openai_overhead.py.
    assert answer_s < max(3.0, 10 * before_s), (answer_s, before_s)

    assert stack["service"].poll() is None
    log = stack["log"].read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    # 8 MiB, measured against (2 cores, tiny model): between two readings the service's RSS swings by ~2.7 MiB
    # (the allocator keeps or returns an over-limit body's 4 MiB of chunks) and Triton's tree by < 1.5 MiB, with
    # no trend over 7,000 mixed requests or 2,000 disconnects. 8 MiB still catches a leak of 8 KiB per request,
    # one retained over-limit body per 10 sent, or 400 KiB per abandoned generation.
    assert service_after - service_before <= RSS_BOUND_KIB, (service_before, service_after)
    assert triton_after - triton_before <= RSS_BOUND_KIB, (triton_before, triton_after)
