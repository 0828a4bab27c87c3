"""The run manifest: what ran, from which inputs, producing which bytes. Pure + one atomic write."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..atomic import write_atomic
from ..gpu import standin
from ..run import STEPS, RunContext, StepResult
from ..spec.schema import Spec
from ..versions import tool_versions

LEVEL_FIELDS = ("concurrency", "requests", "completed", "errors", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens_per_s",
                "requests_per_s", "mode", "request_rate", "short_outputs", "client_saturated")
STAT_FIELDS = ("mean", "p50", "p90", "p99")


def build_manifest(spec: Spec, ctx: RunContext, steps: dict[str, StepResult], source: dict,
                   started_at: float, wall_s: float, status: str, error: str | None = None,
                   rollback: dict | None = None, metrics: list[dict] | None = None,
                   evaluation: dict | None = None) -> dict:
    deploy = steps.get("deploy")
    switch = steps.get("switch")
    # What serves is this run's build only once traffic is on it.
    live = bool(deploy and deploy.status == "completed"
                and (switch.status == "completed" if switch else "switch" not in steps and not error))
    bench = steps.get("benchmark")
    levels = bench.detail.get("levels", []) if bench and bench.status == "completed" else []
    by_adapter = bench.detail.get("adapters", {}) if bench and bench.status == "completed" else {}
    return {
        "run_id": ctx.run_id,
        "status": status,
        "error": error,
        "spec_digest": spec.digest(),
        "spec": spec.model_dump(mode="json"),
        "model": {"repo_id": spec.model.repo_id, "revision": spec.model.revision, "sha": source.get("sha"),
                  "local_path": source.get("local_path")},
        "versions": tool_versions(),
        # The stable address clients use (the proxy), and separately the backend that serves behind it.
        "endpoint": (deploy.detail.get("endpoint") if deploy and deploy.status == "completed" else None),
        # reload: the gates ran on a candidate of its own; the long-lived backend ("live") serves the build (h1).
        "backend": (deploy.detail.get(("live" if deploy.detail.get("in_place") else "candidate") if live else "previous")
                    if deploy and deploy.status == "completed"
                    else None),
        # Steps after the pipeline's own (gate, promote, ...) follow in the order they ran.
        "steps": {name: _step_entry(steps[name], started_at)
                  for name in (*STEPS, *(n for n in steps if n not in STEPS)) if name in steps},
        "benchmark": {"levels": [_level(lv) for lv in levels],
                      # each LoRA adapter under the same load (the spec's adapters)
                      **({"adapters": {n: [_level(lv) for lv in lvs] for n, lvs in by_adapter.items()}}
                         if by_adapter else {})},
        # Accuracy against the unquantized build of the same revision (None when evaluation is off or
        # the run stopped before it); present also when its gate failed.
        "evaluation": evaluation,
        "rollout": ({"strategy": deploy.detail.get("strategy"), "previous": deploy.detail.get("previous"),
                     # GPU targets: surge, shared or reload as planned, the GPUs this build got, and (reload) the
                     # gap: expected by the plan, measured in the switch record ("gap_s")
                     **({"gpu": {**deploy.detail["gpu_rollout"], "gpus": deploy.detail.get("gpus")}}
                        if deploy.detail.get("gpu_rollout") else {}),
                     "version": deploy.detail.get("version"), "reused": deploy.detail.get("reused"),
                     **({"switch": switch.detail} if switch and switch.status == "completed" else {})}
                    if deploy and deploy.status == "completed" else None),
        "rollback": rollback,  # set when a failure after deploy returned the endpoint to what served before
        # STOKER_STANDIN=1 replaced the engine build and the serving image (stoker/gpu/standin.py): said on every run
        # of a target that has a stand-in, so a manifest never leaves it open.
        **({"standin": {"ran": standin.applies(spec, ctx.standin), "note": standin.NOTE if standin.applies(spec, ctx.standin) else
                        "the real engine build and serving image"}} if standin.covers(spec) else {}),
        "triton_metrics": metrics or [],  # per model, cumulative since the server started
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at)),
        "runner": ctx.runner,
        "wall_s": round(wall_s, 3),
        "overhead_s": round(wall_s - covered_s([*steps.values(), *_removal(rollback)]), 3),
    }


def _removal(rollback: dict | None) -> list[StepResult]:
    """A candidate removed after a failed step (tasks.rollout.abandon_candidate): work of the run, like a step."""
    if not rollback or "began_at" not in rollback:
        return []
    return [StepResult(name="abandon", duration_s=rollback["duration_s"], started_at=rollback["began_at"])]


def _step_entry(step: StepResult, run_started_at: float) -> dict:
    entry = step.manifest_entry()
    if step.started_at is not None:  # seconds into the run: overlapping steps show as such
        entry["started_s"] = round(step.started_at - run_started_at, 3)
    return entry


def covered_s(steps) -> float:
    """Seconds of the run that some step covered: the union of the steps' intervals where every step says when
    it began (steps overlap: the baseline runs while the candidate starts), else the sum of their durations."""
    steps = list(steps)
    if not steps or any(s.started_at is None for s in steps):
        return sum(s.duration_s for s in steps)
    covered, end = 0.0, None
    for start, stop in sorted((s.started_at, s.started_at + s.duration_s) for s in steps):
        if end is None or start >= end:
            covered += stop - start
            end = stop
        elif stop > end:
            covered += stop - end
            end = stop
    return covered


def _level(lv: dict) -> dict:
    out = {k: lv[k] for k in LEVEL_FIELDS if k in lv}
    for k in ("ttft_ms", "itl_ms", "e2e_ms"):
        stats = lv.get(k) or {}  # None when no request produced a sample
        out[k] = {s: stats.get(s) for s in STAT_FIELDS}
    return out


def write_local(ctx: RunContext, manifest: dict) -> Path:
    return write_atomic(ctx.run_dir / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))


def read_manifests(home: Path) -> list[dict]:
    """Every readable run manifest under ``home/runs``, oldest first (run ids sort by time); a manifest being
    written or damaged is skipped, not an error."""
    out = []
    for path in sorted((Path(home) / "runs").glob("*/manifest.json")):
        try:
            m = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(m, dict):
            out.append(m)
    return out
