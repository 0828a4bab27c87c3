"""The lm-evaluation-harness adapter against a served endpoint, checked against transformers.

An unquantized tiny Llama (stoker.workers.tinymodel) goes through stoker's build step and repository
assembly and is served by the real tritonserver (python backend, local). The worker runs as a child process
on stoker's local task; in this process the adapter's log-likelihoods, rolling log-likelihood and greedy
generation are compared with transformers' own, from the same checkpoint (1e-3).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("pytriton")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tokenizers import Tokenizer

from grpc_stream import serve_checkpoint

from stoker.evaluation.lm_eval_client import TritonLLMClient
from stoker.workers.lm_eval_run import load_lm
from stoker.workers.tinymodel import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-3
LIMIT = 5
PAIRS = [  # (context, continuation): a word boundary in the continuation, one in the context, and no context
    ("The quick brown fox", " jumps over the lazy dog"),
    ("She could not find her keys, so she checked the pockets of her", " coat."),
    ("The cat sat on the ", "mat"),
    ("", "Hello world"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    ckpt = root / "checkpoint"
    make_tiny_model(ckpt, seed=0)
    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with serve_checkpoint(ckpt, root) as (server, artifact):
        with TritonLLMClient(server.grpc_url) as client:
            yield {"server": server, "tokenizer": artifact / "tokenizer.json", "model": model, "client": client,
                   "tok": Tokenizer.from_file(str(ckpt / "tokenizer.json"))}


def _worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoker.workers.lm_eval_run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _hf_log_probs(served, ids: list[int]) -> np.ndarray:
    """transformers' log-softmax rows for ``ids`` (row i scores ids[i + 1]), float64."""
    with torch.no_grad():
        logits = served["model"](input_ids=torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def _expected(served, context: str, continuation: str) -> tuple[float, bool]:
    """Split as lm-eval's HF causal model does: a context's trailing spaces move to the continuation, whole
    text and context are encoded, the difference is scored; an empty context is the bos token."""
    tok = served["tok"]
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    if context:
        whole = tok.encode(context + continuation).ids
        split = len(tok.encode(context).ids)
    else:
        whole = [tok.token_to_id("<s>"), *tok.encode(continuation, add_special_tokens=False).ids]
        split = 1
    rows = _hf_log_probs(served, whole)[split - 1:-1]
    targets = whole[split:]
    return float(rows[np.arange(len(targets)), targets].sum()), rows.argmax(-1).tolist() == targets


def _requests(kind: str, *args: tuple) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_worker_scores_the_local_task(served, tmp_path) -> None:
    out = tmp_path / "result.json"
    proc = _worker("--grpc-url", served["server"].grpc_url, "--tokenizer", str(served["tokenizer"]),
                   "--task", "stoker_cloze", "--limit", str(LIMIT), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == record
    assert set(record) == {"task", "metric", "score", "stderr", "n", "lm_eval_version", "duration_s"}
    assert record["task"] == "stoker_cloze" and record["metric"] == "acc" and record["n"] == LIMIT
    assert 0 <= record["score"] <= 1 and record["stderr"] >= 0 and record["duration_s"] > 0
    assert record["lm_eval_version"] == "0.4.13"


def test_loglikelihood_is_transformers(served) -> None:
    lm = load_lm(served["client"], served["tokenizer"])
    got = lm.loglikelihood(_requests("loglikelihood", *PAIRS), disable_tqdm=True)
    for (log_prob, greedy), pair in zip(got, PAIRS, strict=True):
        expected, expected_greedy = _expected(served, *pair)
        assert log_prob == pytest.approx(expected, abs=TOL), pair
        assert greedy == expected_greedy, pair


def test_loglikelihood_rolling_is_transformers(served) -> None:
    """Short text, one window: every token scored once, the first given bos only."""
    text = "Triton serves models to anyone who asks."
    lm = load_lm(served["client"], served["tokenizer"])
    [got] = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", (text,)), disable_tqdm=True)
    assert got == pytest.approx(_expected(served, "", text)[0], abs=TOL)


def test_rolling_windows_score_every_token_once(served) -> None:
    """With a context of 8 tokens the text takes several of lm-eval's windows; their sum is transformers'
    log probs of each window's predicted tokens given that window's input."""
    tok, text = served["tok"], "After the rain stopped, the children ran outside to jump in the puddles."
    tokens = tok.encode(text, add_special_tokens=False).ids
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, tok.token_to_id("<s>"), 8, 1)]
    assert len(windows) > 2 and sum(len(pred) for _, pred in windows) == len(tokens)
    expected = 0.0
    for context, pred in windows:
        ids = (context + pred)[:-1]
        rows = _hf_log_probs(served, ids)[len(ids) - len(pred):]
        expected += float(rows[np.arange(len(pred)), pred].sum())
    lm = load_lm(served["client"], served["tokenizer"], max_length=8)
    [got] = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", (text,)), disable_tqdm=True)
    assert got == pytest.approx(expected, abs=TOL)


def test_generate_until_is_transformers_greedy_cut_at_until(served) -> None:
    prompt, budget = "The quick brown fox", 16
    tok = served["tok"]
    ids = tok.encode(prompt).ids
    with torch.no_grad():
        out = served["model"].generate(torch.tensor([ids]), max_new_tokens=budget, do_sample=False)
    text = tok.decode(out[0, len(ids):].tolist())
    until = text[len(text) // 2: len(text) // 2 + 2]  # a stop string inside the free run
    assert until.strip()
    lm = load_lm(served["client"], served["tokenizer"])
    [got] = lm.generate_until(_requests("generate_until", (prompt, {"until": [until], "max_gen_toks": budget})))
    assert got == text.split(until)[0]


def test_unknown_task_is_refused_in_one_line(tmp_path) -> None:
    proc = _worker("--grpc-url", "127.0.0.1:1", "--tokenizer", str(tmp_path / "tokenizer.json"),
                   "--task", "hellaswag", "--out", str(tmp_path / "result.json"))
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: unknown lm-eval task 'hellaswag'; known tasks: stoker_cloze"
    assert not (tmp_path / "result.json").exists()
