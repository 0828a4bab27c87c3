"""The evaluation's arithmetic and its verdict. Pure (numpy only), shared by the orchestrator and the
baseline worker, so candidate and baseline are scored by the same code.

- perplexity: exp of the mean negative log likelihood over every scored token of every window;
- greedy agreement: per prompt, the candidate's M greedy tokens against the baseline's, position by
  position. Once the two diverge, later tokens continue different texts, so they count as
  mismatches only where they differ (a rate of 1.0 means identical outputs);
- the verdict: one row per metric (candidate, baseline, Δ, threshold, pass), and a one-line cause
  naming the first metric that failed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np


def next_token_log_probs(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """log softmax(logits[i])[ids[i + 1]] for a window's context logits [len(ids), vocab] → [len(ids) - 1]."""
    rows = np.asarray(logits, dtype=np.float64)[: len(ids) - 1]
    peak = rows.max(axis=-1, keepdims=True)
    log_z = peak[:, 0] + np.log(np.exp(rows - peak).sum(axis=-1))
    return rows[np.arange(len(ids) - 1), ids[1:]] - log_z


def perplexity(window_log_probs: list[list[float]]) -> float:
    scored = [lp for window in window_log_probs for lp in window]
    return math.exp(-sum(scored) / len(scored))


def agreement(candidate: list[list[int]], baseline: list[list[int]]) -> dict:
    """Token match rate, mean position of first divergence (M when none) and exact matches."""
    if len(candidate) != len(baseline):
        raise ValueError(f"{len(candidate)} candidate outputs for {len(baseline)} baseline outputs")
    matched = total = exact = 0
    first: list[int] = []
    for cand, base in zip(candidate, baseline):
        n = len(base)
        same = [i < len(cand) and cand[i] == base[i] for i in range(n)]
        matched += sum(same)
        total += n
        exact += int(all(same) and len(cand) == n)
        first.append(next((i for i, ok in enumerate(same) if not ok), n))
    return {"token_match_rate": matched / total if total else 1.0,
            "mean_first_divergence": sum(first) / len(first) if first else 0.0,
            "exact_matches": exact, "prompts": len(baseline)}


@dataclass(frozen=True)
class Row:
    metric: str
    candidate: float | None
    baseline: float | None
    delta: str
    threshold: str
    passed: bool | None  # None: reported, not gated

    def cells(self) -> dict:
        return {**asdict(self), "passed": {True: "pass", False: "FAIL", None: "—"}[self.passed]}

    def named(self, prefix: str) -> Row:
        """The same row for one LoRA adapter (its metric prefixed with the adapter's name)."""
        return replace(self, metric=prefix + self.metric)


def _pct(new: float, old: float) -> float:
    return (new - old) / old * 100.0 if old else math.inf


def verdict(candidate: dict, baseline: dict, limits: dict) -> tuple[list[Row], str | None]:
    """Rows for the table and the first failure's one-line cause (None when everything passed).

    candidate/baseline: {"perplexity", "agreement"?, "task"?}; limits: the spec's evaluation thresholds.
    """
    rows: list[Row] = []
    causes: list[str] = []
    ppl, base_ppl = candidate["perplexity"], baseline["perplexity"]
    limit = limits.get("max_perplexity_rise_pct")
    if ppl is None:  # the serving build cannot return context logits (see Target.scores_perplexity)
        rise, ok = math.nan, None
        rows.append(Row("perplexity", None, base_ppl, "n/a", "not measured: no context logits", None))
    else:
        rise = _pct(ppl, base_ppl)
        ok = None if limit is None else rise <= limit
        rows.append(Row("perplexity", ppl, base_ppl, f"{rise:+.2f}%", "—" if limit is None else f"≤ +{limit:g}%",
                        ok))
    if ok is False:
        causes.append(f"perplexity rose {rise:.1f}% over the unquantized build ({ppl:.4g} vs {base_ppl:.4g}; "
                      f"limit {limit:g}%, evaluation.max_perplexity_rise_pct)")
    agree = candidate.get("agreement")
    if agree is not None:
        rate, floor = agree["token_match_rate"], limits.get("min_greedy_agreement")
        ok = None if floor is None else rate >= floor
        rows.append(Row("greedy agreement", rate, 1.0, f"{rate - 1.0:+.3f}", "—" if floor is None else f"≥ {floor:g}",
                        ok))
        rows.append(Row("mean first divergence (tokens)", agree["mean_first_divergence"], None, "—", "—", None))
        rows.append(Row("exact matches", agree["exact_matches"], agree["prompts"], "—", "—", None))
        if ok is False:
            causes.append(f"greedy agreement {rate:.3f} with the unquantized build is below "
                          f"{floor:g} (evaluation.min_greedy_agreement)")
    task = candidate.get("task")
    if task is not None:
        floor = limits.get("min_task_score")
        ok = None if floor is None else task["score"] >= floor
        base_task = baseline.get("task")
        rows.append(Row(f"{task['task']} {task['metric']}", task["score"],
                        base_task["score"] if base_task else None, "—", "—" if floor is None else f"≥ {floor:g}", ok))
        if ok is False:
            causes.append(f"{task['task']} {task['metric']} {task['score']:.3f} is below {floor:g} "
                          f"(evaluation.lm_eval.min_score)")
    return rows, (f"evaluation failed: {causes[0]}" if causes else None)


def markdown(rows: list[Row]) -> str:
    def fmt(v) -> str:
        return "—" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    lines = ["| metric | candidate | baseline | Δ | threshold | pass |", "|---|---:|---:|---:|---|---|"]
    lines += [f"| {r.metric} | {fmt(r.candidate)} | {fmt(r.baseline)} | {r.delta} | {r.threshold} | "
              f"{r.cells()['passed']} |" for r in rows]
    return "\n".join(lines) + "\n"
