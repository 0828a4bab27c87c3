"""The regression gate: this run's summary against the baseline of the deployment's last promoted run.

Pure: the caller loads the baseline (S3) and decides what a failure does (the flow fails and does not
promote). Levels are matched by mode and concurrency/rate; a level the baseline lacks is not judged.
A baseline measured with another workload (lengths, protocol, mode) is not comparable: the gate
then passes and says so, and the promoted run becomes the new baseline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import GateFailed
from .output import level_label


@dataclass(frozen=True)
class Rule:
    """`metric` (dotted path into a level summary) may not get worse by more than `limit_pct`."""

    metric: str
    higher_is_better: bool
    limit_pct: float


@dataclass(frozen=True)
class Thresholds:
    """Allowed change against the baseline, in percent; None switches a check off."""

    output_tokens_per_s_drop_pct: float | None = 5.0
    ttft_p99_rise_pct: float | None = 10.0
    itl_p99_rise_pct: float | None = None
    e2e_p99_rise_pct: float | None = None
    max_error_rate_pct: float | None = 0.0  # absolute: failed requests / requests, not relative to the baseline

    def rules(self) -> list[Rule]:
        pairs = (("output_tokens_per_s", True, self.output_tokens_per_s_drop_pct),
                 ("ttft_ms.p99", False, self.ttft_p99_rise_pct),
                 ("itl_ms.p99", False, self.itl_p99_rise_pct),
                 ("e2e_ms.p99", False, self.e2e_p99_rise_pct))
        return [Rule(m, better, limit) for m, better, limit in pairs if limit is not None]


@dataclass(frozen=True)
class Check:
    level: str
    metric: str
    baseline: float | None
    current: float | None
    change_pct: float | None
    limit: str
    regressed: bool


@dataclass(frozen=True)
class GateReport:
    passed: bool
    baseline_run_id: str | None
    checks: list[Check] = field(default_factory=list)
    note: str = ""

    @property
    def regressions(self) -> list[Check]:
        return [c for c in self.checks if c.regressed]

    def table(self, only_regressions: bool = False) -> str:
        rows = self.regressions if only_regressions else self.checks
        lines = ["| level | metric | baseline | this run | change | limit | verdict |", "|---|---|---|---|---|---|---|"]
        for c in rows:
            lines.append(f"| {c.level} | {c.metric} | {_num(c.baseline)} | {_num(c.current)} | "
                         f"{'-' if c.change_pct is None else f'{c.change_pct:+.1f} %'} | {c.limit} | "
                         f"{'**regressed**' if c.regressed else 'ok'} |")
        head = f"Gate against baseline run `{self.baseline_run_id}`" if self.baseline_run_id else "Gate: no baseline"
        return "\n".join([f"{head}: {'passed' if self.passed else '**failed**'}. {self.note}".rstrip(), "", *lines]) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "baseline_run_id": self.baseline_run_id, "note": self.note,
                "checks": [c.__dict__ for c in self.checks]}

    def raise_if_failed(self) -> None:
        if self.passed:
            return
        parts = [f"{c.level} {c.metric} {_num(c.baseline)} → {_num(c.current)}"
                 f"{'' if c.change_pct is None else f' ({c.change_pct:+.1f} %'}, limit {c.limit})"
                 for c in self.regressions]
        raise GateFailed(f"benchmark regressed against baseline run {self.baseline_run_id}: " + "; ".join(parts),
                         self.table(only_regressions=True))


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _get(level: Mapping[str, Any], path: str) -> float | None:
    value: Any = level
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return float(value) if isinstance(value, (int, float)) else None


def _key(level: Mapping[str, Any]) -> tuple:
    mode = level.get("mode", "concurrency")
    return (mode, level.get("request_rate") if mode == "rate" else level.get("concurrency"))


def evaluate(current: Mapping[str, Any], baseline: Mapping[str, Any] | None, thresholds: Thresholds) -> GateReport:
    """Judge `current` (a summary: {"workload", "levels"}) against `baseline` (a promoted summary or None)."""
    checks: list[Check] = []
    # The error-rate limit needs no baseline: a run that fails requests is not promoted.
    if thresholds.max_error_rate_pct is not None:
        for lv in current["levels"]:
            rate = 100.0 * lv["errors"] / lv["requests"] if lv["requests"] else 0.0
            checks.append(Check(level_label(lv), "error_rate_pct", None, rate, None,
                                f"<= {thresholds.max_error_rate_pct:g} %", rate > thresholds.max_error_rate_pct))
    if baseline is None:
        return _report(None, checks, "No promoted run of this deployment yet: nothing to compare with.")
    run_id = baseline.get("run_id")
    if baseline.get("workload") != current.get("workload"):
        return _report(run_id, checks, "The baseline measured another workload, so it was not compared.")
    base_levels = {_key(lv): lv for lv in baseline.get("levels", [])}
    for lv in current["levels"]:
        base = base_levels.get(_key(lv))
        if base is None:
            continue
        for rule in thresholds.rules():
            b, c = _get(base, rule.metric), _get(lv, rule.metric)
            if b is None or c is None or b == 0:
                checks.append(Check(level_label(lv), rule.metric, b, c, None, _limit(rule), False))
                continue
            change = 100.0 * (c - b) / b
            worse = -change if rule.higher_is_better else change
            checks.append(Check(level_label(lv), rule.metric, b, c, change, _limit(rule), worse > rule.limit_pct))
    return _report(run_id, checks, "")


def _limit(rule: Rule) -> str:
    return f">= -{rule.limit_pct:g} %" if rule.higher_is_better else f"<= +{rule.limit_pct:g} %"


def _report(run_id: str | None, checks: Sequence[Check], note: str) -> GateReport:
    return GateReport(passed=not any(c.regressed for c in checks), baseline_run_id=run_id, checks=list(checks),
                      note=note)
