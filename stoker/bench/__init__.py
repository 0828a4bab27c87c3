"""Streaming benchmark of a Triton LLM endpoint: workload, transports, load, metrics, outputs, gate."""

from stoker.bench.client import (
    BenchConfig,
    BenchmarkResult,
    run_benchmark,
    run_level,
    run_sweep,
    warmup,
)
from stoker.bench.errors import (
    BenchmarkError,
    EndpointUnreachable,
    GateFailed,
    InvalidBenchmarkConfig,
    ModelUnavailable,
    OutputLengthUnsupported,
    StreamingUnsupported,
)
from stoker.bench.load import Level
from stoker.bench.metrics import ClientLoad, LevelSummary, RequestRecord, Stats, summarize
from stoker.bench.workload import Prompt, load_prompt_file, make_prompts, token_counter

__all__ = [
    "BenchConfig",
    "BenchmarkError",
    "BenchmarkResult",
    "ClientLoad",
    "EndpointUnreachable",
    "GateFailed",
    "InvalidBenchmarkConfig",
    "Level",
    "LevelSummary",
    "ModelUnavailable",
    "OutputLengthUnsupported",
    "Prompt",
    "RequestRecord",
    "Stats",
    "StreamingUnsupported",
    "load_prompt_file",
    "make_prompts",
    "run_benchmark",
    "run_level",
    "run_sweep",
    "summarize",
    "token_counter",
    "warmup",
]
