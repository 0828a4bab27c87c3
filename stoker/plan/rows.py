"""The rows of `stoker plan` that targets share: a cached step, the upload, the serving backend, the benchmark.

Apart from stoker.plan.compose, which asks the targets for their rows: the targets build theirs from these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import StokerError
from ..cache.keys import benchmark_key, benchmark_settings
from ..run import RunContext
from ..spec.schema import Spec


@dataclass(frozen=True)
class PlannedStep:
    name: str
    key: str | None
    status: str  # "hit" | "miss" | "pending" | "runs" | "unknown"
    note: str = ""
    backend: dict | None = field(default=None, compare=False)  # deploy: the backend already serving the digest


def upload_step(spec: Spec, digest: str | None) -> PlannedStep:
    """Whether S3 already holds the repository of this package digest (its completion marker)."""
    if digest is None:
        return PlannedStep("upload", None, "pending", "key is the package digest")
    from ..storage import s3

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
        from ..storage import s3
        from ..cache import remote

        try:
            found = remote.lookup(s3.client(spec.storage), spec.storage, step, key)
        except Exception as err:  # noqa: BLE001 - reported in the row
            return PlannedStep(step, key, "unknown", f"shared cache not readable: {str(err).splitlines()[0][:80]}"), None
        if found is not None:
            where = f"in the shared cache ({found.bytes / 1e6:.1f} MB to download)"
            return PlannedStep(step, key, "hit", f"{note}; {where}" if note else where), found.digest
    return PlannedStep(step, key, "miss", note), None


def package_row(spec: Spec, ctx: RunContext, keyfn, build_digest: str, weights_digest: str | None,
                note: str = "") -> tuple[PlannedStep, str | None]:
    """The package row: its key takes the adapters step's digest (a new adapter revision repackages, nothing
    before it), known only once that step is cached for these weights."""
    adapters = None
    if spec.adapters:
        from .. import adapters as lora
        from ..cache.keys import adapters_key

        pending = PlannedStep("package", None, "pending", "key known once the adapters are fetched"), None
        if weights_digest is None:  # the weights are not fetched yet: no need to ask the Hub for the adapters' shas
            return pending
        entry = ctx.store.lookup("adapters", adapters_key(spec, lora.resolve(spec), weights_digest))
        if entry is None:
            return pending
        adapters = entry.digest
    return cached_row(spec, ctx, "package", keyfn(spec, build_digest, adapters), note)


def serving_step(spec: Spec, digest: str | None) -> PlannedStep:
    """Whether a ready backend behind the deployment's proxy already serves this package digest."""
    if digest is None:
        return PlannedStep("deploy", None, "pending", "serves the package digest")
    try:
        import docker

        from ..serving.promote import BackendRef, observe_backends

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
    key = benchmark_key(backend, benchmark_settings(spec))
    if ctx.store.lookup("benchmark", key) is not None:
        return PlannedStep("benchmark", key, "hit", "this backend was measured with these settings")
    return PlannedStep("benchmark", key, "runs", "this backend was not measured with these settings")
