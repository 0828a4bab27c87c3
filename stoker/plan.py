"""`stoker plan`: each step's cache key and whether it would hit, without heavy work.

Only light calls are made: the Hub revision lookup, a HEAD-sized S3 read and a
Docker container listing. A step whose input is not cached yet cannot have a
key before it runs; the plan says so instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import targets
from .errors import StokerError
from .keys import benchmark_key
from .run import RunContext
from .spec import Spec


@dataclass(frozen=True)
class PlannedStep:
    name: str
    key: str | None
    status: str  # "hit" | "miss" | "pending" | "runs" | "unknown"
    note: str = ""
    backend: dict | None = field(default=None, compare=False)  # deploy: the backend already serving the digest


def plan(spec: Spec, ctx: RunContext) -> list[PlannedStep]:
    """Each of the target's steps (stoker/targets/), refused first where the spec or the model cannot work."""
    warnings = check_evaluation(spec)
    steps = targets.get(spec.target).plan(spec, ctx)
    target = targets.get(spec.target)
    if spec.routing.heavy:  # a miss runs on the routed deployment's pool, not in this run's process
        where = f"runs on {spec.routing.heavy}'s pool (routing.heavy)"
        steps = [replace(s, note="; ".join(filter(None, [s.note, where])))
                 if s.name in ("quantize", "build") and s.status in ("miss", "pending") else s for s in steps]
    if spec.evaluation.enabled and target.evaluates:
        source = ("the unquantized build, scored here" if target.baseline_source == "runtime"
                  else "the bf16 build's record in S3")
        what = "" if target.scores_perplexity(spec) else " (greedy agreement only: no context logits)"
        steps.append(PlannedStep("evaluate", None, "runs", "; ".join(
            [f"against {source}{what}; cached by served digest, data and code", *warnings])))
    elif spec.evaluation.enabled:
        steps.append(PlannedStep("evaluate", None, "skipped", target.evaluation_note))
    return steps


def check_evaluation(spec: Spec) -> list[str]:
    """Refuse (SpecError, one line) a missing, empty or too short evaluation text or an unknown Hub dataset;
    return warnings (evaluation text = calibration text)."""
    import tempfile
    from pathlib import Path

    from .evaluation.source import plan_check

    if not (spec.evaluation.enabled and targets.get(spec.target).evaluates):
        return []
    with tempfile.TemporaryDirectory() as tmp:
        return plan_check(spec, Path(tmp))


def check_model(spec: Spec) -> None:
    """Refuse (PlanRefused, one line) a model the format or target cannot take, from config.json alone:
    before download or calibration. Facts come from the local checkpoint, known_models.json or the Hub."""
    from .gpu.planning import model_facts

    targets.get(spec.target).check_model(spec, model_facts(spec))


def upload_step(spec: Spec, digest: str | None) -> PlannedStep:
    """Whether S3 already holds the repository of this package digest (its completion marker)."""
    if digest is None:
        return PlannedStep("upload", None, "pending", "key is the package digest")
    from . import s3

    try:
        marker = s3.read_marker(s3.client(spec.storage), spec.storage, digest)
    except StokerError as err:
        return PlannedStep("upload", digest[:24], "unknown", str(err))
    where = f"s3://{spec.storage.bucket}/{s3.repo_prefix(spec.storage, digest)}"
    return PlannedStep("upload", digest[:24], "hit" if marker else "miss", where)


def cached_row(spec: Spec, ctx: RunContext, step: str, key: str, note: str = "") -> tuple[PlannedStep, str | None]:
    """A cached step's row and its output digest: a local hit, a hit in the shared S3 cache (storage.shared_cache:
    the run would download it), or a miss. A plan never fails on S3: an unreachable cache is "unknown"."""
    entry = ctx.store.lookup(step, key)
    if entry is not None:
        return PlannedStep(step, key, "hit", note), entry.digest
    if spec.storage.shared_cache:
        from . import s3
        from .cache import remote

        try:
            found = remote.lookup(s3.client(spec.storage), spec.storage, step, key)
        except Exception as err:  # noqa: BLE001 - reported in the row
            return PlannedStep(step, key, "unknown", f"shared cache not readable: {str(err).splitlines()[0][:80]}"), None
        if found is not None:
            where = f"in the shared cache ({found.bytes / 1e6:.1f} MB to download)"
            return PlannedStep(step, key, "hit", f"{note}; {where}" if note else where), found.digest
    return PlannedStep(step, key, "miss", note), None


def serving_step(spec: Spec, digest: str | None) -> PlannedStep:
    """Whether a ready backend behind the deployment's proxy already serves this package digest."""
    if digest is None:
        return PlannedStep("deploy", None, "pending", "serves the package digest")
    try:
        import docker

        from .serving.promote import BackendRef, observe_backends

        d = spec.deploy
        client = docker.DockerClient(base_url=d.docker_host) if d.docker_host else docker.from_env()
        serving = next((b for b in observe_backends(client, d.name) if b.digest == digest and b.ready), None)
    except Exception as err:  # noqa: BLE001 - a plan must not fail on a missing daemon
        return PlannedStep("deploy", digest[:24], "unknown", f"Docker not reachable: {str(err).splitlines()[0][:80]}")
    if serving is not None:
        return PlannedStep("deploy", digest[:24], "hit", f"already serving in {serving.container}",
                           backend=BackendRef.of(serving).to_dict())
    return PlannedStep("deploy", digest[:24], "miss", f"new backend behind deployment {spec.deploy.name!r}'s proxy")


def benchmark_step(spec: Spec, ctx: RunContext, backend: dict | None) -> PlannedStep:
    """The benchmark reuses the figures of the backend that already serves, measured with these settings."""
    if spec.benchmark.remeasure:
        return PlannedStep("benchmark", None, "runs", "benchmark.remeasure: measured every run")
    if backend is None:
        return PlannedStep("benchmark", None, "runs", "measured on the new backend")
    key = benchmark_key(backend, spec.benchmark.model_dump(mode="json"))
    if ctx.store.lookup("benchmark", key) is not None:
        return PlannedStep("benchmark", key, "hit", "this backend was measured with these settings")
    return PlannedStep("benchmark", key, "runs", "this backend was not measured with these settings")


def render_plan(steps: list[PlannedStep]) -> str:
    lines = [f"{'step':<10} {'cache':<8} {'key':<26} note"]
    for s in steps:
        lines.append(f"{s.name:<10} {s.status:<8} {(s.key or '-'):<26} {s.note}".rstrip())
    return "\n".join(lines)
