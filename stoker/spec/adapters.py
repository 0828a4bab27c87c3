"""The spec's LoRA adapters: each a model id clients ask for, a Hub repo pinned like the base, and the rank limit.

Pure data and one-line checks; what an adapter holds is checked against the base by stoker.adapters (at plan, from
its adapter_config.json, and after its fetch, from its tensors' shapes), before any heavy step.
"""

from __future__ import annotations

import hashlib
import re

from pydantic import Field

from .base import RepoId, _Section

# A model id in OpenAI requests and in Triton's error messages: no spaces, no slashes.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def task_id(name: str) -> int:
    """The `lora_task_id` of adapter ``name``: stable, from the name alone, in 1..2^53 (exact in JSON clients), so a
    client's id keeps meaning the same adapter across revisions and rollouts."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % (1 << 53) or 1


class Adapter(_Section):
    """One LoRA adapter of the base model, served beside it and selected per request by ``name``."""

    name: str = Field(description="the model id clients ask for (OpenAI `model`); letters, digits, . _ -")
    repo_id: RepoId
    revision: str = Field("main", description="branch, tag or commit; resolved to a commit and recorded")
    token_env: str = Field("HF_TOKEN", description="environment variable holding the Hub token")
    token_secret: str | None = Field(None, description="Prefect Secret block holding the Hub token")


class Lora(_Section):
    max_rank: int = Field(64, ge=1, le=1024, description="the largest adapter rank served (LoRA r)")


def check_names(adapters: list[Adapter], taken: dict[str, str]) -> None:
    """Names well-formed, unique, and none of the deployment's own model ids (``taken``: id → what it is)."""
    seen: set[str] = set()
    ids: dict[int, str] = {}
    for a in adapters:
        if not _NAME.match(a.name):
            raise ValueError(f"adapters: name {a.name!r}: letters, digits, '.', '_' or '-', at most 64")
        if a.name in seen:
            raise ValueError(f"adapters: the name {a.name!r} is given twice; each adapter needs its own")
        if a.name in taken:
            raise ValueError(f"adapters: the name {a.name!r} is {taken[a.name]}; choose another")
        seen.add(a.name)
        # Task ids are a hash of the name (mod 2^53): two names of one build must not select one adapter's weights.
        other = ids.setdefault(task_id(a.name), a.name)
        if other != a.name:
            raise ValueError(f"adapters: {a.name!r} and {other!r} hash to one lora_task_id ({task_id(a.name)}); "
                             "rename one")
