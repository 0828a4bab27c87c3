"""The unquantized baseline of an evaluation, in a child process (it imports torch and transformers):

    python -m stoker.workers.evaluate_baseline --request REQUEST.json --out BASELINE.json

REQUEST: {"checkpoint": the fetched HF checkpoint, "evalset": stoker.evaluation.data.EvalSet.to_dict(),
"tolerance": nats, optional "adapters": {name: folder}: each LoRA adapter scored too, on the same unquantized
build, into "adapters": {name: scores} (the runtime applies them as PEFT does: tests/unit/test_lora.py)}; GPU targets (by contract, not run here) add "served": the bf16 build's own window log
probs as measured through its endpoint, and only the check against transformers runs.

The `none` build is made here, by the reference build step's own code (stoker/workers/build_reference.py)
into a temporary folder: one process and one torch import instead of two, since on a 2-core machine the
baseline competes with the candidate's start. It is then run by stoker's own runtime (stoker/runtime, the code Triton's python backend
runs), so its numbers are what the served unquantized build would answer: per-window next-token log
probabilities and, per prompt, M greedy tokens under the same rules a served request gets
(min_tokens = M, top_k 1, the build's stop ids). Then the same windows go through transformers'
own model class on the fetched checkpoint, and the largest |Δ log prob| must stay within the
tolerance: a runtime bug cannot hide by agreeing with itself.

Writes BASELINE.json atomically and prints one JSON line; exit 1 with a one-line error otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from stoker.evaluation.data import EvalSet
from stoker.evaluation.metrics import next_token_log_probs, perplexity


class BaselineError(RuntimeError):
    pass


def runtime_scores(artifact: Path, evalset: EvalSet, adapters: dict[str, str] | None = None) -> dict:
    from stoker.runtime.generate import generate
    from stoker.runtime.model import load_model

    model = load_model(artifact, num_threads=None, adapters={n: Path(f) for n, f in (adapters or {}).items()})
    stop_ids = json.loads((artifact / "stoker_runtime.json").read_text()).get("stop_ids", [])

    def scores(adapter: str | None) -> dict:
        windows = [next_token_log_probs(model.forward(w, model.new_cache(adapter)).numpy(), w).tolist()
                   for w in evalset.windows]
        m = evalset.greedy_tokens
        greedy = [list(generate(model, p, m, model.info.end_id, top_k=1, min_new_tokens=m,
                                stop_words=[[i] for i in stop_ids], adapter=adapter)) for p in evalset.prompts]
        return {"window_log_probs": windows, "perplexity": perplexity(windows), "greedy": greedy}

    out = {**scores(None), "architecture": model.architecture}
    if adapters:
        out["adapters"] = {name: scores(name) for name in sorted(adapters)}
    return out


def transformers_log_probs(checkpoint: Path, evalset: EvalSet) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU host checks its bf16 build on its GPU
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, local_files_only=True)
    model = model.to(device).eval()
    with torch.inference_mode():
        return [next_token_log_probs(model(input_ids=torch.tensor([w], device=device)).logits[0].float().cpu()
                                     .numpy(), w).tolist() for w in evalset.windows]


def unquantized_scores(checkpoint: Path, evalset: EvalSet, adapters: dict[str, str] | None = None) -> dict:
    import tempfile

    from stoker.workers.build_reference import build

    with tempfile.TemporaryDirectory(prefix="stoker-baseline-") as tmp:
        files = build(checkpoint, Path(tmp) / "none")
        scores = runtime_scores(Path(tmp) / "none", evalset, adapters)
    return {**scores, "build_files": files}


def run(request: dict) -> dict:
    t0 = time.perf_counter()
    evalset = EvalSet.from_dict(request["evalset"])
    checkpoint = Path(request["checkpoint"])
    served = (request["served"] if "served" in request
              else unquantized_scores(checkpoint, evalset, request.get("adapters")))
    tolerance = float(request["tolerance"])
    if not served["window_log_probs"]:  # a GPU build served without context logits: nothing to compare
        return {**served, "check": {"max_abs_log_prob_diff": None, "tolerance": tolerance, "passed": None,
                                    "positions": 0, "against": "nothing: the build served no context logits"},
                "duration_s": time.perf_counter() - t0}
    reference = transformers_log_probs(checkpoint, evalset)
    diff = max(abs(a - b) for ws, wr in zip(served["window_log_probs"], reference) for a, b in zip(ws, wr))
    check = {"max_abs_log_prob_diff": diff, "tolerance": tolerance, "passed": diff <= tolerance,
             "positions": sum(len(w) for w in reference), "against": "transformers"}
    if not check["passed"]:
        raise BaselineError(f"the unquantized build as served differs from transformers by {diff:.3g} nats in log "
                            f"prob (tolerance {tolerance:g}): the runtime, not the quantization, is wrong")
    return {**served, "check": check, "duration_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        result = run(json.loads(args.request.read_text()))
    except (BaselineError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, args.out)
    print(json.dumps({"perplexity": result["perplexity"], "check": result["check"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
