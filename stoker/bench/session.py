"""One benchmark from settings to files: prompts, the sweep, records/summary/table/plot on disk.

`stoker bench` and the flow's benchmark task both call `execute`, so a number in a run report and a
number from the command line come from the same code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..protocol import Interface
from .client import BenchConfig, BenchmarkResult, run_sweep
from .counting import CHUNKS_WARNING
from .load import Level
from .output import write_all
from .workload import Prompt, load_prompt_file, make_prompts, token_counter

_MAX_PROMPTS = 2048  # distinct prompts; requests beyond cycle through them
_DURATION_PROMPTS = 512


@dataclass(frozen=True)
class Workload:
    input_tokens: int = 32
    output_tokens: int = 32
    input_stddev: float = 0.0
    output_stddev: float = 0.0
    seed: int = 0
    tokenizer_json: Path | None = None
    prompt_file: Path | None = None

    def prompts(self, count: int) -> list[Prompt]:
        if self.prompt_file is not None:
            return load_prompt_file(self.prompt_file, self.tokenizer_json)
        return make_prompts(count, self.input_tokens, self.seed, self.tokenizer_json, input_stddev=self.input_stddev,
                            output_tokens=self.output_tokens, output_stddev=self.output_stddev)

    def counter(self) -> Callable[[str], int] | None:
        return token_counter(self.tokenizer_json) if self.tokenizer_json is not None else None


def fingerprint(config: BenchConfig, workload: Workload) -> dict[str, Any]:
    """What must match for two runs' numbers to be comparable (the gate checks it)."""
    source: Any = {"isl": workload.input_tokens, "isl_stddev": workload.input_stddev,
                   "osl": workload.output_tokens, "osl_stddev": workload.output_stddev, "seed": workload.seed}
    if workload.prompt_file is not None:
        source = {"prompt_file_sha256": hashlib.sha256(Path(workload.prompt_file).read_bytes()).hexdigest()}
    out = {"prompts": source, "protocol": config.protocol, "ignore_eos": config.ignore_eos,
           "arrival": config.arrival, "model": config.model}
    if config.response_format is not None:  # only then: earlier records stay comparable to free runs
        out["response_format"] = dict(config.response_format)
    return out


def prompt_count(config: BenchConfig) -> int:
    if config.duration_s is not None:
        return _DURATION_PROMPTS
    total = config.warmup_requests + (config.requests_per_level or 0) * len(config.levels)
    return max(1, min(total, _MAX_PROMPTS))


def execute(
    config: BenchConfig,
    workload: Workload,
    out: Path,
    progress: Callable[[str], None] | None = None,
    progress_bar: bool = False,
    title: str = "",
    meta: dict[str, Any] | None = None,
) -> tuple[BenchmarkResult, dict[str, Any], list[Path]]:
    """Run the sweep and write its files into `out`; returns the result, the summary and the files."""
    prompts = workload.prompts(prompt_count(config))
    result = run_sweep(config, prompts, workload.counter(), progress, progress_bar)
    chunks = workload.tokenizer_json is None  # no tokenizer: lengths are words in and stream chunks out
    summary = {
        **(meta or {}),
        "model": config.model,
        "url": config.url,
        "units": {"input": "words" if chunks else "tokens", "output": "chunks" if chunks else "tokens"},
        "workload": fingerprint(config, workload),
        "settings": {"mode": config.levels[0].mode, "levels": [lv.label for lv in config.levels],
                     "requests_per_level": config.requests_per_level, "duration_s": config.duration_s,
                     "warmup_requests": config.warmup_requests, "timeout_s": config.timeout_s,
                     "workers": config.workers, "max_tokens": config.max_tokens},
        "levels": [lv.to_dict() for lv in result.levels],
        "warnings": [CHUNKS_WARNING] * chunks + list(result.warnings),
    }
    files = write_all(out, result.records, summary, title or f"{config.model} @ {config.url}")
    return result, summary, files


def for_adapter(config: BenchConfig, name: str, task_id: int) -> BenchConfig:
    """The same load for LoRA adapter ``name``: its model id over OpenAI, its ``lora_task_id`` (TensorRT-LLM's
    per-request adapter) over Triton; InvalidBenchmarkConfig where the interface takes no adapter."""
    if config.protocol == "openai":
        return replace(config, model=name)
    if config.interface.adapter is None:
        from .errors import InvalidBenchmarkConfig

        raise InvalidBenchmarkConfig(f"adapter {name}: the {config.interface.layout} interface takes no adapter per "
                                     "request")
    return replace(config, extra_inputs={**config.extra_inputs, config.interface.adapter: task_id})


def levels_from(concurrency: list[int] | None, rates: list[float] | None, cap: int | None = None) -> list[Level]:
    """Levels for a sweep: request rates (optionally capped by one concurrency) or concurrencies."""
    if rates:
        return [Level(concurrency=cap, request_rate=r) for r in rates]
    return [Level(concurrency=c) for c in (concurrency or [])]


def from_spec(bench: Any, grpc_url: str, http_url: str, interface: Interface,
              tokenizer_json: Path | None) -> tuple[BenchConfig, Workload]:
    """The spec's `benchmark` section (stoker.spec.schema.Benchmark) as a config and workload for `execute`, in
    the served layout's interface (the target's)."""
    rates = bench.request_rates if bench.mode == "rate" else None
    config = BenchConfig(
        url=http_url if bench.protocol == "http" else grpc_url, model=interface.model, interface=interface,
        levels=levels_from(bench.concurrency, rates), max_tokens=bench.output_tokens,
        requests_per_level=None if bench.duration_s else bench.requests_per_level, duration_s=bench.duration_s,
        warmup_requests=bench.warmup_requests, timeout_s=bench.timeout_s, protocol=bench.protocol,
        arrival=bench.arrival, seed=bench.seed, workers=bench.workers, ignore_eos=bench.ignore_eos)
    workload = Workload(input_tokens=bench.input_tokens, output_tokens=bench.output_tokens,
                        input_stddev=bench.input_tokens_stddev, output_stddev=bench.output_tokens_stddev,
                        seed=bench.seed, tokenizer_json=tokenizer_json)
    return config, workload
