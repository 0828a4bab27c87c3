"""Where a client's TTFT goes, from the scripted model's own stamps; and a bare OpenAI-route client as a referee.

split_*: each measured request is matched to the model's log line for it (same prompt, by its last token ids;
the first one received after the client's send), and its TTFT splits into way in (client send → model receive),
the model's own wait (the script), and way out (model's first send → client stamp). stoker bench stamps on
perf_counter (the model's clock too); AIPerf's records carry wall-clock starts, so its split uses the model's
time.time() stamp.

bare_openai: a minimal closed-loop aiohttp client on the OpenAI route (the same prompts, concurrency and count),
stamping each SSE chunk as it is read. It tells the cost of the route from the cost of the client that drives it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from stoker.bench.metrics import RequestRecord, percentile, summarize


def read_log(path: Path) -> dict[tuple, list[dict]]:
    """The model's log lines by prompt tail."""
    by_tail: dict[tuple, list[dict]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        by_tail.setdefault(tuple(entry["tail"]), []).append(entry)
    return by_tail


def _first_after(entries: list[dict], key: str, t: float) -> dict | None:
    later = [e for e in entries if e[key] >= t and e["sends"]]
    return min(later, key=lambda e: e[key]) if later else None


def _stats(parts: dict[str, list[float]], matched: int) -> dict:
    out: dict = {"matched_requests": matched}
    for name, values in parts.items():
        ordered = sorted(values)
        out[f"{name}_ms_p50"] = round(statistics.median(ordered), 3) if ordered else None
        out[f"{name}_ms_p99"] = round(percentile(ordered, 99), 3) if ordered else None
    return out


def split_stoker(records: Path, tails: list[tuple], log: dict[tuple, list[dict]]) -> dict:
    """TTFT split of a stoker bench run (records.jsonl); request r sent prompt r % len(prompts)."""
    parts: dict[str, list[float]] = {"way_in": [], "model": [], "way_out": []}
    for line in records.read_text().splitlines():
        r = json.loads(line)
        e = _first_after(log.get(tails[r["request_id"] % len(tails)], []), "recv", r["start_s"]) if r["ok"] else None
        if e is None:
            continue
        parts["way_in"].append(1000 * (e["recv"] - r["start_s"]))
        parts["model"].append(1000 * (e["sends"][0] - e["recv"]))
        parts["way_out"].append(1000 * (r["first_response_s"] - e["sends"][0]))
    return _stats(parts, len(parts["model"]))


def split_aiperf(artifacts: Path, tail_of_text, log: dict[tuple, list[dict]]) -> dict:
    """TTFT split of an AIPerf run (profile_export.jsonl, profiling phase), plus its credit → send delay."""
    prompt = {d["session_id"]: d["payloads"][0]["prompt"] for d in json.loads((artifacts / "inputs.json").read_text())["data"]}
    parts: dict[str, list[float]] = {"way_in": [], "model": [], "way_out": [], "credit_to_send": []}
    for line in (artifacts / "profile_export.jsonl").read_text().splitlines():
        r = json.loads(line)
        meta, ttft = r["metadata"], r.get("metrics", {}).get("time_to_first_token")
        if meta.get("benchmark_phase") != "profiling" or ttft is None:
            continue
        start = meta["request_start_ns"] / 1e9
        e = _first_after(log.get(tail_of_text(prompt[meta["conversation_id"]]), []), "recv_wall", start)
        if e is None:
            continue
        first_send_wall = e["recv_wall"] + (e["sends"][0] - e["recv"])
        parts["way_in"].append(1000 * (e["recv_wall"] - start))
        parts["model"].append(1000 * (e["sends"][0] - e["recv"]))
        parts["way_out"].append(ttft["value"] - 1000 * (first_send_wall - start))
        parts["credit_to_send"].append((meta["request_start_ns"] - meta["credit_issued_ns"]) / 1e6)
    return _stats(parts, len(parts["model"]))


async def _one(session, url: str, model: str, text: str, osl: int, rid: int) -> RequestRecord:
    body = {"model": model, "prompt": text, "max_tokens": osl, "stream": True, "ignore_eos": True, "min_tokens": osl}
    start, times = time.perf_counter(), []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(now)  # content chunks only, as AIPerf's TTFT and request latency use
    return RequestRecord(request_id=rid, concurrency=0, start_s=start, first_response_s=times[0], end_s=times[-1],
                         chunk_times_s=tuple(times), input_tokens=0, output_tokens=len(times), ok=True)


def bare_openai(url: str, model: str, texts: list[str], osl: int, concurrency: int, requests: int,
                warmup: int, out: Path) -> dict:
    """The bare client's figures (one content chunk per token here, so chunks are tokens); its records go to
    ``out/records.jsonl`` in stoker bench's format, so split_stoker reads them too."""
    import aiohttp

    async def run() -> list[RequestRecord]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for i in range(warmup):
                await _one(session, url, model, texts[i % len(texts)], osl, i)
            queue, done = iter(range(requests)), []

            async def slot() -> None:
                for i in queue:
                    done.append(await _one(session, url, model, texts[i % len(texts)], osl, i))

            await asyncio.gather(*(slot() for _ in range(concurrency)))
            return done

    records = asyncio.run(run())
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
    level = summarize(records, concurrency)
    return {"ttft_ms_p50": level.ttft_ms.p50, "ttft_ms_p99": level.ttft_ms.p99, "itl_ms_p50": level.itl_ms.p50,
            "output_tokens_per_s": level.output_tokens_per_s, "requests": level.requests, "errors": level.errors,
            "osl_mean": level.output_tokens.mean, "duration_s": level.duration_s, "e2e_ms_p50": level.e2e_ms.p50}
