"""evaluate: is the candidate still the model it was quantized from? Measured through its endpoint.

Two sources of the unquantized baseline, as the target says (Target.baseline_source):
- "runtime" (reference): the `none` build, run by stoker's runtime in a child process.
- "recorded" (GPU targets, by contract: not run here): the bf16 (`none`) build of the same weights, as
  measured through its own endpoint and checked against transformers, recorded in S3 by the run that
  served it; a quantized run without that record is refused at eval-data, before the GPU build.

eval-data (after fetch, before any heavy step): the held-out text as token ids of the model's own
tokenizer, or a one-line refusal.
baseline: the `none` build of the same revision (cached quantize/build steps) scored by stoker's
runtime in a child process and checked against transformers; cached by weights, data and code.
evaluate: the candidate's perplexity and greedy outputs through its served `tensorrt_llm`, plus the
optional lm-eval task; cached by the served repository's digest. The verdict against the spec's
thresholds is judged every run, so changing a threshold never needs a re-measurement.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact

from stoker import targets
from stoker.storage import s3
from stoker.orchestration.child import run_module
from stoker.errors import EvaluationFailed, StepError
from stoker.evaluation import metrics
from stoker.evaluation.data import EvalSet
from stoker.evaluation.source import evalset as make_evalset
from stoker.cache.keys import baseline_key, evaluate_key, step_key
from stoker.atomic import write_atomic
from stoker.run import RunContext, StepResult, cached_step
from stoker.spec.schema import Spec

from . import step_task

CANDIDATE_FILE = "candidate.json"
BASELINE_FILE = "baseline.json"
TASK_FILE = "lm_eval.json"


@step_task("eval-data", retries=0)
def evaluation_data(spec: Spec, fetched: StepResult, ctx: RunContext, lora: StepResult | None = None) -> StepResult:
    """The evaluation set, and whether the recorded bf16 baseline it needs exists (GPU targets): recorded per
    weights, and per adapter set where the spec has adapters (``lora``: each adapter is judged against the same
    adapter on the bf16 build)."""
    t0 = time.perf_counter()
    logger = get_run_logger()
    evalset, warnings = make_evalset(spec, fetched.path / "tokenizer.json", ctx.run_dir / "eval-data")
    for w in warnings:
        logger.warning(w)
    record_of = fetched.digest + (f"-lora-{lora.digest[:16]}" if lora is not None else "")
    record = require_record(spec, record_of, evalset.digest)
    tokens = sum(len(w) for w in evalset.windows)
    logger.info(f"eval-data: {len(evalset.windows)} windows ({tokens} tokens), {len(evalset.prompts)} prompts × "
                f"{evalset.greedy_tokens} tokens from {evalset.source}")
    return StepResult(name="eval-data", duration_s=time.perf_counter() - t0,
                      detail={"evalset": evalset.to_dict(), "digest": evalset.digest, "warnings": warnings,
                              "baseline_record": record, "record_of": record_of})


@step_task("baseline", retries=1)
def baseline_reference(spec: Spec, fetched: StepResult, eval_data: StepResult, ctx: RunContext,
                       lora: StepResult | None = None) -> StepResult:
    """The unquantized (`none`) build of these weights, made and scored in one child process; ``lora``: the
    fetched adapters, each scored on that build too."""
    log = get_run_logger().info
    tolerance = targets.get(spec.target).tolerance(spec)
    adapters = {name: str(Path(lora.path) / name) for name in lora.detail["adapters"]} if lora else {}

    def produce(out: Path) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            request = Path(tmp) / "request.json"
            request.write_text(json.dumps({"checkpoint": str(fetched.path), "evalset": eval_data.detail["evalset"],
                                           "tolerance": tolerance, "adapters": adapters}))
            # Niced: it runs while the candidate's Triton starts, and should take only the CPU that leaves idle.
            run_module("stoker.workers.evaluate_baseline", ["--request", str(request), "--out",
                                                            str(out / BASELINE_FILE)], log, nice=10)
        result = json.loads((out / BASELINE_FILE).read_text())
        return {"perplexity": result["perplexity"], "check": result["check"], "build_files": result["build_files"]}

    key = baseline_key(fetched.digest, eval_data.detail["digest"], tolerance, lora.digest if lora else None)
    return cached_step(ctx, "baseline", key, produce, log)


def record_key(spec: Spec, weights_digest: str, evalset_digest: str) -> str:
    """Per target: the engine and the LLM API serve the same weights through different runtimes."""
    return f"{spec.storage.prefix}/evaluation/baselines/{spec.target}/{weights_digest}/{evalset_digest}.json"


def needs_record(spec: Spec) -> bool:
    return targets.get(spec.target).baseline_source == "recorded" and spec.quantization.format != "none"


def recorded_baseline(spec: Spec, weights_digest: str, evalset_digest: str) -> dict | None:
    st = spec.storage
    if st.create_bucket:  # a bucket the upload will create may not exist yet: then nothing is recorded in it
        s3.ensure_bucket(s3.client(st), st, create=True)
    return s3.get_json(s3.client(st), st, record_key(spec, weights_digest, evalset_digest))


def require_record(spec: Spec, weights_digest: str, evalset_digest: str) -> str | None:
    """Whether a quantized build on a GPU target has its weights' bf16 baseline: "present", "missing" (the target
    records it first), None (not needed); with evaluation.require_recorded_baseline a missing one fails here,
    before the GPU build."""
    if not needs_record(spec):
        return None
    if recorded_baseline(spec, weights_digest, evalset_digest) is not None:
        return "present"
    if spec.evaluation.require_recorded_baseline:
        raise StepError(f"evaluation: no bf16 baseline recorded for these weights and evaluation set "
                        f"(s3://{spec.storage.bucket}/{record_key(spec, weights_digest, evalset_digest)}) and "
                        "evaluation.require_recorded_baseline is true: run this spec once with quantization.format "
                        "none, or drop the setting to have it recorded first")
    return "missing"


@step_task("baseline", retries=1)
def baseline_recorded(spec: Spec, fetched: StepResult, eval_data: StepResult, ctx: RunContext) -> StepResult:
    """GPU targets (by contract): the recorded bf16 baseline; a `none` run measures its own (detail "self")."""
    t0 = time.perf_counter()
    if spec.quantization.format == "none":
        return StepResult(name="baseline", duration_s=time.perf_counter() - t0, detail={"self": True})
    record_of = eval_data.detail.get("record_of", fetched.digest)
    record = recorded_baseline(spec, record_of, eval_data.detail["digest"])
    if record is None:  # eval-data checked it; it went away since
        raise StepError(f"evaluation: the bf16 baseline record {record_key(spec, record_of, '…')} vanished")

    def produce(out: Path) -> dict:
        (out / BASELINE_FILE).write_text(json.dumps(record))
        return {"perplexity": record["perplexity"], "check": record["check"]}

    key = step_key("baseline", inputs={"record": record_key(spec, record_of, eval_data.detail["digest"])},
                   config={"perplexity": record["perplexity"]}, versions={})
    return cached_step(ctx, "baseline", key, produce, get_run_logger().info)


def _self_baseline(spec: Spec, fetched: StepResult, eval_data: StepResult, measured: dict, out: Path, log) -> None:
    """A `none` build on a GPU target is its own baseline once it matches transformers (child process)."""
    with tempfile.TemporaryDirectory() as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"served": measured, "checkpoint": str(fetched.path),
                                       "evalset": eval_data.detail["evalset"],
                                       "tolerance": targets.get(spec.target).tolerance(spec)}))
        run_module("stoker.workers.evaluate_baseline", ["--request", str(request), "--out", str(out / BASELINE_FILE)],
                   log)


@step_task("evaluate", retries=0)
def evaluate_candidate(spec: Spec, served: StepResult, packaged: StepResult, fetched: StepResult,
                       eval_data: StepResult, baseline: StepResult, ctx: RunContext) -> StepResult:
    """Measure (or reuse the measurement of) the served candidate, then judge it against the baseline."""
    t0 = time.perf_counter()
    logger = get_run_logger()
    ev = spec.evaluation
    evalset = EvalSet.from_dict(eval_data.detail["evalset"])
    task = ev.lm_eval.model_dump(mode="json", exclude={"min_score"}) if ev.lm_eval else None

    def produce(out: Path) -> dict:
        from stoker.evaluation.endpoint import score, score_text

        target = targets.get(spec.target)
        if target.interface.token_ids:
            measured = score(served.detail["grpc"], evalset, logger.info, context_logits=target.scores_perplexity(spec))
            adapters = packaged.detail.get("adapters") or {}  # name → task id, as the package step laid them
            if adapters:
                measured["adapters"] = {name: score(served.detail["grpc"], evalset, logger.info, lora_task_id=task_id,
                                                    context_logits=target.scores_perplexity(spec))
                                        for name, task_id in sorted(adapters.items())}
        else:
            measured = score_text(served.detail["http"], evalset, fetched.path / "tokenizer.json", target.interface,
                                  logger.info)
        (out / CANDIDATE_FILE).write_text(json.dumps(measured))
        if baseline.detail.get("self"):
            _self_baseline(spec, fetched, eval_data, measured, out, logger.info)
        if task:
            run_module("stoker.workers.lm_eval_run", [
                "--grpc-url", served.detail["grpc"], "--tokenizer", str(fetched.path / "tokenizer.json"),
                "--task", task["task"], "--limit", str(task["limit"]), "--out", str(out / TASK_FILE)], logger.info)
        return {"perplexity": measured["perplexity"]}

    measured = cached_step(ctx, "evaluate", evaluate_key(packaged.digest, evalset.digest, task), produce, logger.info)
    scores = json.loads((measured.path / CANDIDATE_FILE).read_text())
    own = baseline.detail.get("self")
    base = json.loads(((measured.path if own else baseline.path) / BASELINE_FILE).read_text())
    if own:  # recorded for the quantized builds of these weights (GPU targets)
        st = spec.storage
        s3.put_json(s3.client(st), st, record_key(spec, eval_data.detail.get("record_of", fetched.digest),
                                                  evalset.digest), base)
    candidate = {"perplexity": scores["perplexity"], "agreement": metrics.agreement(scores["greedy"], base["greedy"])}
    if task:
        candidate["task"] = json.loads((measured.path / TASK_FILE).read_text())
    limits = {"max_perplexity_rise_pct": ev.max_perplexity_rise_pct, "min_greedy_agreement": ev.min_greedy_agreement,
              "min_task_score": ev.lm_eval.min_score if ev.lm_eval else None}
    rows, failure = metrics.verdict(candidate, base, limits)
    if base["check"].get("passed") is None:  # kept as the reference, said to be unchecked wherever it is shown
        logger.warning(f"evaluate: the baseline is NOT checked against transformers ({base['check']['against']}); "
                       "the gates compare with it as served")
    # Each LoRA adapter on the candidate against the same adapter on the unquantized build; a failure names it.
    for name, scored in sorted((scores.get("adapters") or {}).items()):
        ref = base["adapters"][name]
        mine = {"perplexity": scored["perplexity"], "agreement": metrics.agreement(scored["greedy"], ref["greedy"])}
        candidate.setdefault("adapters", {})[name] = mine
        adapter_rows, adapter_failure = metrics.verdict(mine, ref, {**limits, "min_task_score": None})
        rows += [r.named(f"{name}: ") for r in adapter_rows]
        failure = failure or (f"adapter {name}: {adapter_failure}" if adapter_failure else None)
    table = metrics.markdown(rows)
    write_atomic(ctx.run_dir / "evaluation.md", table)
    create_table_artifact([r.cells() for r in rows], key=f"stoker-{spec.deploy.name}-evaluation",
                          description=f"evaluation against the unquantized build ({evalset.source})")
    detail = {"passed": failure is None, "cause": failure, "cache_hit": measured.cache_hit,
              "candidate": candidate, "baseline": {"perplexity": base["perplexity"], "check": base["check"]},
              "thresholds": limits, "data": {"source": evalset.source, "digest": evalset.digest,
                                             "windows": len(evalset.windows), "prompts": len(evalset.prompts),
                                             "greedy_tokens": evalset.greedy_tokens},
              "rows": [r.cells() for r in rows], "table": table, "measure_s": round(measured.duration_s, 3)}
    logger.info(f"evaluate {'passed' if failure is None else 'FAILED'} "
                f"({'cache hit' if measured.cache_hit else 'measured'}):\n{table}")
    if failure:
        raise EvaluationFailed(failure, detail)
    return StepResult(name="evaluate", duration_s=time.perf_counter() - t0, key=measured.key,
                      digest=measured.digest, path=measured.path, cache_hit=measured.cache_hit, detail=detail)
