"""benchmark: streaming load against the deployed ensemble (tritonclient gRPC aio)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from prefect import get_run_logger
from tokenizers import Tokenizer

from stoker.bench.client import run_benchmark
from stoker.bench.workload import make_prompts
from stoker.digest import tree_records
from stoker.run import Output, RunContext, StepResult
from stoker.spec import Spec
from stoker.triton_config import ENSEMBLE_NAME

from . import step_task


@step_task("benchmark", retries=0)
def benchmark_endpoint(spec: Spec, deployed: StepResult, built: StepResult, ctx: RunContext) -> StepResult:
    """Warm up, then a fixed number of streamed requests at each concurrency level; never cached."""
    log = get_run_logger().info
    t0 = time.perf_counter()
    b = spec.benchmark
    tokenizer_json = built.path / "tokenizer.json"
    tok = Tokenizer.from_file(str(tokenizer_json))
    total = b.warmup_requests + b.requests_per_level * len(b.concurrency)
    prompts = make_prompts(max(total, 1), b.input_tokens, b.seed, tokenizer_json)
    result = run_benchmark(
        url=deployed.detail["grpc"], model=ENSEMBLE_NAME, prompts=prompts, max_tokens=b.output_tokens,
        concurrency_levels=b.concurrency, requests_per_level=b.requests_per_level,
        warmup_requests=b.warmup_requests, timeout_s=b.timeout_s,
        count_tokens=lambda text: len(tok.encode(text, add_special_tokens=False).ids), progress=log)
    out = ctx.run_dir / "benchmark"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "records.jsonl", "w") as f:  # raw records first, the summary is derived from them
        for r in result.records:
            f.write(json.dumps(asdict(r)) + "\n")
    levels = [lv.to_dict() for lv in result.levels]
    (out / "summary.json").write_text(json.dumps({"levels": levels}, indent=1))
    outputs = [Output(uri=(out / r.path).as_uri(), sha256=r.sha256, bytes=r.bytes) for r in tree_records(out)]
    return StepResult(name="benchmark", duration_s=time.perf_counter() - t0, outputs=outputs,
                      detail={"levels": levels})
