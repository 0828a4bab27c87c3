"""A run's GPU decision, made once after the fetch: the rollout (surge, shared or reload, its KV cap and expected
gap), the GPU sets backends take turns on, and the set the candidate gets, which the build runs on too.

Decided from the fetched files (config.json and friends in the fetch step's folder), never from a second Hub read,
and kept as a plain dict in the run's context and its manifest: package (the shared rollout's KV cap), stage (the
candidate's GPUs, stop-first under reload) and `stoker rollback` (a reload run is rolled back stop-first too) read
it instead of deciding again. Pure: facts and the GPUs the live backend holds in, a dict out.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from . import facts as facts_mod
from .rollout import Rollout, plan_rollout


def decide(spec, facts, held: tuple[int, ...]) -> dict:
    """The decision for ``spec`` given the model's ``facts`` (None: unknown) and the device ids the live backend
    holds (() when nothing serves)."""
    planned = plan_rollout(spec, facts)
    sets = generation_sets(spec, planned)
    candidate = next((s for s in sets if sorted(s) != sorted(held)), sets[0])
    return {"rollout": planned.to_dict() if planned else None, "sets": [list(s) for s in sets],
            "held": list(held), "candidate": list(candidate), "facts": "fetched files" if facts else "unknown"}


def from_fetch(spec, folder: Path, held: tuple[int, ...]) -> dict:
    """decide() from the fetch step's folder."""
    facts = facts_mod.from_folder(folder) if (folder / "config.json").is_file() else None
    return decide(spec, facts, held)


def generation_sets(spec, planned: Rollout | None) -> tuple[tuple[int, ...], ...]:
    """A generation's GPUs (every replica's, in order); surge: two such sets, taken in turn."""
    if planned is None:
        return (tuple(spec.gpus.ids[:spec.parallel.world_size * spec.deploy.replicas]),)
    return (planned.blue, planned.green) if planned.choice == "surge" else (planned.blue,)


def planned(decision: dict | None) -> Rollout | None:
    """The Rollout a decision recorded (None: none was estimated, or no decision)."""
    rec = (decision or {}).get("rollout")
    if not rec:
        return None
    values = {f.name: rec[f.name] for f in fields(Rollout)}
    for name in ("blue", "green", "unused"):
        values[name] = tuple(values[name])
    return Rollout(**values)


def sets_of(decision: dict) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in decision["sets"])


def build_gpus(spec, decision: dict | None) -> tuple[int, ...]:
    """The GPUs a build step uses: the first replica's share of the candidate's set (the spec's first GPUs when
    no decision was made)."""
    world = spec.parallel.world_size
    return tuple((decision or {}).get("candidate") or spec.gpus.ids)[:world]


def with_cap(spec, decision: dict | None):
    """``spec`` with a shared rollout's KV cap in its runtime section; unchanged otherwise."""
    p = planned(decision)
    if p is None or p.choice != "shared" or p.max_tokens_in_paged_kv_cache is None:
        return spec
    runtime = spec.runtime.model_copy(update={"max_tokens_in_paged_kv_cache": p.max_tokens_in_paged_kv_cache})
    return spec.model_copy(update={"runtime": runtime})
