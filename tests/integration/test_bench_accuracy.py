"""Accuracy (issue item 6): a real tritonserver serves a model with scripted timing, and the benchmark's
reported TTFT, ITL and throughput are checked against what the model did: the script's delays are a floor, no
chunk arrives before the model sent it, and the token count is exact. How close they come is printed, not asserted:
a loaded host moves it (speed lives in benchmarks/).

The model (stoker.bench.scripted) waits FIRST_TOKEN_S after it sees a request, then sends one word every
INTERVAL_S on an absolute schedule, and logs its own perf_counter stamps. Client and server share the
host's monotonic clock, so the log also splits each measured TTFT into the script, the way in
(client send → model) and the way out (model send → client stamp); those numbers are printed.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stoker.bench.client import BenchConfig, run_sweep
from stoker.bench.load import Level
from stoker.bench.metrics import percentile
from stoker.bench.scripted import write_model
from stoker.bench.workload import make_prompts
from stoker.stack import local_triton

pytestmark = pytest.mark.triton

FIRST_TOKEN_S = 0.400  # 2 % of it (8 ms) covers the way in and out through Triton on a busy 2-core host
INTERVAL_S = 0.010
OSL = 20
REQUESTS = 10


def _tolerance_ms(expected_ms: float) -> float:
    return max(0.02 * expected_ms, 1.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[local_triton.LocalTriton, Path]]:
    pytest.importorskip("pytriton", reason="nvidia-pytriton (extra 'stack') is not installed")
    root = tmp_path_factory.mktemp("bench-accuracy")
    log = root / "timing.jsonl"
    write_model(root / "models", "ensemble", FIRST_TOKEN_S, INTERVAL_S, timing_log=log)
    with local_triton.start(root / "models", local_triton.pick_free_ports(), root / "tritonserver.log") as s:
        yield s, log


def _words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_reported_ttft_itl_and_throughput_match_the_script(server, protocol: str) -> None:
    triton, log = server
    url = triton.grpc_url if protocol == "grpc" else triton.http_url
    config = BenchConfig(url=url, model="ensemble", levels=[Level(concurrency=1), Level(concurrency=4)],
                         max_tokens=OSL, requests_per_level=REQUESTS, warmup_requests=2, timeout_s=30,
                         protocol=protocol)
    prompts = make_prompts(16, 16, seed=0)
    result = run_sweep(config, prompts, count_tokens=_words)
    # Prompts repeat across levels and runs (and HTTP carries no request id to the model): a record's
    # entry is the one with its prompt received first after its send.
    entries: dict[str, list[dict]] = {}

    def stamp(r) -> dict:
        text = prompts[r.request_id % len(prompts)].text
        return min((e for e in entries.get(text, []) if e["recv"] >= r.start_s), key=lambda e: e["recv"])

    # The model logs a request after its last send, so the last lines may land just after the client is done.
    deadline = time.monotonic() + 10
    while True:
        entries.clear()
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            entries.setdefault(entry["text"], []).append(entry)
        try:
            [stamp(r) for r in result.records]
            break
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    for level in result.levels:
        assert (level.requests, level.completed, level.errors, level.short_outputs) == (REQUESTS, REQUESTS, 0, 0)
        assert level.ttft_ms is not None and level.itl_ms is not None and level.inter_chunk_ms is not None
        # Judged on the medians: other tenants of this 2-core host can stall any process for tens of ms,
        # which moves a mean of 10 requests but not a median. Means are printed too.
        ttft_err = level.ttft_ms.p50 - FIRST_TOKEN_S * 1000
        itl_err = level.itl_ms.p50 - INTERVAL_S * 1000
        recs = [r for r in result.records if r.concurrency == level.concurrency]
        # Throughput against the known token count: every request produced exactly OSL tokens.
        assert sum(r.output_tokens for r in recs) == REQUESTS * OSL
        assert level.output_tokens_per_s == pytest.approx(REQUESTS * OSL / level.duration_s, rel=1e-12)
        ideal = level.concurrency * OSL / (FIRST_TOKEN_S + (OSL - 1) * INTERVAL_S)
        rounds = -(-REQUESTS // level.concurrency)  # the last round may run below the concurrency
        ideal *= REQUESTS / (rounds * level.concurrency)
        tput_err = level.output_tokens_per_s / ideal - 1
        # Where the TTFT error comes from, from the server's own stamps on the shared clock.
        way_in = [1000 * (stamp(r)["recv"] - r.start_s) for r in recs]
        way_out = [1000 * (t - s) for r in recs for t, s in zip(r.chunk_times_s, stamp(r)["sends"])]
        late = [1000 * (stamp(r)["sends"][0] - stamp(r)["recv"]) - FIRST_TOKEN_S * 1000 for r in recs]
        print(f"\n{protocol} c={level.concurrency}: TTFT p50 {level.ttft_ms.p50:.2f} ms, mean {level.ttft_ms.mean:.2f} ms "
              f"(p50 error {ttft_err:+.2f} ms, "
              f"{100 * ttft_err / (FIRST_TOKEN_S * 1000):+.2f} %); ITL p50 {level.itl_ms.p50:.3f} ms, mean "
              f"{level.itl_ms.mean:.3f} ms (p50 error "
              f"{itl_err:+.3f} ms, {100 * itl_err / (INTERVAL_S * 1000):+.2f} %); inter-chunk p50 "
              f"{level.inter_chunk_ms.p50:.3f} ms; {level.output_tokens_per_s:.1f} tok/s vs ideal {ideal:.1f} "
              f"({100 * tput_err:+.2f} %); client→model p50 {statistics.median(way_in):.2f} ms; model's first send late "
              f"by {statistics.median(late):.2f} ms (p50); model→client "
              f"stamp p50 {statistics.median(way_out):.3f} ms, p99 {percentile(sorted(way_out), 99):.3f} ms")
        # What the client reports is judged against what the server did, from its own stamps on the shared clock:
        # the script's delays are a floor, but a loaded machine (tests run in parallel) slows the server itself.
        server_ttft = [1000 * (stamp(r)["sends"][0] - r.start_s) for r in recs]
        # Only what holds on any host, however loaded (how close the figures come is printed above, and measured
        # side by side in benchmarks/client_ceiling.py): the script's delay is a floor under the reported TTFT, no
        # chunk is stamped by the client before the model sent it, and throughput never beats the script.
        assert ttft_err >= -_tolerance_ms(FIRST_TOKEN_S * 1000)  # never a token before the script sends one
        assert all(1000 * (r.chunk_times_s[0] - r.start_s) >= ttft - 1.0 for r, ttft in zip(recs, server_ttft))
        assert min(way_out) >= -1.0
        assert tput_err <= 0.005
