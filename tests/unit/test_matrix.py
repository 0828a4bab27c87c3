"""Matrix builds without Prefect or Docker: entry validation (one line each), the comparison rows from canned
manifests, the ranking rule and the report."""

import pytest

from stoker.errors import SpecError
from stoker.plan.matrix import Entry, comparison_row, entry_spec, markdown, pick_best, plan_entries
from stoker.spec.schema import Ports
from stoker.spec.load import parse_spec

SPEC = parse_spec({"model": {"repo_id": "org/m", "revision": "main"}, "storage": {"bucket": "b-1"},
                   "deploy": {"name": "tiny"}})


def _err(formats, targets=None, spec=SPEC) -> str:
    with pytest.raises(SpecError) as info:
        plan_entries(spec, formats, targets)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_entries_are_every_format_for_every_target_with_their_own_names():
    assert plan_entries(SPEC, ["none", "fp8", "int4_awq"]) == [
        Entry("none", "reference", "tiny-none"), Entry("fp8", "reference", "tiny-fp8"),
        Entry("int4_awq", "reference", "tiny-int4-awq")]


@pytest.mark.parametrize("formats, targets, line", [
    ([], None, "matrix: give at least one quantization format"),
    (["fp9"], None, "matrix entry 'fp9': unknown quantization format (one of none, fp8, int4_awq"),
    (["none", "fp8", "none"], None, "matrix entry none on reference: duplicated"),
    (["fp8"], ["reference", "cpu"], "matrix target 'cpu': unknown (Input should be 'reference'"),
    (["nvfp4"], None, "matrix entry nvfp4 on reference: quantization: format 'nvfp4' needs a GPU target"),
    # A GPU target needs the spec's gpus section: the spec's own rule, named for the entry.
    (["fp8"], ["tensorrt"], "matrix entry fp8 on tensorrt: gpus:"),
])
def test_a_bad_entry_is_one_line_naming_it(formats, targets, line):
    assert _err(formats, targets).startswith(line)


def test_an_entry_whose_name_is_too_long_is_refused_by_the_spec_rules():
    long = SPEC.model_copy(update={"deploy": SPEC.deploy.model_copy(update={"name": "a" * 36})})
    assert _err(["int4_awq"], spec=long).startswith("matrix entry int4_awq on reference: deploy.name:")


def test_entry_spec_changes_only_target_format_name_and_ports():
    e = Entry("fp8", "reference", "tiny-fp8")
    s = entry_spec(SPEC, e, Ports(http=9100, grpc=9101, metrics=9102))
    assert s.quantization.format == "fp8" and s.deploy.name == "tiny-fp8" and s.deploy.ports.http == 9100
    assert s.model == SPEC.model and s.benchmark == SPEC.benchmark and s.evaluation == SPEC.evaluation
    assert entry_spec(SPEC, e, SPEC.deploy.ports, name="tiny").deploy.name == "tiny"  # the promotion's spec


def _level(c, tok_s, p50, p99):
    return {"concurrency": c, "mode": "concurrency", "output_tokens_per_s": tok_s,
            "ttft_ms": {"mean": p50, "p50": p50, "p90": p99, "p99": p99}}


def _manifest(status="completed", tok_s=100.0, p99=20.0, ppl=10.5, agree=0.9, passed=True):
    return {
        "status": status, "error": None if status == "completed" else "evaluate: perplexity rose",
        "steps": {"build": {"status": "completed", "outputs": [{"bytes": 5}]},
                  "package": {"status": "completed", "outputs": [{"bytes": 1_000_000}, {"bytes": 500_000}]}},
        "evaluation": {"passed": passed, "candidate": {"perplexity": ppl, "agreement": {"token_match_rate": agree}},
                       "baseline": {"perplexity": 10.0}},
        # The top level is the highest concurrency, wherever it sits in the list.
        "benchmark": {"levels": [_level(4, tok_s, 8.0, p99), _level(1, 999.0, 1.0, 2.0)]},
    }


def test_a_row_reads_size_accuracy_and_the_top_level_from_the_manifest():
    row = comparison_row(Entry("fp8", "reference", "tiny-fp8"), _manifest())
    assert row == {"format": "fp8", "target": "reference", "deployment": "tiny-fp8", "status": "completed",
                   "size_mb": 1.5, "perplexity_delta_pct": 5.0, "greedy_agreement": 0.9, "evaluation": "passed",
                   "level": "concurrency 4", "output_tokens_per_s": 100.0, "ttft_ms_p50": 8.0, "ttft_ms_p99": 20.0,
                   "cause": None}


def test_an_entry_without_a_manifest_is_a_failed_row_with_its_cause():
    row = comparison_row(Entry("fp8", "reference", "tiny-fp8"), None, "build: child exited 1")
    assert row["status"] == "failed" and row["cause"] == "build: child exited 1"
    assert row["output_tokens_per_s"] is None and row["size_mb"] is None and row["evaluation"] == "off"


def _rows(*manifests):
    return [comparison_row(Entry(f"f{i}", "reference", f"t-{i}"), m) for i, m in enumerate(manifests)]


def test_best_is_the_fastest_that_passed_every_gate():
    rows = _rows(_manifest(tok_s=100.0), _manifest(status="failed", tok_s=500.0, passed=False),
                 _manifest(tok_s=150.0), _manifest(tok_s=120.0))
    assert pick_best(rows)["format"] == "f2"


def test_a_tie_goes_to_the_lower_ttft_p99_then_to_the_earlier_entry():
    assert pick_best(_rows(_manifest(p99=30.0), _manifest(p99=20.0), _manifest(p99=20.0)))["format"] == "f1"


def test_nothing_is_best_when_nothing_passed():
    assert pick_best(_rows(_manifest(status="failed", passed=False))) is None
    assert pick_best([comparison_row(Entry("fp8", "reference", "t"), None, "boom")]) is None


def test_the_report_has_a_row_per_entry_the_rule_and_the_causes():
    rows = _rows(_manifest(), _manifest(status="failed", passed=False))
    text = markdown("m1", SPEC, rows, rows[0], "f0 on reference → tiny")
    assert "| f0 | reference | completed | 1.500 | 5.000 | 0.900 | concurrency 4 | 100.000 | 8.000 | 20.000 |" in text
    assert "highest output tok/s at the top benchmark level; ties go to the lower TTFT p99" in text
    assert "- promoted: f0 on reference → tiny" in text
    assert "- f1 on reference: evaluate: perplexity rose" in text


def test_a_watch_with_formats_starts_the_matrix_deployment_with_them():
    from pydantic import ValidationError

    from flows.watch_revisions import Watch

    spec = SPEC.model_dump(mode="json")
    w = Watch.model_validate({"spec": spec, "formats": ["none", "fp8"]})
    assert w.deployment == "build_matrix/matrix"
    assert w.parameters(SPEC) == {"spec": spec, "formats": ["none", "fp8"]}
    assert Watch.model_validate({"spec": spec}).parameters(SPEC) == {"spec": spec}  # one build, as before
    with pytest.raises(ValidationError, match="matrix entry fp8 on reference: duplicated"):
        Watch.model_validate({"spec": spec, "formats": ["fp8", "fp8"]})
    with pytest.raises(ValidationError, match="formats start a matrix: build_and_deploy/stoker-cpu builds one"):
        Watch.model_validate({"spec": spec, "formats": ["fp8"], "deployment": "build_and_deploy/stoker-cpu"})


def test_a_failed_entry_keeps_the_numbers_its_run_left(tmp_path):
    import json
    import os
    import time

    from tasks.matrix import failed_run_manifest

    def write(run_id, name, mtime):
        path = tmp_path / "runs" / run_id / "manifest.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"run_id": run_id, "spec": {"deploy": {"name": name}}}))
        os.utime(path, (mtime, mtime))

    now = time.time()
    write("old", "tiny-fp8", now - 100)  # an earlier matrix's
    write("other", "tiny-none", now)  # another entry's
    write("ours", "tiny-fp8", now)
    (tmp_path / "runs" / "half").mkdir()
    (tmp_path / "runs" / "half" / "manifest.json").write_text("{")  # being written
    assert failed_run_manifest(tmp_path, "tiny-fp8", now - 10)["run_id"] == "ours"
    assert failed_run_manifest(tmp_path, "tiny-int8-sq", now - 10) is None
    assert failed_run_manifest(tmp_path / "nothing", "tiny-fp8", now - 10) is None
