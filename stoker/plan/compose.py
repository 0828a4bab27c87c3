"""`stoker plan`: each step's cache key and whether it would hit, without heavy work.

Only light calls are made: the Hub revision lookup, a HEAD-sized S3 read and a
Docker container listing. A step whose input is not cached yet cannot have a
key before it runs; the plan says so instead of guessing.
"""

from __future__ import annotations

from dataclasses import replace

from .. import targets
from .rows import PlannedStep
from ..run import RunContext
from ..spec.schema import Spec


def plan(spec: Spec, ctx: RunContext) -> list[PlannedStep]:
    """Each of the target's steps (stoker/targets/), refused first where the spec or the model cannot work."""
    from ..storage.hub import resolving_once

    with resolving_once():  # every row sees one sha per revision (base and adapters), each asked of the Hub once
        return _plan(spec, ctx)


def _plan(spec: Spec, ctx: RunContext) -> list[PlannedStep]:
    kubernetes = kubernetes_row(spec)  # refused (one line) before any Hub or S3 call
    warnings = check_evaluation(spec)
    adapter_notes = check_adapters(spec)  # refused here, before the target's own rows, when they cannot serve
    steps = targets.get(spec.target).plan(spec, ctx)
    target = targets.get(spec.target)
    at = next((i + 1 for i, s in enumerate(steps) if s.name == "fetch"), 0)
    steps[at:at] = [PlannedStep("adapters", None, "checked", note) for note in adapter_notes]
    if spec.routing.heavy:  # a miss runs on the routed deployment's pool, not in this run's process
        where = f"runs on {spec.routing.heavy}'s pool (routing.heavy)"
        steps = [replace(s, note="; ".join(filter(None, [s.note, where])))
                 if s.name in ("quantize", "build") and s.status in ("miss", "pending") else s for s in steps]
    serves = what_serves(spec, target.gpu_sets(spec))
    notes = {"upload": signing_note(spec), "fetch": model_signature_note(spec)}
    steps = [replace(s, note="; ".join(filter(None, [s.note, notes[s.name]]))) if notes.get(s.name) else s
             for s in steps]
    steps = [replace(s, note="; ".join(filter(None, [s.note, serves]))) if s.name == "deploy" else s for s in steps]
    if spec.evaluation.enabled and target.evaluates:
        if target.baseline_source == "runtime":
            source = "the unquantized build, scored here"
        elif spec.quantization.format == "none":
            source = "itself (this bf16 build, checked and recorded in S3 for the quantized builds of these weights)"
        elif spec.evaluation.require_recorded_baseline:
            source = "the bf16 build's record in S3 (required: refused before the build when missing)"
        else:
            source = ("the bf16 build's record in S3, recorded first when missing (the none build of these weights "
                      "on this target: staged, scored, removed)")
        what = "" if target.scores_perplexity(spec) else " (greedy agreement only: no context logits)"
        steps.append(PlannedStep("evaluate", None, "runs", "; ".join(
            [f"against {source}{what}; cached by served digest, data and code", *warnings])))
    elif spec.evaluation.enabled:
        steps.append(PlannedStep("evaluate", None, "skipped", target.evaluation_note))
    return steps + ([kubernetes] if kubernetes else [])


def kubernetes_row(spec: Spec) -> PlannedStep | None:
    """With a kubernetes section: the rollout `stoker render --kubernetes` would write (stoker/kubernetes/strategy.py),
    or PlanRefused in one line."""
    if spec.kubernetes is None:
        return None
    from ..kubernetes import strategy

    chosen = strategy.derive(spec)
    return PlannedStep("kubernetes", None, chosen.kind, chosen.note)


def what_serves(spec: Spec, gpu_sets: tuple[tuple[int, ...], ...] = ()) -> str:
    """The deploy row's account of what will serve: replicas, each replica's GPUs, the stable address, its keys.

    ``gpu_sets`` are the target's generations (surge: the build after this one takes the second set); each
    generation is split into the replicas' sets of ``parallel.world_size`` GPUs.
    """
    d = spec.deploy
    n = d.replicas
    parts = [f"{n} replica{'s' if n > 1 else ''}"]
    if gpu_sets:
        size = max(1, len(gpu_sets[0]) // n)

        def per_replica(ids: tuple[int, ...]) -> str:
            return " | ".join(",".join(map(str, ids[i:i + size])) for i in range(0, len(ids), size))

        gens = [f"GPUs {per_replica(gpu_sets[0])}"] + [f"next build on {per_replica(g)}" for g in gpu_sets[1:]]
        parts.append(", ".join(gens))
    scheme = "https" if d.tls else "http"
    parts.append(f"listen {scheme}://{d.listen}:{d.ports.http} (gRPC :{d.ports.grpc}{', TLS' if d.tls else ''})")
    if d.api_keys is None:
        parts.append("no API keys" + (" (loopback)" if d.listen in ("127.0.0.1", "localhost", "::1") else ""))
    else:
        where = f"file {d.api_keys.file}" if d.api_keys.file else f"Prefect Secret block {d.api_keys.secret_block!r}"
        parts.append(f"API keys required ({where})")
    return "; ".join(parts)


def signing_note(spec: Spec) -> str:
    """The upload row's account of signed builds: signed or not, verified before a backend starts or not."""
    from ..storage.signing_keys import describe

    return describe(spec.signing)


def model_signature_note(spec: Spec) -> str:
    """The fetch row's account of the model's own model.sig (OpenSSF model signing)."""
    m = spec.model
    if m.require_signature:
        return f"model.sig required, verified with {m.public_key} before the weights download"
    if m.public_key is not None:
        return f"model.sig verified with {m.public_key} when the model carries one"
    return ""


def check_evaluation(spec: Spec) -> list[str]:
    """Refuse (SpecError, one line) a missing, empty or too short evaluation text or an unknown Hub dataset;
    return warnings (evaluation text = calibration text)."""
    import tempfile
    from pathlib import Path

    from ..evaluation.source import plan_check

    if not (spec.evaluation.enabled and targets.get(spec.target).evaluates):
        return []
    with tempfile.TemporaryDirectory() as tmp:
        return plan_check(spec, Path(tmp))


def check_model(spec: Spec) -> None:
    """Refuse (PlanRefused, one line) a model the format or target cannot take, from config.json alone:
    before download or calibration. Facts come from the local checkpoint, known_models.json or the Hub."""
    from ..gpu.planning import model_facts

    targets.get(spec.target).check_model(spec, model_facts(spec))


def check_adapters(spec: Spec) -> list[str]:
    """The spec's adapters against its target and base, from their adapter_config.json (stoker/adapters.py):
    PlanRefused in one line, else a note per adapter."""
    from .. import adapters

    target = targets.get(spec.target)
    return adapters.check_plan(spec, target.adapters_refusal)


def render_plan(steps: list[PlannedStep]) -> str:
    lines = [f"{'step':<10} {'cache':<8} {'key':<26} note"]
    for s in steps:
        lines.append(f"{s.name:<10} {s.status:<8} {(s.key or '-'):<26} {s.note}".rstrip())
    return "\n".join(lines)
