"""Score a served endpoint on one of stoker's local lm-evaluation-harness tasks.

    python -m stoker.workers.lm_eval_run --grpc-url HOST:PORT --tokenizer DIR/tokenizer.json --task NAME \
        [--limit N] [--max-length N] --out result.json

A child process because lm-eval pulls in datasets, pandas and pyarrow (~3 s to start), which the
orchestrator never loads. The model is the endpoint's `tensorrt_llm` model, over one gRPC stream, fed the token
ids of the build's own tokenizer (tokenizer.json; its tokenizer_config.json and config.json beside it give the
bos/eos tokens and the context length). Tasks come from stoker/data/lm_eval/ only, offline.

Writes {"task", "metric", "score", "stderr", "n", "lm_eval_version", "duration_s"} atomically to --out (stderr
null when lm-eval gives none) and prints it as one JSON line; a failure exits 1 with a one-line cause.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer

from stoker.errors import StokerError
from stoker.evaluation.lm_eval_client import TritonLLMClient, continuation_log_prob
from stoker.evaluation.lm_tasks import check_task, task_dir
from stoker.workers import run_cli

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF model's default


class LmEvalError(StokerError):
    """The evaluation cannot run (tokenizer files, task, results)."""


class ServedLM(TemplateLM):
    """lm-eval's model interface over a served `tensorrt_llm` model; tokenization as lm-eval's HF causal model."""

    def __init__(self, client: TritonLLMClient, tokenizer: Tokenizer, max_length: int, eos_id: int,
                 bos_id: int | None = None) -> None:
        super().__init__()
        self.client, self.tokenizer, self.max_length = client, tokenizer, max_length
        self._eos_id, self._bos_id = eos_id, bos_id

    @property
    def eot_token_id(self) -> int:
        return self._eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._eos_id if self._bos_id is None else self._bos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:  # the tokenizer's own template, unless the text already starts with bos
            add_special_tokens = self._bos_id is None or not string.startswith(self.tokenizer.id_to_token(self._bos_id))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        results = []
        for key, context, continuation in requests:
            # As lm-eval's HF model: the last max_length tokens of context + continuation, less the last token.
            ids = (context + continuation)[-(self.max_length + 1):][:-1]
            logits = self.client.context_logits(ids)
            result = continuation_log_prob(logits[len(ids) - len(continuation):], continuation)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (string,) in [request.args for request in requests]:
            # Without the tokenizer's bos: the first window is conditioned on prefix_token_id already.
            windows = map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string, add_special_tokens=False), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))
            total = sum(log_prob for log_prob, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            totals.append(total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy only (sampling kwargs are ignored); the whole budget is generated, then cut at `until`."""
        eos = self.tokenizer.id_to_token(self._eos_id)
        outputs = []
        for context, gen_kwargs in [request.args for request in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = kwargs["max_gen_toks"]
            if max_gen_toks >= self.max_length:
                raise LmEvalError(f"max_gen_toks {max_gen_toks} leaves no room within max length {self.max_length}")
            ids = self.tok_encode(context)[-(self.max_length - max_gen_toks):]
            text = self.tokenizer.decode(self.client.generate(ids, max_gen_toks))
            for term in until:
                if term:
                    text = text.split(term)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            outputs.append(text)
        return outputs


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LmEvalError(f"cannot read {path}: {exc}") from None


def _token_id(tokenizer: Tokenizer, config: dict[str, Any], key: str) -> int | None:
    """The id of tokenizer_config.json's bos_token / eos_token (a string or {"content": ...})."""
    value = config.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    return tokenizer.token_to_id(text) if isinstance(text, str) else None


def load_lm(client: TritonLLMClient, tokenizer_path: Path, max_length: int | None = None) -> ServedLM:
    """The adapter for the build whose tokenizer.json is ``tokenizer_path``."""
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exception subclasses
        raise LmEvalError(f"cannot load {tokenizer_path}: {exc}") from None
    config = _read_json(tokenizer_path.parent / "tokenizer_config.json")
    eos_id = _token_id(tokenizer, config, "eos_token")
    if eos_id is None:
        raise LmEvalError(f"{tokenizer_path.parent / 'tokenizer_config.json'} names no eos_token in the vocabulary")
    if max_length is None:
        # The runtime wants prompt + one generated token within max_position_embeddings.
        model_config = _read_json(tokenizer_path.parent / "config.json")
        max_length = int(model_config.get("max_position_embeddings", 0)) - 1
    if max_length < 2:
        raise LmEvalError(f"max length {max_length} is too short to score anything")
    return ServedLM(client, tokenizer, max_length, eos_id, _token_id(tokenizer, config, "bos_token"))


def _primary(task_results: dict[str, Any]) -> tuple[str, float, float | None]:
    """The task's first metric (metric_list order): name, score, stderr."""
    for key, value in task_results.items():
        metric, _, filter_name = key.partition(",")
        if filter_name and "_stderr" not in metric and isinstance(value, (int, float)):
            stderr = task_results.get(f"{metric}_stderr,{filter_name}")
            return metric, float(value), float(stderr) if isinstance(stderr, (int, float)) else None
    raise LmEvalError(f"lm-eval returned no metric: {sorted(task_results)}")


def evaluate(grpc_url: str, tokenizer_path: Path, task: str, limit: int | None = None,
             max_length: int | None = None) -> dict[str, Any]:
    """Run ``task`` against the endpoint; the result record (not written anywhere)."""
    check_task(task)
    if limit is not None and limit < 1:
        raise LmEvalError(f"--limit must be at least 1, got {limit}")
    # Before lm-eval imports datasets, huggingface_hub and tqdm, which read these once: offline, and no
    # progress bars (this runs as a child whose every line goes into the run's log).
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TQDM_DISABLE", "1")
    import logging

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-run notes are not the user's business
    import lm_eval
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    started = time.monotonic()
    with TritonLLMClient(grpc_url) as client:
        lm = load_lm(client, tokenizer_path, max_length)
        loaded = TaskManager(include_path=str(task_dir()), include_defaults=False).load([task])
        results = evaluator.evaluate(lm, loaded, limit=limit, log_samples=False)
    if not results or task not in results.get("results", {}):
        raise LmEvalError(f"lm-eval returned no results for {task}")
    metric, score, stderr = _primary(results["results"][task])
    return {"task": task, "metric": metric, "score": score, "stderr": stderr,
            "n": int(results["n-samples"][task]["effective"]), "lm_eval_version": lm_eval.__version__,
            "duration_s": round(time.monotonic() - started, 3)}


def write_atomic(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Score a served endpoint on a local lm-eval task.")
    parser.add_argument("--grpc-url", required=True, help="HOST:PORT of the Triton server's gRPC endpoint")
    parser.add_argument("--tokenizer", type=Path, required=True, help="the build's tokenizer.json")
    parser.add_argument("--task", required=True)
    parser.add_argument("--limit", type=int, default=None, help="score only the first N docs")
    parser.add_argument("--max-length", type=int, default=None,
                        help="context length in tokens (default: config.json's max_position_embeddings - 1)")
    parser.add_argument("--out", type=Path, required=True, help="result JSON, written atomically")
    args = parser.parse_args(argv)

    def work() -> dict[str, Any]:
        record = evaluate(args.grpc_url, args.tokenizer, args.task, args.limit, args.max_length)
        write_atomic(args.out, record)
        return record

    return run_cli(work)


if __name__ == "__main__":
    sys.exit(main())
