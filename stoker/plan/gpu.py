"""`stoker plan`'s rows for the GPU targets: checks, each step's cache key and status, and the rollout.

Here, not in stoker.gpu: a plan row reads the step cache and what serves now (stoker.plan.rows), and the GPU package
decides and renders without knowing either (the import contracts in pyproject.toml).
"""

from __future__ import annotations

from ..gpu import matrix, rollout, trtllm
from ..gpu.planning import check_spec
from .rows import PlannedStep, cached_row, package_row


def rollout_row(spec, facts):
    """`stoker plan`'s rollout row: surge, shared or reload, and what it costs (stoker/gpu/rollout.py)."""
    planned = rollout.plan_rollout(spec, facts)
    if planned is None:
        return PlannedStep("rollout", None, "unknown", "the engine's size is not estimated (model facts unknown or "
                                                       "build.engine_dir): surge, shared or reload not chosen")
    return PlannedStep("rollout", None, planned.choice, planned.note())


def plan_gpu(spec, ctx) -> list:
    """The GPU plan: refuse (PlanRefused) before any GPU time, else checks' notes + each step's key and status."""
    from ..storage.hub import HubUnavailable
    from ..cache.keys import fetch_key, gpu_build_key, gpu_package_key
    from ..storage.source import resolve_source

    facts, findings = check_spec(spec)
    img = matrix.image_info(spec.deploy.image)
    out = [PlannedStep("checks", None, "ok", f"{spec.target} on {spec.deploy.image} (TRT-LLM {img.trtllm}, "
                                             f"facts: {facts.source if facts else 'unknown'})")]
    out += [PlannedStep("checks", None, "note", f.line()) for f in findings]
    try:
        source_id, source = resolve_source(spec)
    except HubUnavailable as err:
        out.append(PlannedStep("fetch", None, "unknown", f"{err}; the revision is resolved when the run fetches"))
        source_id = None
    digest = None
    if source_id is not None:
        row, digest = cached_row(spec, ctx, "fetch", fetch_key(spec, source_id), f"sha {source.get('sha')}")
        out.append(row)
    weights = digest
    def build_key(spec, digest):
        return gpu_build_key(spec, digest, trtllm.step_argvs(spec))

    for name, keyfn, note in (("build", build_key, "quantize + checkpoint + engine: a hit skips all GPU work"),
                              ("package", gpu_package_key, "")):
        if digest is None:
            out.append(PlannedStep(name, None, "pending", "key known once the previous step has run"))
            continue
        row, digest = (package_row(spec, ctx, keyfn, digest, weights) if name == "package"
                       else cached_row(spec, ctx, name, keyfn(spec, digest), note))
        out.append(row)
    out.append(PlannedStep("upload", digest[:24] if digest else None, "pending" if digest is None else "unknown",
                           "engines/checkpoints go to S3 with the repository"))
    out.append(PlannedStep("deploy", None, "pending", f"serve on GPUs {spec.gpus.ids[:spec.parallel.world_size]} "
                                                      f"({spec.gpus.type})"))
    out.append(rollout_row(spec, facts))
    out.append(PlannedStep("benchmark", None, "runs", "always measured again"))
    return out
