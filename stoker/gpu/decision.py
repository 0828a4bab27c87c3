"""A run's GPU decision, made once after the fetch: the rollout (surge, shared or reload, its KV cap and expected
gap), the GPU sets backends take turns on, the set the candidate gets, and where the build runs (placement.py: on
GPUs nothing holds, or beside the live backend only where it fits).

Decided from the fetched files (config.json and friends in the fetch step's folder), never from a second Hub read,
and kept as a plain dict in the run's context and its manifest: package (the shared rollout's KV cap), stage (the
candidate's GPUs, stop-first under reload) and `stoker rollback` (a reload run is rolled back stop-first too) read
it instead of deciding again. Pure: facts and the GPUs the live backend holds in, a dict out.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from . import facts as facts_mod
from .placement import baseline_gpus, place_baseline, place_build
from .rollout import Rollout, plan_rollout


def decide(spec, facts, held: tuple[int, ...]) -> dict:
    """The decision for ``spec`` given the model's ``facts`` (None: unknown) and the device ids the live backend
    holds (() when nothing serves)."""
    planned = plan_rollout(spec, facts)
    sets = generation_sets(spec, planned)
    candidate = next((s for s in sets if sorted(s) != sorted(held)), sets[0])
    # Where the build runs: GPUs nothing holds, or beside the live backend when it fits (placement.py); refused
    # here, before any heavy step, when neither. Unestimated (facts unknown): the candidate's first GPUs.
    build = (place_build(spec, facts, planned, held) if planned is not None
             else {"gpus": list(candidate[:spec.parallel.world_size]), "where": "not estimated"})
    baseline = (place_baseline(spec, facts, planned, held) if planned is not None
                else {"gpus": list(candidate) if not held else None, "why": "model facts unknown"})
    return {"rollout": planned.to_dict() if planned else None, "sets": [list(s) for s in sets],
            "held": list(held), "candidate": list(candidate), "build": build, "baseline": baseline,
            "facts": "fetched files" if facts else "unknown"}


def for_baseline(decision: dict) -> dict:
    """The decision the bf16 baseline is staged with: its own GPUs, beside (never instead of) what serves, so
    staging neither stops the live backend (no reload rollout) nor shares its GPUs. KeyError-free for old records."""
    gpus = (decision.get("baseline") or {}).get("gpus")
    # Its build runs there too: free GPUs, where a bf16 backend fits alone.
    return {"rollout": None, "sets": [list(gpus or [])], "held": decision.get("held", []),
            "candidate": list(gpus or []), "build": {"gpus": list(gpus or []), "where": "the baseline's GPUs"},
            "facts": decision.get("facts"), "settled": "the baseline's own GPUs"}


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
    """The GPUs a build step uses: the decision's placement (the spec's first GPUs when no decision was made)."""
    world = spec.parallel.world_size
    placed = ((decision or {}).get("build") or {}).get("gpus")
    return tuple(placed or (decision or {}).get("candidate") or spec.gpus.ids)[:world]


def with_cap(spec, decision: dict | None):
    """``spec`` with a shared rollout's KV cap in its runtime section; unchanged otherwise."""
    p = planned(decision)
    if p is None or p.choice != "shared" or p.max_tokens_in_paged_kv_cache is None:
        return spec
    runtime = spec.runtime.model_copy(update={"max_tokens_in_paged_kv_cache": p.max_tokens_in_paged_kv_cache})
    return spec.model_copy(update={"runtime": runtime})


def settle(spec, earlier: dict, held: tuple[int, ...]) -> dict:
    """The decision staging uses, taken under the deploy lock from what serves then (``held``): another run of the
    deployment may have switched since ``earlier`` was made after the fetch. The rollout and the build's placement
    stay (the build has run); the candidate's set and the baseline's GPUs are chosen again from ``held``, once."""
    sets = sets_of(earlier) or ((),)
    candidate = next((s for s in sets if sorted(s) != sorted(held)), sets[0])
    baseline = dict(earlier.get("baseline") or {})
    if baseline.get("fits", baseline.get("gpus") is not None):  # refused for memory: stays refused
        baseline = baseline_gpus(spec, held, baseline.get("need_bytes"))
    return {**earlier, "held": list(held), "candidate": list(candidate), "baseline": baseline,
            "settled": "under the deploy lock"}
