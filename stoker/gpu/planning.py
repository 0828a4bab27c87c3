"""`stoker plan` / `stoker render` for GPU targets: model facts, rules, cache keys, container steps."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import StokerError
from . import facts as facts_mod
from . import matrix, placement, rollout, rules
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


def image_summary(spec) -> dict:
    info = matrix.image_info(spec.deploy.image)
    return {"image": spec.deploy.image, "digest": spec.deploy.image_digest,
            **({k: getattr(info, k) for k in ("trtllm", "tensorrt", "cuda", "python", "modelopt")} if info else {})}


def stoker_src() -> Path:
    """The folder that holds the `stoker` package (mounted read-only into GPU steps)."""
    return Path(__file__).resolve().parents[2]


def env_executor_mode() -> str:
    return os.environ.get("STOKER_EXECUTOR", "auto")
