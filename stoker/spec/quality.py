"""The spec's sections that judge a build before it serves: the benchmark with its regression gate, and the
accuracy evaluation against the unquantized build. Pure data, re-exported by stoker.spec.schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .base import RepoId, _Section


class BenchmarkGate(_Section):
    """Regression gate against the deployment's last promoted run (stoker/bench/gate.py); percentages."""

    enabled: bool = Field(False, description="a failed gate fails the run and the build is not promoted")
    output_tokens_per_s_drop_pct: float | None = Field(5.0, ge=0)
    ttft_p99_rise_pct: float | None = Field(10.0, ge=0)
    itl_p99_rise_pct: float | None = Field(None, ge=0)
    e2e_p99_rise_pct: float | None = Field(None, ge=0)
    max_error_rate_pct: float | None = Field(0.0, ge=0, le=100, description="absolute, no baseline needed")


class Benchmark(_Section):
    input_tokens: int = Field(32, ge=1, le=32768)
    output_tokens: int = Field(32, ge=1, le=32768)
    concurrency: list[int] = Field(default_factory=lambda: [1, 4])
    requests_per_level: int = Field(16, ge=1, le=100000)
    warmup_requests: int = Field(2, ge=0, le=1000)
    timeout_s: float = Field(120, gt=0)
    seed: int = 0
    protocol: Literal["grpc", "http"] = Field("grpc", description="gRPC stream_infer or HTTP generate_stream (SSE)")
    mode: Literal["concurrency", "rate"] = "concurrency"
    request_rates: list[float] = Field(default_factory=list, description="requests/s per level (mode: rate)")
    arrival: Literal["poisson", "constant"] = "poisson"
    duration_s: float | None = Field(None, gt=0, description="per level, instead of requests_per_level")
    input_tokens_stddev: float = Field(0, ge=0)
    output_tokens_stddev: float = Field(0, ge=0)
    ignore_eos: bool = Field(False, description="send min_tokens = max_tokens so every output has the asked length")
    workers: int = Field(1, ge=1, le=64, description="load-generator processes")
    remeasure: bool = Field(False, description="measure every run; by default a run whose backend already served "
                                               "(same container, digest and settings) reuses that measurement")
    gate: BenchmarkGate = BenchmarkGate()

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 or c > 4096 for c in v):
            raise ValueError("give at least one concurrency level, each 1..4096")
        return v

    @model_validator(mode="after")
    def _rates(self) -> Benchmark:
        if self.mode == "rate" and (not self.request_rates or any(r <= 0 for r in self.request_rates)):
            raise ValueError("mode 'rate' needs request_rates, each > 0 requests/s")
        return self


class EvalDataset(_Section):
    """Evaluation text from a Hub dataset repo: one .txt file, or a .jsonl file whose rows carry `text_field`."""

    repo_id: RepoId
    revision: str = "main"
    path: str = Field(description="file inside the dataset repo, e.g. data/eval.txt or data/eval.jsonl")
    text_field: str = "text"

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.endswith((".txt", ".jsonl")) or ".." in v.split("/"):
            raise ValueError(f"{v!r}: give a .txt or .jsonl file inside the dataset repo")
        return v


class LmEvalTask(_Section):
    """An lm-evaluation-harness task run against the candidate through its endpoint (local data only)."""

    task: str
    limit: int = Field(20, ge=1, le=100000, description="documents scored")
    min_score: float | None = Field(None, ge=0, le=1, description="the task's score (e.g. acc) must reach this")

    @field_validator("task")
    @classmethod
    def _known(cls, v: str) -> str:
        from ..evaluation.lm_tasks import check_task

        check_task(v)
        return v


class Evaluation(_Section):
    """Accuracy of the served candidate against the unquantized build of the same revision, before it serves."""

    enabled: bool = Field(True, description="a failed evaluation fails the run; the candidate never serves")
    text_file: Path | None = Field(None, description="held-out text; default: stoker's bundled evaluation.txt")
    dataset: EvalDataset | None = Field(None, description="held-out text from a Hub dataset instead of a file")
    window_tokens: int = Field(64, ge=8, le=8192, description="perplexity window, in tokens")
    max_windows: int = Field(8, ge=1, le=4096)
    prompts: int = Field(8, ge=1, le=1024, description="greedy-agreement prompts (N)")
    prompt_tokens: int = Field(16, ge=1, le=4096)
    greedy_tokens: int = Field(16, ge=1, le=4096, description="tokens generated per prompt (M)")
    max_perplexity_rise_pct: float | None = Field(10.0, ge=0, le=100000)
    # 0.25: int4_awq/w4a8_awq keep 0.34-0.35 of the greedy tokens of the random-weight demo model, a damaged
    # checkpoint 0.0 (benchmarks/results/quality.json); trained models agree far more: tighten it for them.
    min_greedy_agreement: float | None = Field(0.25, ge=0, le=1, description="token match rate with the baseline")
    baseline_tolerance: float | None = Field(None, gt=0, le=10, description="largest |Δ log prob| (nats) allowed "
                                             "between the unquantized build as served and transformers; default: "
                                             "the target's (reference 1e-3: float32; GPU 0.1: a bf16 engine)")
    lm_eval: LmEvalTask | None = None
    require_recorded_baseline: bool = Field(False, description="GPU targets: a quantized run whose weights have no "
                                            "recorded bf16 baseline fails at once instead of recording it first "
                                            "(the none build of the same weights, staged, scored, removed)")

    @model_validator(mode="after")
    def _one_text(self) -> Evaluation:
        if self.text_file is not None and self.dataset is not None:
            raise ValueError("set at most one of evaluation.text_file or evaluation.dataset")
        if self.prompt_tokens >= self.window_tokens:
            raise ValueError("prompt_tokens must be shorter than window_tokens (prompts are cut from the windows)")
        return self
