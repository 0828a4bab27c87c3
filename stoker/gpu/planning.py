"""`stoker plan` / `stoker render` for GPU targets: model facts, rules, cache keys, container steps."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import StokerError
from . import facts as facts_mod
from . import matrix, placement, rollout, rules, trtllm
from .facts import ModelFacts


def model_facts(spec) -> ModelFacts | None:
    """Local checkpoint, else stoker's known_models.json, else the Hub's config files (light reads)."""
    m = spec.model
    if m.local_path is not None:
        return facts_mod.from_folder(m.local_path) if (m.local_path / "config.json").is_file() else None
    known = facts_mod.known(m.repo_id)
    if known is not None:
        return known
    return _hub_facts(spec)


def _hub_facts(spec) -> ModelFacts | None:
    from huggingface_hub import hf_hub_download

    from ..storage import hub
    from ..storage.source import hub_endpoint, hub_token

    m = spec.model
    token, endpoint = hub_token(m), hub_endpoint(m)
    try:
        api = hub._api(endpoint, token)
        info = api.model_info(m.repo_id, revision=m.revision)
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json"):
                try:
                    hf_hub_download(m.repo_id, name, revision=info.sha, endpoint=endpoint, token=token or False,
                                    local_dir=tmp)
                except Exception:
                    if name == "config.json":
                        raise
            return facts_mod.from_folder(Path(tmp), "hub", gated=bool(getattr(info, "gated", False)))
    except Exception:  # noqa: BLE001 - unreachable or unreadable: the plan says facts are unknown
        return None


def token_present(spec) -> bool:
    from ..storage.source import hub_token

    if spec.model.local_path is not None:
        return True
    try:
        return hub_token(spec.model) is not None
    except StokerError:
        return False


def check_spec(spec) -> tuple[ModelFacts | None, list[rules.Finding]]:
    """Facts + every finding; raises PlanRefused (one line, naming the fix) on the first refusal."""
    facts = model_facts(spec)
    findings = rules.enforce(rules.check(spec, facts, token_present(spec)))
    planned = rollout.plan_rollout(spec, facts)  # a rollout that cannot work is refused here too, in one line
    if planned is not None:  # and a build that fits neither on spare GPUs nor beside what serves (placement.py)
        placed = placement.plan_rebuild(spec, facts, planned)
        if placed["need_bytes"]:
            findings = [*findings, rules.Finding("note", "build", placement.note(placed))]
    if planned is not None and planned.choice == "surge":
        # The GPUs beyond one backend hold the next candidate: the rollout row says which, and which stay unused.
        findings = [f for f in findings if f.field != "gpus.count"]
    return facts, findings


def rollout_row(spec, facts):
    """`stoker plan`'s rollout row: surge, shared or reload, and what it costs (stoker/gpu/rollout.py)."""
    from ..plan.rows import PlannedStep

    planned = rollout.plan_rollout(spec, facts)
    if planned is None:
        return PlannedStep("rollout", None, "unknown", "the engine's size is not estimated (model facts unknown or "
                                                       "build.engine_dir): surge, shared or reload not chosen")
    return PlannedStep("rollout", None, planned.choice, planned.note())


def image_summary(spec) -> dict:
    info = matrix.image_info(spec.deploy.image)
    return {"image": spec.deploy.image, "digest": spec.deploy.image_digest,
            **({k: getattr(info, k) for k in ("trtllm", "tensorrt", "cuda", "python", "modelopt")} if info else {})}


def stoker_src() -> Path:
    """The folder that holds the `stoker` package (mounted read-only into GPU steps)."""
    return Path(__file__).resolve().parents[2]


def env_executor_mode() -> str:
    return os.environ.get("STOKER_EXECUTOR", "auto")


def plan_gpu(spec, ctx) -> list:
    """The GPU plan: refuse (PlanRefused) before any GPU time, else checks' notes + each step's key and status."""
    from ..storage.hub import HubUnavailable
    from ..cache.keys import fetch_key, gpu_build_key, gpu_package_key
    from ..plan.rows import PlannedStep, cached_row, package_row
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
