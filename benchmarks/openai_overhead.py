"""What the OpenAI route adds: TTFT and inter-chunk latency of /v1/completions against Triton's generate_stream.

One tiny Llama (stoker.workers.tinymodel, the real reference build) served by the local tritonserver; the
OpenAI service (`python -m stoker.openai_api`, its own process, as in its container) in front of Triton's gRPC
port. The same greedy request (prompt, 32 output tokens) alternates between the two routes (which one goes
first flips every round), one at a time, through the same HTTP client: Triton's
``/v2/models/ensemble/generate_stream`` (preprocessing → tensorrt_llm → postprocessing) and the service's
streamed ``/v1/completions`` (token ids to tensorrt_llm, detokenized in the service). Both produce the same
tokens. No proxy in either path (HAProxy's own cost: benchmarks/results/operate.json).

Then, side by side in the same run (``--after-disconnect`` rounds): a short answer (2 tokens, not streamed) on its
own, and the same answer right after a client left a 1,500-token stream at its first chunk. The ratio of their
p50s is the speed claim behind tests/integration/test_openai_served.py::test_client_leaving_mid_stream (a left
stream is cancelled, so the next answer does not queue behind it); the tests keep only a deadline of 10x.
Not run yet (added with those tests' deadlines).

    python benchmarks/openai_overhead.py --out benchmarks/results/openai_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
TOKENS = 32


def _events(client: httpx.Client, url: str, body: dict, text_of) -> tuple[float, list[float], str]:
    """(TTFT s, gaps between text chunks s, text) of one streamed request."""
    t0 = time.perf_counter()
    arrivals, text = [], []
    with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            piece = text_of(json.loads(line[5:]))
            if piece:
                arrivals.append(time.perf_counter())
                text.append(piece)
    return arrivals[0] - t0, [b - a for a, b in zip(arrivals, arrivals[1:])], "".join(text)


def _short_answer(client: httpx.Client, base: str) -> float:
    """Seconds for one 2-token greedy completion, not streamed."""
    t0 = time.perf_counter()
    r = client.post(f"{base}/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def _leave_a_long_stream(client: httpx.Client, base: str) -> None:
    """Ask for 1,500 tokens streamed, read the first chunk, hang up."""
    body = {"model": "tiny", "prompt": "Tell me everything", "max_tokens": 1500, "temperature": 0, "stream": True}
    with client.stream("POST", f"{base}/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="per route")
    p.add_argument("--after-disconnect", type=int, default=20, help="rounds of the disconnect comparison")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "openai_overhead.json")
    args = p.parse_args()

    from openai_process import tiny_model_served

    with tempfile.TemporaryDirectory() as tmp:
        with tiny_model_served(Path(tmp)) as (server, _artifact, base):
            routes = {
                "generate_stream": (f"{server.http_url}/v2/models/ensemble/generate_stream",
                                    {"text_input": PROMPT, "max_tokens": TOKENS, "stream": True},
                                    lambda e: e.get("text_output", "")),
                "openai_completions": (f"{base}/completions",
                                       {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS,
                                        "temperature": 0, "stream": True},
                                       lambda e: e["choices"][0]["text"] if e.get("choices") else ""),
            }
            with httpx.Client(timeout=60) as client:
                for name, (url, body, text_of) in routes.items():  # warm-up, and the same answer on both
                    texts = {_events(client, url, body, text_of)[2] for _ in range(3)}
                    routes[name] += (texts,)
                ttft = {n: [] for n in routes}
                gaps = {n: [] for n in routes}
                for i in range(args.requests):
                    # Which route goes first flips every round, so neither always follows the other.
                    for name in list(routes)[:: 1 if i % 2 == 0 else -1]:
                        url, body, text_of, _texts = routes[name]
                        first, between, _ = _events(client, url, body, text_of)
                        ttft[name].append(first)
                        gaps[name] += between
                alone, after = [], []
                for i in range(args.after_disconnect):
                    # Side by side, the order flipping every round; a fresh client per left stream.
                    for kind in ("alone", "after")[:: 1 if i % 2 == 0 else -1]:
                        if kind == "after":
                            with httpx.Client(timeout=60) as leaver:
                                _leave_a_long_stream(leaver, base)
                            after.append(_short_answer(client, base))
                        else:
                            alone.append(_short_answer(client, base))
    same = routes["generate_stream"][3] == routes["openai_completions"][3]
    result = {
        "what": "streamed greedy request, one at a time, no proxy: Triton generate_stream (ensemble) vs the OpenAI "
                "service's /v1/completions (tensorrt_llm token ids, detokenized in the service)",
        "model": "stoker tiny Llama (hidden 256, 4 layers), reference build, local tritonserver 2.51.0",
        "prompt": PROMPT, "max_tokens": TOKENS, "requests_per_route": args.requests, "same_text": same,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
        "routes": {n: {"ttft_ms_p50": round(_p(ttft[n], 0.5), 3), "ttft_ms_p99": round(_p(ttft[n], 0.99), 3),
                       "itl_ms_p50": round(_p(gaps[n], 0.5), 3),
                       "ttft_count": len(ttft[n]), "itl_count": len(gaps[n]),
                       "itl_ms_mean": round(statistics.mean(gaps[n]) * 1000, 3),
                       "chunks": len(gaps[n]) + len(ttft[n])} for n in ttft},
    }
    g, o = result["routes"]["generate_stream"], result["routes"]["openai_completions"]
    result["openai_minus_generate_stream_ms"] = {"ttft_p50": round(o["ttft_ms_p50"] - g["ttft_ms_p50"], 3),
                                                 "itl_p50": round(o["itl_ms_p50"] - g["itl_ms_p50"], 3)}
    if alone:
        result["after_disconnect"] = {
            "what": "2-token completion alone vs right after a client left a 1,500-token stream, interleaved",
            "rounds": len(alone), "alone_ms_p50": round(_p(alone, 0.5), 3), "after_ms_p50": round(_p(after, 0.5), 3),
            "ratio_p50": round(_p(after, 0.5) / _p(alone, 0.5), 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
