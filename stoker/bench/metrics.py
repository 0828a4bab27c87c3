"""Per-request benchmark records and their summary, with GenAI-Perf/AIPerf metric definitions.

Pure: no I/O, no clock. All times in a record are seconds from one monotonic clock
(time.perf_counter in the client); summaries report milliseconds, as the field names say.

Definitions (shared/UPSTREAM.md, "Benchmark definitions"):
- TTFT = first non-empty response - send
- e2e  = last response - send
- ITL  = (e2e - TTFT) / (OSL - 1) per request; requests with OSL < 2 have no ITL
- inter-chunk latency = gaps between consecutive responses of a request (vLLM's pooled "ITL")
- output token throughput = sum(OSL) / (last response - first send)
- request throughput = completed requests / the same duration
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    """What the client observed for one request, before any aggregation."""

    request_id: int
    concurrency: int
    start_s: float
    first_response_s: float | None
    end_s: float | None
    chunk_times_s: tuple[float, ...]
    input_tokens: int
    output_tokens: int
    ok: bool
    error: str | None = None
    requested_output_tokens: int | None = None  # max_tokens sent; OSL below it is a short output
    scheduled_s: float | None = None  # request-rate mode: when the arrival process wanted it sent
    worker: int = 0  # load-generator process that sent it
    reported_output_tokens: int | None = None  # the server's usage.completion_tokens (OpenAI route): a check only

    @property
    def inter_chunk_s(self) -> tuple[float, ...]:
        """Gaps between consecutive responses (empty ones included: they are what the wire carried)."""
        if not self.ok:
            return ()
        t = self.chunk_times_s
        return tuple(b - a for a, b in itertools.pairwise(t))

    @property
    def send_lag_s(self) -> float | None:
        """How late the client sent a scheduled request: > 0 means the load generator fell behind."""
        return None if self.scheduled_s is None else self.start_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        if not self.ok or self.first_response_s is None:
            return None
        return self.first_response_s - self.start_s

    @property
    def e2e_s(self) -> float | None:
        if not self.ok or self.end_s is None:
            return None
        return self.end_s - self.start_s

    @property
    def itl_s(self) -> float | None:
        """Mean time per output token after the first; None when undefined (OSL < 2)."""
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Stats:
    """Distribution of one metric; std is the population std (numpy's default, ddof=0)."""

    mean: float
    min: float
    max: float
    std: float
    p50: float
    p90: float
    p95: float
    p99: float


@dataclass(frozen=True)
class ClientLoad:
    """The load generator's own saturation over one level (the worst of its processes)."""

    workers: int
    cpu_percent: float  # of one core, per process: asyncio runs on one core
    loop_lag_ms_p99: float  # how late the event loop woke a 5 ms timer
    loop_lag_ms_max: float
    loop_lag_ms_p90: float = 0.0  # judged on p90: one stall (GC, a busy neighbour) is not saturation
    send_lag_ms_p99: float | None = None  # request-rate mode: lateness of sends against the schedule


# Past these the client, not the server, sets the pace: a busy loop stamps responses late and sends late.
CPU_SATURATED_PERCENT = 85.0
LOOP_LAG_SATURATED_MS = 5.0
SEND_LAG_SATURATED_MS = 10.0


def client_saturation(load: ClientLoad | None) -> str | None:
    """Why the numbers may describe the client rather than the server, or None when it kept up."""
    if load is None:
        return None
    causes = []
    if load.cpu_percent >= CPU_SATURATED_PERCENT:
        causes.append(f"CPU {load.cpu_percent:.0f} % of a core")
    if load.loop_lag_ms_p90 >= LOOP_LAG_SATURATED_MS:
        causes.append(f"event-loop lag p90 {load.loop_lag_ms_p90:.1f} ms")
    if load.send_lag_ms_p99 is not None and load.send_lag_ms_p99 >= SEND_LAG_SATURATED_MS:
        causes.append(f"sends {load.send_lag_ms_p99:.1f} ms behind schedule (p99)")
    return ", ".join(causes) or None


@dataclass(frozen=True)
class LevelSummary:
    """One load level. Latency stats are None when no request produced a sample."""

    concurrency: int  # most requests in flight (concurrency mode: exactly this many)
    requests: int  # all requests sent, failed ones included
    completed: int
    errors: int
    ttft_ms: Stats | None
    itl_ms: Stats | None
    e2e_ms: Stats | None
    input_tokens: Stats | None
    output_tokens: Stats | None
    output_tokens_per_s: float
    requests_per_s: float
    duration_s: float
    inter_chunk_ms: Stats | None = None
    mode: str = "concurrency"  # or "rate"
    request_rate: float | None = None  # target requests/s in rate mode
    short_outputs: int = 0  # completed requests with fewer output tokens than requested
    error_counts: dict[str, int] | None = None  # failure message -> count (the first few kinds)
    client: ClientLoad | None = None
    client_saturated: str | None = None  # why the client, not the server, may have set the pace

    @property
    def label(self) -> str:
        return f"rate {self.request_rate:g}/s" if self.mode == "rate" else f"concurrency {self.concurrency}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: plain dicts, floats, ints and None only."""
        return asdict(self)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (numpy's default 'linear' method)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside [0, 100]")
    rank = (len(sorted_values) - 1) * q / 100.0
    lower = math.floor(rank)
    upper = min(lower + 1, len(sorted_values) - 1)
    fraction = rank - lower
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * fraction


def describe(values: Iterable[float]) -> Stats | None:
    """Stats of the values, or None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    mean = math.fsum(ordered) / len(ordered)
    variance = math.fsum((v - mean) ** 2 for v in ordered) / len(ordered)
    return Stats(
        mean=mean,
        min=ordered[0],
        max=ordered[-1],
        std=math.sqrt(variance),
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p95=percentile(ordered, 95),
        p99=percentile(ordered, 99),
    )


def benchmark_duration_s(records: Sequence[RequestRecord]) -> float:
    """Last response (of any request) minus first send; 0 when nothing was answered.

    Failed requests count here: they held a slot for the time they were in flight.
    """
    if not records:
        return 0.0
    ends = [r.end_s for r in records if r.end_s is not None]
    if not ends:
        return 0.0
    return max(0.0, max(ends) - min(r.start_s for r in records))


_ERROR_KINDS = 5


def summarize(
    records: Sequence[RequestRecord],
    concurrency: int,
    mode: str = "concurrency",
    request_rate: float | None = None,
    client: ClientLoad | None = None,
) -> LevelSummary:
    """Aggregate one level's records; failed requests are counted as errors, not dropped."""
    done = [r for r in records if r.ok]
    kinds: dict[str, int] = {}
    for r in records:
        if not r.ok:
            kinds[r.error or "unknown error"] = kinds.get(r.error or "unknown error", 0) + 1
    top = dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:_ERROR_KINDS]) if kinds else None
    duration = benchmark_duration_s(records)
    total_output = sum(r.output_tokens for r in done)

    def ms(values: Iterable[float | None]) -> Stats | None:
        return describe(v * 1000.0 for v in values if v is not None)

    return LevelSummary(
        concurrency=concurrency,
        requests=len(records),
        completed=len(done),
        errors=len(records) - len(done),
        ttft_ms=ms(r.ttft_s for r in done),
        itl_ms=ms(r.itl_s for r in done),
        e2e_ms=ms(r.e2e_s for r in done),
        input_tokens=describe(float(r.input_tokens) for r in done),
        output_tokens=describe(float(r.output_tokens) for r in done),
        output_tokens_per_s=total_output / duration if duration > 0 else 0.0,
        requests_per_s=len(done) / duration if duration > 0 else 0.0,
        duration_s=duration,
        inter_chunk_ms=ms(gap for r in done for gap in r.inter_chunk_s),
        mode=mode,
        request_rate=request_rate,
        short_outputs=sum(
            1 for r in done if r.requested_output_tokens is not None and r.output_tokens < r.requested_output_tokens
        ),
        error_counts=top,
        client=client,
        client_saturated=client_saturation(client),
    )
