"""The regression gate: exact verdicts on hand-made summaries."""

from __future__ import annotations

import pytest

from stoker.bench.errors import GateFailed
from stoker.bench.gate import Thresholds, evaluate

WORKLOAD = {"prompts": {"isl": 32, "osl": 32}, "protocol": "grpc"}


def _level(c: int, tok_s: float, ttft_p99: float, errors: int = 0, itl_p99: float = 10.0) -> dict:
    return {"mode": "concurrency", "concurrency": c, "request_rate": None, "requests": 16, "errors": errors,
            "output_tokens_per_s": tok_s, "ttft_ms": {"p99": ttft_p99}, "itl_ms": {"p99": itl_p99},
            "e2e_ms": {"p99": 300.0}}


def _summary(*levels: dict, run_id: str = "r-base") -> dict:
    return {"run_id": run_id, "workload": WORKLOAD, "levels": list(levels)}


BASE = _summary(_level(1, 100.0, 50.0), _level(4, 400.0, 60.0))


def test_within_thresholds_passes() -> None:
    # -4.9 % throughput and +9.9 % TTFT p99: inside 5 % / 10 %.
    report = evaluate(_summary(_level(1, 95.1, 54.95), _level(4, 401.0, 60.0)), BASE, Thresholds())
    assert report.passed and report.baseline_run_id == "r-base"
    assert not report.regressions
    report.raise_if_failed()


def test_regressions_fail_with_a_table_of_what_regressed() -> None:
    current = _summary(_level(1, 100.0, 50.0), _level(4, 360.0, 70.0))  # -10 % tok/s, +16.7 % TTFT p99 at c=4
    report = evaluate(current, BASE, Thresholds())
    assert not report.passed
    assert [(c.level, c.metric) for c in report.regressions] == [
        ("concurrency 4", "output_tokens_per_s"), ("concurrency 4", "ttft_ms.p99")]
    assert report.regressions[0].change_pct == pytest.approx(-10.0)
    with pytest.raises(GateFailed) as info:
        report.raise_if_failed()
    message = str(info.value)
    assert "\n" not in message and "r-base" in message and "-10.0 %" in message
    assert "| concurrency 4 | output_tokens_per_s | 400.00 | 360.00 | -10.0 % | >= -5 % | **regressed** |" in info.value.table
    assert "concurrency 1" not in info.value.table  # only what regressed


def test_improvements_never_fail_and_disabled_checks_are_skipped() -> None:
    current = _summary(_level(1, 200.0, 10.0, itl_p99=30.0), _level(4, 800.0, 20.0))
    assert evaluate(current, BASE, Thresholds()).passed  # ITL p99 tripled but its check is off
    assert not evaluate(current, BASE, Thresholds(itl_p99_rise_pct=10.0)).passed


def test_errors_fail_even_without_a_baseline() -> None:
    report = evaluate(_summary(_level(1, 100.0, 50.0, errors=2)), None, Thresholds())
    assert not report.passed and report.regressions[0].metric == "error_rate_pct"
    assert evaluate(_summary(_level(1, 100.0, 50.0, errors=2)), None, Thresholds(max_error_rate_pct=20)).passed


def test_no_baseline_or_other_workload_passes_with_a_note() -> None:
    first = evaluate(_summary(_level(1, 1.0, 999.0)), None, Thresholds())
    assert first.passed and "No promoted run" in first.note
    other = dict(BASE, workload={"prompts": {"isl": 128, "osl": 32}, "protocol": "grpc"})
    report = evaluate(_summary(_level(1, 1.0, 999.0)), other, Thresholds())
    assert report.passed and "another workload" in report.note


def test_levels_missing_from_the_baseline_are_not_judged() -> None:
    report = evaluate(_summary(_level(16, 1.0, 999.0)), BASE, Thresholds())
    assert report.passed and all(c.level == "concurrency 16" and c.metric == "error_rate_pct" for c in report.checks)
