"""The watch window's readiness verdict (stoker.serving.probe.Readiness) on a fake clock."""

from __future__ import annotations

from stoker.serving.probe import Readiness


def test_one_slow_or_missed_probe_is_not_a_verdict():
    r = Readiness(failures=3, span_s=15.0)
    assert not r.observe(False, 0.0) and not r.observe(False, 10.2)  # two 5 s timeouts on a stalled host
    assert r.failing
    assert not r.observe(True, 11.0) and not r.failing  # it answers again: the streak is gone


def test_a_backend_unready_for_the_whole_span_is_a_verdict():
    r = Readiness(failures=3, span_s=15.0)
    verdicts = [r.observe(False, t) for t in (0.0, 0.5, 1.0, 14.9, 15.0)]
    assert verdicts == [False, False, False, False, True]
    assert r.describe(15.0) == "5 probes in a row over 15.0 s"


def test_many_fast_failures_need_the_span_and_a_long_one_needs_the_count():
    fast = Readiness(failures=3, span_s=15.0)
    assert not any(fast.observe(False, 0.1 * i) for i in range(100))  # 100 failures in 10 s: not yet
    slow = Readiness(failures=3, span_s=15.0)
    assert [slow.observe(False, t) for t in (0.0, 20.0, 40.0)] == [False, False, True]
