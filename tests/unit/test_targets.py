"""Targets as modules: the spec, the plan and the flow's step sequence ask the target, never its name.

Every task is a fake recording its call, so the step order of each target is checked without Prefect,
Docker or S3: the order the flow had when it branched on `spec.target` is the order it must keep.
"""

from __future__ import annotations

import contextlib

import pytest

import flows.build_and_deploy as flow_module
from stoker.plan import compose as plan_module
from stoker import targets
from stoker.errors import SpecError
from stoker.plan.compose import PlannedStep
from stoker.run import RunContext, StepResult
from stoker.spec.load import parse_spec
from stoker.targets.base import Target

BASE = {"model": {"repo_id": "org/model"}, "storage": {"bucket": "my-bucket"}}
GPUS = {"type": "h100-80gb", "count": 1}


class Dummy(Target):
    """A fourth target that exists only in this test: registered, never added to any other module."""

    name = "dummy"
    runs_on = "cpu"
    layout = "dummy"

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def check_quantization(self, q) -> None:
        if q.format != "none":
            raise ValueError(f"the dummy target takes no {q.format!r}")

    def check_model(self, spec, facts) -> None:
        self.calls.append("check_model")

    def plan(self, spec, ctx):
        return [PlannedStep("convert", "k", "miss", "dummy")]

    def build(self, steps, spec, fetched, ctx):
        return steps.run("convert", fake("convert", self.calls), spec, fetched, ctx)

    def package(self, steps, spec, fetched, built, ctx):
        return steps.run("package", fake("package", self.calls), spec, built, ctx)

    # Serving: only what differs; the deploy path (stage, gates, switch) is the base class's, as for every target.
    def repository_of(self, packaged, uploaded) -> str:
        return "s3://dummy"

    def backend(self, spec, repository, gpus) -> dict:
        return {"image": "dummy:1", "repository_uri": repository}


def fake(name: str, calls: list[str], fail: bool = False):
    def task(*args):
        calls.append(name)
        if fail:
            raise RuntimeError(f"{name} refused")
        return StepResult(name=name, digest="d" * 64)
    return task


class FakeSubmittable:
    """A fake task that can also be submitted (Prefect's .submit returns a future with .result)."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.task = fake(name, calls)

    def __call__(self, *args):
        return self.task(*args)

    def submit(self, *args):
        result = self.task(*args)
        return type("Future", (), {"result": staticmethod(lambda: result)})()


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """Every task the flow or a target runs, faked; the list records what ran, in order."""
    import tasks.evaluate
    import tasks.gate
    import tasks.modelopt
    import tasks.reference
    import tasks.rollout
    import tasks.triton_client
    import tasks.triton_repo
    import tasks.trtllm
    from stoker.orchestration import gpu_slot

    seen: list[str] = []
    for module, attr, step in [
        (flow_module, "preflight_checks", "preflight"), (flow_module, "fetch_weights", "fetch"),
        (flow_module, "upload_repository", "upload"), (flow_module, "promote_run", "promote"),
        (tasks.modelopt, "quantize_weights", "quantize"), (tasks.reference, "build_reference", "build"),
        (tasks.triton_repo, "package_repository", "package"), (tasks.rollout, "stage_candidate", "deploy"),
        (tasks.rollout, "switch_traffic", "switch"), (tasks.rollout, "decide_gpu_rollout", "gpu-rollout"),
        (tasks.triton_client, "benchmark_endpoint", "benchmark"), (tasks.gate, "gate_benchmark", "gate"),
        (tasks.trtllm, "build_gpu", "build"), (tasks.trtllm, "package_gpu", "package"),
        (flow_module, "evaluation_data", "eval-data"),
        (tasks.evaluate, "evaluate_candidate", "evaluate"), (tasks.evaluate, "baseline_recorded", "baseline"),
    ]:
        monkeypatch.setattr(module, attr, fake(step, seen))
    monkeypatch.setattr(tasks.evaluate, "baseline_reference", FakeSubmittable("baseline", seen))
    monkeypatch.setattr(tasks.rollout, "scrape_metrics", lambda served: seen.append("metrics") or [{"m": 1}])
    monkeypatch.setattr(tasks.rollout, "abandon_candidate",
                        lambda spec, staged, ctx, cause: seen.append(f"abandon: {cause}"))

    @contextlib.contextmanager
    def slot():
        seen.append("gpu slot")
        yield
        seen.append("gpu slot released")

    monkeypatch.setattr(gpu_slot, "gpu_slot", slot)

    @contextlib.contextmanager
    def no_lock(name, log, what):
        yield  # the real one is a Prefect concurrency limit, which needs an API (test_one_run_per_deployment.py)

    monkeypatch.setattr(flow_module, "exclusive", no_lock)
    # The rollback-records check reads S3 (tests/unit/test_rollback_records.py covers its rule)
    monkeypatch.setattr(flow_module, "refuse_rolled_back", lambda spec, fetched, ctx, force=False: None)
    # The run-order check reads what runs on Docker (tests/unit/test_api_keys_day2.py covers its rule)
    monkeypatch.setattr(flow_module, "refuse_older_run", lambda spec, ctx, force=False, digest=None: None)
    return seen


@pytest.fixture
def dummy(calls):
    target = targets.register(Dummy(calls))
    yield target
    targets.unregister(target.name)


def run(spec_data: dict, tmp_path) -> flow_module.Steps:
    steps = flow_module.Steps()
    flow_module.run_steps(parse_spec({**BASE, **spec_data}), RunContext.new(tmp_path), steps)
    return steps


def test_the_three_targets_are_their_modules():
    ref, trt, pt = (targets.get(n) for n in ("reference", "tensorrt", "pytorch"))
    assert [(t.name, t.runs_on, t.layout) for t in (ref, trt, pt)] == [
        ("reference", "cpu", "ensemble"), ("tensorrt", "gpu", "inflight_batcher_llm"), ("pytorch", "gpu", "llmapi")]
    assert targets.names()[0] == "reference" and set(targets.names()) == {"reference", "tensorrt", "pytorch"}
    # The formats come from stoker/plan/model_checks.py, not from a list of the target's own.
    assert ref.formats() == ["fp8", "int4_awq", "int8_sq", "w4a8_awq"]
    assert "nvfp4" in trt.formats() and "int8_sq" not in pt.formats()


def test_an_unknown_target_is_one_line_naming_the_known_ones():
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, "target": "onnx"}, "s.yaml")
    assert str(err.value) == "s.yaml: target: Input should be 'reference', 'pytorch' or 'tensorrt'"


def test_reference_step_order_is_unchanged(calls, tmp_path):
    steps = run({"quantization": {"format": "fp8"}}, tmp_path)
    # The baseline starts before the candidate's deploy and is joined before its benchmark.
    assert calls == ["preflight", "fetch", "eval-data", "quantize", "build", "package", "upload", "baseline",
                     "deploy", "benchmark", "metrics", "evaluate", "gate", "switch", "promote"]
    assert list(steps) == ["preflight", "fetch", "eval-data", "quantize", "build", "package", "upload", "deploy",
                           "baseline", "benchmark", "evaluate", "gate", "switch", "promote"]
    assert steps.metrics == [{"m": 1}]


def test_reference_abandons_a_candidate_that_fails_its_gate(calls, monkeypatch, tmp_path):
    import tasks.gate

    monkeypatch.setattr(tasks.gate, "gate_benchmark", fake("gate", calls, fail=True))
    with pytest.raises(RuntimeError, match="gate refused"):
        run({}, tmp_path)
    # No switch: the candidate never serves; the metrics scraped before the gate still reach the report.
    assert calls[-5:] == ["benchmark", "metrics", "evaluate", "gate", "abandon: RuntimeError: gate refused"]


@pytest.mark.parametrize("target", ["tensorrt", "pytorch"])
def test_gpu_targets_take_the_one_serving_path(calls, tmp_path, target):
    """Stage a candidate, gate it on its own ports, then switch: the reference's serving steps, after the GPU build."""
    steps = run({"target": target, "gpus": GPUS}, tmp_path)
    assert calls == ["preflight", "fetch", "eval-data", "gpu-rollout", "gpu slot", "build", "gpu slot released",
                     "package", "upload", "deploy", "baseline", "benchmark", "metrics", "evaluate", "gate", "switch",
                     "promote"]
    assert list(steps) == ["preflight", "fetch", "eval-data", "gpu-rollout", "build", "package", "upload", "deploy",
                           "baseline", "benchmark", "evaluate", "gate", "switch", "promote"]


def test_a_gpu_candidate_that_fails_its_gate_is_abandoned_like_any_other(calls, monkeypatch, tmp_path):
    import tasks.gate

    monkeypatch.setattr(tasks.gate, "gate_benchmark", fake("gate", calls, fail=True))
    with pytest.raises(RuntimeError, match="gate refused"):
        run({"target": "tensorrt", "gpus": GPUS}, tmp_path)
    assert calls[-2:] == ["gate", "abandon: RuntimeError: gate refused"] and "switch" not in calls


def test_a_fourth_target_is_one_module_the_spec_plan_and_flow_dispatch_to(dummy, calls, tmp_path):
    assert "dummy" in targets.names()
    with pytest.raises(SpecError, match="quantization: the dummy target takes no 'fp8'"):
        parse_spec({**BASE, "target": "dummy", "quantization": {"format": "fp8"}})
    # A local folder without config.json: no model facts, and no Hub lookup for them.
    spec = parse_spec({**BASE, "model": {"local_path": str(tmp_path)}, "target": "dummy",
                       "evaluation": {"enabled": False}})
    assert plan_module.plan(spec, RunContext.new(tmp_path)) == [PlannedStep("convert", "k", "miss", "dummy")]
    plan_module.check_model(spec)
    assert calls == ["check_model"]

    steps = run({"target": "dummy", "evaluation": {"enabled": False}}, tmp_path)
    assert list(steps) == ["preflight", "fetch", "convert", "package", "upload", "deploy", "benchmark", "gate",
                           "switch", "promote"]
    assert "gpu slot" not in calls  # runs_on cpu: no GPU slot


def test_gpu_targets_need_gpus_and_the_reference_refuses_gpu_only_formats():
    with pytest.raises(SpecError, match="^s.yaml: gpus: required for target 'pytorch'"):
        parse_spec({**BASE, "target": "pytorch"}, "s.yaml")
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, "quantization": {"format": "nvfp4"}}, "s.yaml")
    assert str(err.value) == ("s.yaml: quantization: format 'nvfp4' needs a GPU target (pytorch or tensorrt); "
                              "the reference path runs none, fp8, int4_awq, int8_sq, w4a8_awq")


def test_a_gpu_run_decides_its_rollout_once_and_build_package_and_stage_read_that(calls, monkeypatch, tmp_path):
    import tasks.rollout
    import tasks.trtllm

    decided = {"rollout": None, "sets": [[0], [1]], "held": [0], "candidate": [1], "facts": "fetched files"}
    seen: dict[str, list] = {}

    def recording(step, ctx_at):
        def task(*args):
            seen.setdefault(step, []).append(args[ctx_at].gpu)
            calls.append(step)
            return StepResult(name=step, digest="d" * 64, detail=decided if step == "gpu-rollout" else {})
        return task

    monkeypatch.setattr(tasks.rollout, "decide_gpu_rollout", recording("gpu-rollout", 2))
    monkeypatch.setattr(tasks.trtllm, "build_gpu", recording("build", 2))
    monkeypatch.setattr(tasks.trtllm, "package_gpu", recording("package", 3))
    monkeypatch.setattr(tasks.rollout, "stage_candidate", recording("deploy", 2))
    settled = {**decided, "candidate": [1], "settled": "under the deploy lock"}

    def settle(spec, ctx):
        calls.append("settle")
        seen.setdefault("settle", []).append(ctx.gpu)
        return settled

    monkeypatch.setattr(tasks.rollout, "settle_gpu_rollout", settle)
    steps = run({"target": "tensorrt", "gpus": GPUS}, tmp_path)
    assert calls.count("gpu-rollout") == 1 and steps["gpu-rollout"].detail == decided
    assert seen["gpu-rollout"] == [None]  # decided before anything had one
    assert seen["build"] == seen["package"] == [decided] == seen["settle"]
    # The candidate's GPUs are settled once, under the deploy lock (after the build), and staging uses that.
    assert calls.index("settle") > calls.index("package") and calls.count("settle") == 1
    assert seen["deploy"] == [settled]


def test_a_cancelled_run_abandons_its_unjudged_candidate_and_records_cancelled(calls, monkeypatch, tmp_path):
    # Issue 49: cancelling a flow run raises Prefect's TerminationSignal, a BaseException that `except Exception`
    # never saw: the candidate stayed up and the run was recorded as completed.
    import tasks.gate
    from prefect.exceptions import TerminationSignal

    def cancelled(*_args):
        calls.append("gate")
        raise TerminationSignal(15)

    monkeypatch.setattr(tasks.gate, "gate_benchmark", cancelled)
    steps = flow_module.Steps()
    with pytest.raises(TerminationSignal):
        flow_module.run_steps(parse_spec(BASE), RunContext.new(tmp_path), steps)
    assert calls[-1].startswith("abandon: ") and "switch" not in calls
    assert steps["gate"].status == "cancelled" and steps["gate"].error
    assert flow_module.ended(TerminationSignal(15)) == "cancelled" and flow_module.ended(RuntimeError()) == "failed"
