"""`stoker plan`: each step's cache key and whether it would hit, without heavy work.

Only light calls are made: the Hub revision lookup, a HEAD-sized S3 read and a
Docker container listing. A step whose input is not cached yet cannot have a
key before it runs; the plan says so instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import StokerError
from .keys import build_key, fetch_key, package_key, quantize_key
from .run import RunContext
from .spec import Spec


@dataclass(frozen=True)
class PlannedStep:
    name: str
    key: str | None
    status: str  # "hit" | "miss" | "pending" | "runs" | "unknown"
    note: str = ""


def plan(spec: Spec, ctx: RunContext) -> list[PlannedStep]:
    from .source import resolve_source

    if spec.target != "reference":
        # GPU targets: version matrix + GPU rules refuse bad specs here, before any GPU time.
        from .gpu.planning import plan_gpu

        return plan_gpu(spec, ctx)

    check_model(spec)
    store = ctx.store
    out: list[PlannedStep] = []
    source_id, source = resolve_source(spec)
    digest: str | None = None
    chain = (("fetch", lambda d: fetch_key(spec, source_id)), ("quantize", lambda d: quantize_key(spec, d)),
             ("build", lambda d: build_key(spec, d)), ("package", lambda d: package_key(spec, d)))
    for i, (name, keyfn) in enumerate(chain):
        if i > 0 and digest is None:
            out.append(PlannedStep(name, None, "pending", "key known once the previous step has run"))
            continue
        key = keyfn(digest)
        entry = store.lookup(name, key)
        note = f"sha {source.get('sha')}" if name == "fetch" else ""
        out.append(PlannedStep(name, key, "hit" if entry else "miss", note))
        digest = entry.digest if entry else None
    out.append(_upload(spec, digest))
    out.append(_deploy(spec, digest))
    out.append(PlannedStep("benchmark", None, "runs", "always measured again"))
    return out


def check_model(spec: Spec) -> None:
    """Refuse (PlanRefused, one line) a model the format or target cannot take, from config.json alone:
    before download or calibration. Facts come from the local checkpoint, known_models.json or the Hub."""
    from .gpu.planning import model_facts
    from .model_checks import enforce

    enforce(spec, model_facts(spec))


def _upload(spec: Spec, digest: str | None) -> PlannedStep:
    if digest is None:
        return PlannedStep("upload", None, "pending", "key is the package digest")
    from . import s3

    try:
        marker = s3.read_marker(s3.client(spec.storage), spec.storage, digest)
    except StokerError as err:
        return PlannedStep("upload", digest[:24], "unknown", str(err))
    where = f"s3://{spec.storage.bucket}/{s3.repo_prefix(spec.storage, digest)}"
    return PlannedStep("upload", digest[:24], "hit" if marker else "miss", where)


def _deploy(spec: Spec, digest: str | None) -> PlannedStep:
    if digest is None:
        return PlannedStep("deploy", None, "pending", "serves the package digest")
    try:
        import docker

        from .serving.promote import observe_backends

        d = spec.deploy
        client = docker.DockerClient(base_url=d.docker_host) if d.docker_host else docker.from_env()
        serving = next((b for b in observe_backends(client, d.name) if b.digest == digest and b.ready), None)
    except Exception as err:  # noqa: BLE001 - a plan must not fail on a missing daemon
        return PlannedStep("deploy", digest[:24], "unknown", f"Docker not reachable: {str(err).splitlines()[0][:80]}")
    if serving is not None:
        return PlannedStep("deploy", digest[:24], "hit", f"already serving in {serving.container}")
    return PlannedStep("deploy", digest[:24], "miss", f"new backend behind deployment {spec.deploy.name!r}'s proxy")


def render_plan(steps: list[PlannedStep]) -> str:
    lines = [f"{'step':<10} {'cache':<8} {'key':<26} note"]
    for s in steps:
        lines.append(f"{s.name:<10} {s.status:<8} {(s.key or '-'):<26} {s.note}".rstrip())
    return "\n".join(lines)
