"""The evaluation's pure parts: metrics and verdict, the evaluation set, the spec section and its
plan-time refusals (each one line, before any download of weights)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stoker.errors import SpecError
from stoker.evaluation import metrics
from stoker.evaluation.data import EvalDataError, cut, read_text, same_text
from stoker.cache.keys import DEFAULT_CALIBRATION
from stoker.plan.compose import check_evaluation
from stoker.spec.load import parse_spec

BASE = {"model": {"repo_id": "org/tiny"}, "storage": {"bucket": "bucket-a"}}


def spec(**evaluation):
    return parse_spec({**BASE, "quantization": {"format": "fp8"}, "evaluation": evaluation})


def test_next_token_log_probs_is_log_softmax_at_the_following_ids():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 11)).astype(np.float32)
    ids = [3, 1, 4, 1, 5]
    got = metrics.next_token_log_probs(logits, ids)
    for i in range(4):
        row = logits[i].astype(np.float64)
        expected = row[ids[i + 1]] - math.log(np.exp(row).sum())
        assert got[i] == pytest.approx(expected, abs=1e-9)
    assert got.shape == (4,)


def test_perplexity_of_a_uniform_model_is_its_vocabulary():
    vocab = 7
    windows = [[-math.log(vocab)] * 5, [-math.log(vocab)] * 3]
    assert metrics.perplexity(windows) == pytest.approx(vocab)


def test_agreement_counts_positions_first_divergence_and_exact_matches():
    base = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    cand = [[1, 2, 3, 4], [5, 0, 7, 8], [9, 9]]  # one mismatch; one stopped early
    a = metrics.agreement(cand, base)
    assert a["token_match_rate"] == pytest.approx(9 / 12)
    assert a["mean_first_divergence"] == pytest.approx((4 + 1 + 2) / 3)
    assert a["exact_matches"] == 1 and a["prompts"] == 3
    with pytest.raises(ValueError):
        metrics.agreement(cand[:2], base)


def test_verdict_names_the_failing_metric_in_one_line():
    cand = {"perplexity": 130.0, "agreement": {"token_match_rate": 0.4, "mean_first_divergence": 2.0,
                                               "exact_matches": 0, "prompts": 8}}
    rows, cause = metrics.verdict(cand, {"perplexity": 100.0},
                                  {"max_perplexity_rise_pct": 50.0, "min_greedy_agreement": 0.5})
    assert cause is not None and "\n" not in cause
    assert "greedy agreement 0.400" in cause and "evaluation.min_greedy_agreement" in cause
    assert [r.passed for r in rows if r.metric in ("perplexity", "greedy agreement")] == [True, False]
    _, cause = metrics.verdict(cand, {"perplexity": 100.0}, {"max_perplexity_rise_pct": 10.0})
    assert cause.startswith("evaluation failed: perplexity rose 30.0%")
    rows, cause = metrics.verdict(cand, {"perplexity": 100.0}, {})  # no thresholds: reported, not gated
    assert cause is None and all(r.passed is None for r in rows)
    table = metrics.markdown(rows)
    assert table.splitlines()[0].startswith("| metric | candidate | baseline")


def test_verdict_gates_the_lm_eval_score():
    cand = {"perplexity": 10.0, "task": {"task": "stoker_cloze", "metric": "acc", "score": 0.25}}
    _, cause = metrics.verdict(cand, {"perplexity": 10.0}, {"min_task_score": 0.3})
    assert "stoker_cloze acc 0.250 is below 0.3" in cause


def test_cut_makes_windows_and_prompts_from_their_openings():
    ids = list(range(50))
    s = cut(ids, window_tokens=16, max_windows=8, prompts=5, prompt_tokens=4, greedy_tokens=3, source="x")
    assert s.windows == [ids[0:16], ids[16:32], ids[32:48]]
    assert s.prompts == [ids[0:4], ids[16:20], ids[32:36], ids[0:4], ids[16:20]]
    assert s.digest == cut(ids, 16, 8, 5, 4, 3, "elsewhere").digest  # the ids count, not the label
    with pytest.raises(EvalDataError, match="shorter than one window"):
        cut(ids[:10], 16, 8, 5, 4, 3, "x")


def test_read_text_jsonl_and_refusals(tmp_path):
    p = tmp_path / "eval.jsonl"
    p.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert read_text(p) == "one\n\ntwo"
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(EvalDataError, match="no string field 'text'"):
        read_text(tmp_path / "bad.jsonl")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(EvalDataError, match="is empty"):
        read_text(tmp_path / "empty.txt")


def test_same_text_ignores_whitespace_and_catches_containment():
    assert same_text("a  b\nc", "a b c")
    assert same_text("b c", "a b c d")
    assert not same_text("a b", "c d")


@pytest.mark.parametrize("evaluation, needle", [
    ({"max_perplexity_rise_pct": -1}, "evaluation.max_perplexity_rise_pct"),
    ({"min_greedy_agreement": 1.5}, "evaluation.min_greedy_agreement"),
    ({"baseline_tolerance": 0}, "evaluation.baseline_tolerance"),
    ({"prompt_tokens": 64, "window_tokens": 64}, "prompt_tokens must be shorter"),
    ({"text_file": "a.txt", "dataset": {"repo_id": "org/data", "path": "x.txt"}}, "at most one"),
    ({"dataset": {"repo_id": "org/data", "path": "x.parquet"}}, ".txt or .jsonl"),
    ({"bogus": 1}, "evaluation.bogus: unknown key"),
    ({"lm_eval": {"task": "hellaswag"}}, "unknown lm-eval task 'hellaswag'; known tasks: stoker_cloze"),
    ({"lm_eval": {"task": "stoker_cloze", "min_score": 2}}, "evaluation.lm_eval.min_score"),
])
def test_bad_evaluation_sections_are_refused_in_one_line(evaluation, needle):
    with pytest.raises(SpecError) as err:
        spec(**evaluation)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("content, needle", [
    (None, "no such file"),
    ("   \n", "is empty"),
    ("too short", "shorter than one window"),
])
def test_evaluation_text_refused_at_plan(tmp_path, content, needle):
    path = tmp_path / "eval.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecError) as err:
        check_evaluation(spec(text_file=str(path)))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_calibration_text_as_evaluation_text_warns():
    warnings = check_evaluation(spec(text_file=str(DEFAULT_CALIBRATION)))
    assert len(warnings) == 1 and "optimistic" in warnings[0]
    assert check_evaluation(spec()) == []  # the bundled evaluation text is not the calibration text
    assert check_evaluation(spec(enabled=False, text_file="/nonexistent")) == []
