"""Streaming benchmark of a Triton LLM endpoint: workload, client, metrics."""

from stoker.bench.client import (
    BenchmarkError,
    BenchmarkResult,
    EndpointUnreachable,
    InvalidBenchmarkConfig,
    ModelUnavailable,
    StreamingUnsupported,
    run_benchmark,
    run_level,
    warmup,
)
from stoker.bench.metrics import LevelSummary, RequestRecord, Stats, summarize
from stoker.bench.workload import Prompt, make_prompts, token_counter

__all__ = [
    "BenchmarkError",
    "BenchmarkResult",
    "EndpointUnreachable",
    "InvalidBenchmarkConfig",
    "LevelSummary",
    "ModelUnavailable",
    "Prompt",
    "RequestRecord",
    "Stats",
    "StreamingUnsupported",
    "make_prompts",
    "run_benchmark",
    "run_level",
    "summarize",
    "token_counter",
    "warmup",
]
