import json

from stoker.record.manifest import build_manifest, write_local
from stoker.record.report import benchmark_rows, level_label, markdown
from stoker.run import Output, RunContext, StepResult
from stoker.spec.load import parse_spec

SPEC = parse_spec({"model": {"repo_id": "org/m", "revision": "main"}, "storage": {"bucket": "b-1"}})
STATS = {"mean": 12.0, "min": 10.0, "max": 20.0, "std": 1.0, "p50": 11.0, "p90": 15.0, "p95": 18.0, "p99": 19.5}


def _steps():
    steps = {}
    for i, name in enumerate(("fetch", "quantize", "build", "package", "upload", "deploy")):
        steps[name] = StepResult(name=name, cache_hit=name != "deploy", duration_s=1.0 + i, digest=f"d{i}" * 8,
                                 outputs=[Output(uri=f"file:///x/{name}", sha256="ab" * 32, bytes=1000)])
    steps["fetch"].detail = {"sha": "c0ffee"}
    steps["deploy"].detail = {"endpoint": {"http": "http://127.0.0.1:8000", "grpc": "127.0.0.1:8001"},
                              "candidate": {"container": "stoker-m-blue", "http": "http://127.0.0.1:20000"},
                              "http": "http://127.0.0.1:20000", "grpc": "127.0.0.1:20001"}
    level = {"concurrency": 2, "requests": 8, "completed": 7, "errors": 1, "ttft_ms": STATS, "itl_ms": None,
             "e2e_ms": STATS, "output_tokens_per_s": 123.4, "requests_per_s": 5.5, "duration_s": 1.3}
    steps["benchmark"] = StepResult(name="benchmark", duration_s=3.0, detail={"levels": [level]})
    return steps


def test_manifest_has_the_required_fields(tmp_path):
    ctx = RunContext(run_id="r1", home=tmp_path)
    steps = _steps()
    m = build_manifest(SPEC, ctx, steps, steps["fetch"].detail, started_at=0, wall_s=30.0, status="completed")
    assert m["run_id"] == "r1" and m["spec_digest"] == SPEC.digest()
    assert m["model"] == {"repo_id": "org/m", "revision": "main", "sha": "c0ffee", "local_path": None}
    assert m["endpoint"] == {"http": "http://127.0.0.1:8000", "grpc": "127.0.0.1:8001"}  # the stable address
    assert m["backend"] == {"container": "stoker-m-blue", "http": "http://127.0.0.1:20000"}  # what serves behind it
    assert list(m["steps"]) == ["fetch", "quantize", "build", "package", "upload", "deploy", "benchmark"]
    fetch = m["steps"]["fetch"]
    assert fetch["status"] == "completed" and fetch["cache_hit"] is True and fetch["duration_s"] == 1.0
    assert fetch["outputs"] == [{"uri": "file:///x/fetch", "sha256": "ab" * 32, "bytes": 1000}]
    lv = m["benchmark"]["levels"][0]
    assert lv["ttft_ms"] == {"mean": 12.0, "p50": 11.0, "p90": 15.0, "p99": 19.5}
    assert lv["itl_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert lv["errors"] == 1 and lv["output_tokens_per_s"] == 123.4
    # overhead = wall - sum of step durations (1+2+3+4+5+6+3 = 24)
    assert m["overhead_s"] == 6.0
    assert "torch" in m["versions"] and "prefect" in m["versions"]
    path = write_local(ctx, m)
    assert json.loads(path.read_text())["run_id"] == "r1"
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]  # no temp file left


def test_failed_run_records_the_failed_step_and_no_endpoint(tmp_path):
    steps = _steps()
    steps["deploy"] = StepResult(name="deploy", status="failed", duration_s=2.0, error="NotReady: never ready")
    del steps["benchmark"]
    m = build_manifest(SPEC, RunContext(run_id="r2", home=tmp_path), steps, {}, 0, 20.0, "failed", "NotReady: x")
    assert m["endpoint"] is None and m["status"] == "failed"
    assert m["steps"]["deploy"] == {"status": "failed", "cache_hit": False, "duration_s": 2.0, "key": None,
                                    "digest": None, "outputs": [], "error": "NotReady: never ready"}
    assert m["benchmark"] == {"levels": []}


def test_report_shows_steps_and_benchmark_table(tmp_path):
    steps = _steps()
    m = build_manifest(SPEC, RunContext(run_id="r3", home=tmp_path), steps, steps["fetch"].detail, 0, 30.0, "completed")
    text = markdown(m, ["s3://b-1/stoker/runs/r3/manifest.json"])
    assert "| fetch | completed | yes | 1.00 | 1 files, 0.00 MB |" in text
    assert "| deploy | completed | no | 6.00 |" in text
    assert "| concurrency 2 | 8 | 1 | 11.0 | 19.5 | - | - | 11.0 | 19.5 | 123.4 | 5.5 |" in text
    assert "s3://b-1/stoker/runs/r3/manifest.json" in text
    rows = benchmark_rows(m)
    assert rows[0]["output_tokens_per_s"] == 123.4 and rows[0]["itl_ms_p50"] is None
    rate = {**m["benchmark"]["levels"][0], "mode": "rate", "request_rate": 2.5, "concurrency": 0}
    assert level_label(rate) == "rate 2.5/s"


def test_a_removed_candidate_counts_as_the_runs_work_not_orchestration_overhead(tmp_path):
    # Steps that say when they began: fetch 0-1 s, benchmark 1-4 s; the candidate's removal after the failed gate
    # 5-9 s (tasks.rollout.abandon_candidate's record). Covered: 4 + 4 of 10 s.
    steps = {"fetch": StepResult(name="fetch", duration_s=1.0, started_at=100.0),
             "benchmark": StepResult(name="benchmark", duration_s=3.0, started_at=101.0)}
    rollback = {"from": "d", "cause": "gate", "status": "rolled back", "began_at": 105.0, "duration_s": 4.0}
    ctx = RunContext(run_id="r2", home=tmp_path)
    m = build_manifest(SPEC, ctx, steps, {}, started_at=100.0, wall_s=10.0, status="failed", rollback=rollback)
    assert m["overhead_s"] == 2.0 and m["rollback"] == rollback
    # A record without timing (an older run's) leaves the steps alone to account for the wall.
    old = {k: v for k, v in rollback.items() if k not in ("began_at", "duration_s")}
    assert build_manifest(SPEC, ctx, steps, {}, started_at=100.0, wall_s=10.0, status="failed",
                          rollback=old)["overhead_s"] == 6.0


def test_the_local_manifest_is_written_before_s3_and_prefect_so_an_api_error_loses_nothing(tmp_path, monkeypatch):
    # Issue 49: the manifest was written after the Prefect artifact calls; an unreachable API lost the run's record.
    import logging

    import flows.build_and_deploy as flow

    ctx = RunContext(run_id="r9", home=tmp_path)
    steps = _steps()
    m = build_manifest(SPEC, ctx, steps, steps["fetch"].detail, 0, 30.0, "completed")
    order = []

    def unreachable(*_a, **_k):
        order.append(("artifact", (ctx.run_dir / "manifest.json").is_file()))
        raise ConnectionError("Prefect API unreachable")

    monkeypatch.setattr(flow, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(flow, "create_markdown_artifact", unreachable)
    flow.publish_run(SPEC, ctx, m, s3_ok=False)
    assert order == [("artifact", True)]  # the manifest was on disk before Prefect was asked anything
    assert json.loads((ctx.run_dir / "manifest.json").read_text())["status"] == "completed"
    assert (ctx.run_dir / "report.md").is_file()
