"""The benchmark runner: preflight, a probe, warm-up, then each load level; the same code for the flow
and `stoker bench`.

Raw per-request records are kept (failed requests included, never dropped); statistics come from
stoker.bench.metrics. Output tokens are counted with the model's tokenizer after each level, so the
counting costs nothing while requests are in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..protocol import ENSEMBLE, Interface
from .errors import (
    BenchmarkError,
    EndpointUnreachable,
    InvalidBenchmarkConfig,
    ModelUnavailable,
    OutputLengthUnsupported,
    StreamingUnsupported,
)
from .load import Arrival, Level, LoadPool, LoadSettings, Sent, drive_level
from .metrics import LevelSummary, RequestRecord, summarize
from .transport import Protocol_, TransportSpec
from .transports import open_transport
from .workload import Prompt

__all__ = [
    "BenchConfig",
    "BenchmarkError",
    "BenchmarkResult",
    "EndpointUnreachable",
    "InvalidBenchmarkConfig",
    "ModelUnavailable",
    "OutputLengthUnsupported",
    "StreamingUnsupported",
    "run_benchmark",
    "run_level",
    "run_sweep",
    "warmup",
]

CountTokens = Callable[[str], int]


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: where, what load, how long. Levels run in the order given."""

    url: str
    model: str
    levels: Sequence[Level]
    max_tokens: int
    requests_per_level: int | None = 16
    duration_s: float | None = None  # per level; replaces requests_per_level when set
    warmup_requests: int = 2
    timeout_s: float = 120.0
    protocol: Protocol_ = "grpc"
    arrival: Arrival = "poisson"
    seed: int = 0
    workers: int = 1
    ignore_eos: bool = False  # send min_tokens = max_tokens (models that accept min_tokens)
    http_streaming: bool = True  # HTTP: generate_stream (SSE); False: /generate, one response (TTFT = e2e)
    extra_inputs: Mapping[str, int | float | bool] = field(default_factory=dict)
    interface: Interface = ENSEMBLE  # how the served layout names its inputs (stoker.protocol)
    # OpenAI's response_format sent with every request (openai protocol only): a workload under a constraint.
    response_format: Mapping[str, Any] | None = None

    def transport_spec(self) -> TransportSpec:
        return TransportSpec(protocol=self.protocol, url=self.url, model=self.model,
                             extra_inputs=dict(self.extra_inputs), min_tokens=self.ignore_eos,
                             streaming=self.http_streaming or self.protocol == "grpc", interface=self.interface,
                             response_format=self.response_format)

    def settings(self) -> LoadSettings:
        return LoadSettings(max_tokens=self.max_tokens, timeout_s=self.timeout_s,
                            requests=None if self.duration_s is not None else self.requests_per_level,
                            duration_s=self.duration_s, arrival=self.arrival, seed=self.seed)


@dataclass(frozen=True)
class BenchmarkResult:
    levels: list[LevelSummary]
    records: list[RequestRecord] = field(repr=False)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"levels": [lvl.to_dict() for lvl in self.levels], "records": [asdict(r) for r in self.records],
                "warnings": list(self.warnings)}


def validate(config: BenchConfig, prompts: Sequence[Prompt]) -> None:
    """One-line InvalidBenchmarkConfig for arguments that cannot produce a measurement."""
    if config.duration_s is None and (config.requests_per_level is None or config.requests_per_level < 1):
        raise InvalidBenchmarkConfig(f"zero requests: requests per level must be >= 1, got {config.requests_per_level}")
    if config.duration_s is not None and config.duration_s <= 0:
        raise InvalidBenchmarkConfig(f"duration must be > 0 s, got {config.duration_s}")
    if not prompts:
        raise InvalidBenchmarkConfig("no prompts to send")
    if not config.levels:
        raise InvalidBenchmarkConfig("no load levels to measure (give concurrency levels or request rates)")
    for level in config.levels:
        if level.concurrency is not None and level.concurrency < 1:
            raise InvalidBenchmarkConfig(f"concurrency must be >= 1, got {level.concurrency}")
        if level.request_rate is not None and not level.request_rate > 0:
            raise InvalidBenchmarkConfig(f"request rate must be > 0 requests/s, got {level.request_rate}")
        if level.concurrency is None and level.request_rate is None:
            raise InvalidBenchmarkConfig("a level needs a concurrency or a request rate")
    if config.max_tokens < 1:
        raise InvalidBenchmarkConfig(f"max_tokens must be >= 1, got {config.max_tokens}")
    if config.timeout_s <= 0:
        raise InvalidBenchmarkConfig(f"timeout_s must be > 0, got {config.timeout_s}")
    if config.warmup_requests < 0:
        raise InvalidBenchmarkConfig(f"warm-up requests must be >= 0, got {config.warmup_requests}")
    if config.workers < 1:
        raise InvalidBenchmarkConfig(f"workers must be >= 1, got {config.workers}")
    if config.response_format is not None and config.protocol != "openai":
        raise InvalidBenchmarkConfig(f"a response format (--json-schema, --response-format) is an OpenAI request "
                                     f"field: use --protocol openai (a /v1 URL), not {config.protocol}")


def count_output(sent: Sequence[Sent], count_tokens: CountTokens | None) -> list[RequestRecord]:
    """Records with OSL counted by the tokenizer (default: non-empty responses); a counting failure is
    that request's failure, like any other."""
    out = []
    for s in sent:
        r = s.record
        if r.ok and count_tokens is not None:
            try:
                r = dataclasses.replace(r, output_tokens=count_tokens(s.text.decode("utf-8", errors="replace")))
            except Exception as exc:  # noqa: BLE001 -- caller code; recorded like any request failure
                r = dataclasses.replace(r, ok=False, output_tokens=0,
                                        error=f"counting output tokens failed: {type(exc).__name__}: {exc}")
        out.append(r)
    return out


def _probe_error(model: str, error: str) -> BenchmarkError:
    if "UNIMPLEMENTED" in error or "decoupled" in error.lower():
        return StreamingUnsupported(
            f"model '{model}' cannot stream (needs a decoupled model behind it, or gRPC streaming): {error}"
        )
    return BenchmarkError(f"first request to model '{model}' failed: {error}")


def check_probe(config: BenchConfig, record: RequestRecord) -> None:
    """The first request decides whether anything can be measured at all."""
    if not record.ok:
        raise _probe_error(config.model, record.error or "unknown error")
    asked = record.requested_output_tokens or config.max_tokens
    if config.ignore_eos and record.output_tokens < asked:
        raise OutputLengthUnsupported(
            f"output length {asked} is larger than model '{config.model}' allows: with min_tokens={asked} "
            f"the first request returned {record.output_tokens} tokens (sequence limit reached)"
        )


async def _warmup(transport: Any, config: BenchConfig, prompts: Sequence[Prompt],
                  count_tokens: CountTokens | None) -> list[RequestRecord]:
    probe_settings = dataclasses.replace(config.settings(), requests=1, duration_s=None)
    sent, _ = await drive_level(transport, Level(concurrency=1), probe_settings, prompts)
    probe = count_output(sent, count_tokens)[0]
    check_probe(config, probe)
    if config.warmup_requests <= 1:
        return [probe]
    levels = [lv.concurrency for lv in config.levels if lv.concurrency]
    warm = Level(concurrency=max(1, min(levels, default=1)))
    settings = dataclasses.replace(config.settings(), requests=config.warmup_requests - 1, duration_s=None)
    rest, _ = await drive_level(transport, warm, settings, prompts[1:] or prompts)
    return [probe, *(s.record for s in rest)]


def _bar(enabled: bool, total: int | None, label: str) -> Any:
    from tqdm import tqdm  # comes with huggingface_hub

    return tqdm(total=total, desc=label, unit="req", disable=not enabled, file=sys.stderr, leave=False)


def run_sweep(
    config: BenchConfig,
    prompts: Sequence[Prompt],
    count_tokens: CountTokens | None = None,
    progress: Callable[[str], None] | None = None,
    progress_bar: bool = False,
) -> BenchmarkResult:
    """Preflight, one probe request (always) plus warm-up, then each level in order.

    Raises BenchmarkError subclasses (one-line message) when nothing can be measured: unreachable
    endpoint, missing or non-LLM model, a model that cannot stream, an OSL beyond the model's limit.
    Per-request failures are counted in each level's `errors`.
    """
    validate(config, prompts)
    say = progress or (lambda _msg: None)
    settings = config.settings()

    async def main() -> BenchmarkResult:
        transport = open_transport(config.transport_spec())
        pool: LoadPool | None = None
        try:
            spec = await transport.preflight()
            warm = await _warmup(transport, config, prompts, count_tokens)
            say(f"warm-up: {len(warm)} requests, {sum(not r.ok for r in warm)} errors (not measured)")
            if config.workers > 1:
                pool = await asyncio.to_thread(LoadPool, spec, config.workers)
            levels: list[LevelSummary] = []
            records: list[RequestRecord] = []
            warnings: list[str] = []
            for level in config.levels:
                bar = _bar(progress_bar, settings.requests, level.label)
                try:
                    if pool is not None:
                        sent, load = await asyncio.to_thread(
                            pool.run_level, level, settings, prompts, lambda n, bar=bar: bar.update(n - bar.n))
                    else:
                        sent, load = await drive_level(transport, level, settings, prompts, on_done=lambda bar=bar: bar.update(1))
                finally:
                    bar.close()
                level_records = count_output(sent, count_tokens)
                summary = summarize(level_records, level.concurrency or 0, level.mode, level.request_rate,
                                    dataclasses.replace(load, workers=config.workers))
                say(progress_line(summary))
                for warning in level_warnings(summary):
                    warnings.append(warning)
                    say(f"warning: {warning}")
                levels.append(summary)
                records.extend(level_records)
            return BenchmarkResult(levels=levels, records=records, warnings=warnings)
        finally:
            if pool is not None:
                await asyncio.to_thread(pool.close)
            await transport.close()

    return asyncio.run(main())


def level_warnings(s: LevelSummary) -> list[str]:
    out = []
    if s.client_saturated:
        out.append(f"{s.label}: the client was saturated ({s.client_saturated}); these numbers describe the "
                   f"client rather than the server: use more worker processes")
    if s.errors:
        kinds = "; ".join(f"{n}x {msg}" for msg, n in (s.error_counts or {}).items())
        out.append(f"{s.label}: {s.errors}/{s.requests} requests failed ({kinds})")
    if s.short_outputs:
        out.append(f"{s.label}: {s.short_outputs} requests ended before max_tokens (EOS; --ignore-eos sends min_tokens)")
    return out


def progress_line(s: LevelSummary) -> str:
    ttft = f"{s.ttft_ms.p50:.1f} ms" if s.ttft_ms else "n/a"
    itl = f"{s.itl_ms.p50:.2f} ms" if s.itl_ms else "n/a"
    return (
        f"{s.label}: {s.completed}/{s.requests} ok, {s.errors} errors, "
        f"{s.output_tokens_per_s:.1f} output tok/s, {s.requests_per_s:.2f} req/s, TTFT p50 {ttft}, ITL p50 {itl}"
    )


# --- the earlier, concurrency-only entry points (kept: the flow and tests call them) ----------------------


def run_benchmark(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_tokens: int,
    concurrency_levels: Sequence[int],
    requests_per_level: int,
    warmup_requests: int,
    timeout_s: float,
    count_tokens: CountTokens | None = None,
    progress: Callable[[str], None] | None = None,
    extra_inputs: Mapping[str, int | float | bool] | None = None,
) -> BenchmarkResult:
    """Concurrency sweep over gRPC; see run_sweep."""
    if not concurrency_levels:
        raise InvalidBenchmarkConfig("no concurrency levels to measure")
    config = BenchConfig(url=url, model=model, levels=[Level(concurrency=c) for c in concurrency_levels],
                         max_tokens=max_tokens, requests_per_level=requests_per_level,
                         warmup_requests=warmup_requests, timeout_s=timeout_s, extra_inputs=dict(extra_inputs or {}))
    return run_sweep(config, prompts, count_tokens, progress)


async def run_level(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_tokens: int,
    concurrency: int,
    requests: int,
    timeout_s: float,
    count_tokens: CountTokens | None = None,
    extra_inputs: Mapping[str, int | float | bool] | None = None,
    protocol: Protocol_ = "grpc",
) -> list[RequestRecord]:
    """`requests` streaming requests, `concurrency` in flight at a time, without warm-up; one record each."""
    config = BenchConfig(url=url, model=model, levels=[Level(concurrency=concurrency)], max_tokens=max_tokens,
                         requests_per_level=requests, timeout_s=timeout_s, protocol=protocol,
                         extra_inputs=dict(extra_inputs or {}))
    validate(config, prompts)
    transport = open_transport(config.transport_spec())
    try:
        await transport.preflight()
        sent, _ = await drive_level(transport, config.levels[0], config.settings(), prompts)
    finally:
        await transport.close()
    return count_output(sent, count_tokens)


async def warmup(
    url: str,
    model: str,
    prompts: Sequence[Prompt],
    max_tokens: int,
    requests: int,
    timeout_s: float,
    concurrency: int = 1,
    extra_inputs: Mapping[str, int | float | bool] | None = None,
) -> list[RequestRecord]:
    """Unmeasured requests; raises StreamingUnsupported/BenchmarkError when the first one fails."""
    config = BenchConfig(url=url, model=model, levels=[Level(concurrency=concurrency)], max_tokens=max_tokens,
                         requests_per_level=1, warmup_requests=requests, timeout_s=timeout_s,
                         extra_inputs=dict(extra_inputs or {}))
    validate(config, prompts)
    transport = open_transport(config.transport_spec())
    try:
        await transport.preflight()
        return await _warmup(transport, config, prompts, None)
    finally:
        await transport.close()
