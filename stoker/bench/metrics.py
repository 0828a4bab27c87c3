"""Per-request benchmark records and their summary, with GenAI-Perf/AIPerf metric definitions.

Pure: no I/O, no clock. All times in a record are seconds from one monotonic clock
(time.perf_counter in the client); summaries report milliseconds, as the field names say.

Definitions (shared/UPSTREAM.md, "Benchmark definitions"):
- TTFT = first non-empty response - send
- e2e  = last response - send
- ITL  = (e2e - TTFT) / (OSL - 1) per request; requests with OSL < 2 have no ITL
- output token throughput = sum(OSL) / (last response - first send)
- request throughput = completed requests / the same duration
"""

from __future__ import annotations

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
class MeanOnly:
    mean: float


@dataclass(frozen=True)
class LevelSummary:
    """One concurrency level. Latency stats are None when no request produced a sample."""

    concurrency: int
    requests: int  # all requests sent, failed ones included
    completed: int
    errors: int
    ttft_ms: Stats | None
    itl_ms: Stats | None
    e2e_ms: Stats | None
    input_tokens: MeanOnly | None
    output_tokens: MeanOnly | None
    output_tokens_per_s: float
    requests_per_s: float
    duration_s: float

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


def _mean(values: Sequence[int]) -> MeanOnly | None:
    return MeanOnly(mean=sum(values) / len(values)) if values else None


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


def summarize(records: Sequence[RequestRecord], concurrency: int) -> LevelSummary:
    """Aggregate one level's records; failed requests are counted as errors, not dropped."""
    done = [r for r in records if r.ok]
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
        input_tokens=_mean([r.input_tokens for r in done]),
        output_tokens=_mean([r.output_tokens for r in done]),
        output_tokens_per_s=total_output / duration if duration > 0 else 0.0,
        requests_per_s=len(done) / duration if duration > 0 else 0.0,
        duration_s=duration,
    )
