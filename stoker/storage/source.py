"""Where the weights come from: resolving a Hub revision or a local folder to an identity."""

from __future__ import annotations

import os
from pathlib import Path

from . import hub
from .digest import file_sha256, json_digest
from ..errors import SpecError
from ..spec.schema import ModelSource, Spec


def hub_token(model: ModelSource) -> str | None:
    """The Hub token from a Prefect Secret (if named) or the environment; never logged."""
    if model.token_secret:
        from prefect.blocks.system import Secret

        try:
            value = Secret.load(model.token_secret).get()
        except ValueError:
            raise SpecError(f"model.token_secret: no Prefect Secret block named {model.token_secret!r}") from None
        if not value:
            raise SpecError(f"model.token_secret: Prefect Secret {model.token_secret!r} is empty")
        return value
    return os.environ.get(model.token_env) or None


def hub_endpoint(model: ModelSource) -> str:
    return model.endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def local_selection(root: Path, allow_pickle: bool) -> tuple[list[str], str]:
    """Files a local checkpoint folder contributes, and their content digest."""
    if not root.is_dir():
        raise SpecError(f"model.local_path: {root} is not a folder")
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    chosen = hub.select_files(names, allow_pickle=allow_pickle)
    return chosen, json_digest({n: file_sha256(root / n) for n in chosen})


def resolve_source(spec: Spec) -> tuple[str, dict]:
    """The commit sha (Hub) or content digest (local) that identifies the weights."""
    m = spec.model
    if m.local_path is not None:
        _, digest = local_selection(m.local_path, m.allow_pickle)
        return digest, {"local_path": str(m.local_path), "sha": digest}
    sha = hub.resolve(m.repo_id, m.revision, hub_endpoint(m), hub_token(m))
    return sha, {"repo_id": m.repo_id, "revision": m.revision, "sha": sha, "endpoint": hub_endpoint(m)}
