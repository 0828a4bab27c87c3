"""Per-run context and the typed result every step returns."""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, Field

from .home import stoker_home  # noqa: F401 -- re-exported: stoker.run.stoker_home is what most callers import
from .spec.schema import Storage
from .storage.store import Entry, StepStore

STEPS = ("preflight", "fetch", "quantize", "build", "package", "upload", "deploy", "benchmark")


class RunContext(BaseModel):
    run_id: str
    home: Path
    # The spec's storage when `storage.shared_cache` is on: steps then read through S3 (stoker/cache/).
    shared_cache: Storage | None = None
    # Set while a routed run's results are read (flows/heavy_steps.py): a cached step found in neither layer is
    # an error naming that deployment, never a silent build on this (maybe GPU-less) host.
    routed_to: str | None = None
    # Whether this run uses the GPU targets' stand-in (stoker/gpu/standin.py): decided once, at the run's start, from
    # STOKER_STANDIN; what builds or serves reads it here, and the manifest and the backends' labels record it.
    standin: bool = False
    # GPU targets: the run's GPU decision (stoker/gpu/decision.py: rollout, GPU sets, the candidate's set), made once
    # after the fetch from the fetched files; build, package and stage read it here, the manifest records it.
    gpu: dict | None = None

    @classmethod
    def new(cls, home: Path | None = None) -> RunContext:
        run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        return cls(run_id=run_id, home=(home or stoker_home()))

    @property
    def runner(self) -> str:
        """Who runs this flow: host and STOKER_HOME (each worker of a fleet has its own home)."""
        return f"{socket.gethostname()}:{self.home}"

    @property
    def run_dir(self) -> Path:
        return self.home / "runs" / self.run_id

    @property
    def store(self) -> StepStore:
        return StepStore(self.home / "cache")


class Output(BaseModel):
    uri: str
    sha256: str
    bytes: int


class StepResult(BaseModel):
    """What a step did: the manifest's `steps.<name>` entry plus what the next step needs."""

    name: str
    status: str = "completed"
    cache_hit: bool = False
    duration_s: float = 0.0
    key: str | None = None
    digest: str | None = None
    path: Path | None = None  # local output folder, for the next step
    outputs: list[Output] = Field(default_factory=list)
    detail: dict = Field(default_factory=dict)
    error: str | None = None
    # Cached steps: where the result came from ("local", "remote": the shared cache, "built": run here), the
    # bytes downloaded from the shared cache, and who ran it (host:STOKER_HOME), so a fleet's manifests say
    # which worker executed each heavy step.
    layer: str | None = None
    pulled_bytes: int = 0
    ran_on: str | None = None
    routed: dict | None = None  # set when another worker's flow run executed the step (flows/heavy_steps.py)
    # When it began (epoch s): steps may overlap (the baseline runs while the candidate starts), so the manifest's
    # orchestration overhead is the wall time no step covered, not the wall minus the sum of durations.
    started_at: float | None = None

    def manifest_entry(self) -> dict:
        d = {"status": self.status, "cache_hit": self.cache_hit, "duration_s": round(self.duration_s, 3),
             "key": self.key, "digest": self.digest, "outputs": [o.model_dump() for o in self.outputs]}
        for name in ("layer", "ran_on", "routed"):
            if getattr(self, name):
                d[name] = getattr(self, name)
        if self.pulled_bytes:
            d["pulled_bytes"] = self.pulled_bytes
        if self.error:
            d["error"] = self.error
        if self.detail:
            d["detail"] = self.detail
        return d


def entry_outputs(entry: Entry) -> list[Output]:
    return [Output(uri=(entry.output_dir / f.path).as_uri(), sha256=f.sha256, bytes=f.bytes) for f in entry.files]


def cached_step(ctx: RunContext, name: str, key: str, produce: Callable[[Path], dict],
                log: Callable[[str], None]) -> StepResult:
    """Reuse the stored result for `key`, or produce and publish it atomically."""
    t0, began = time.perf_counter(), time.time()
    if ctx.routed_to is not None:
        produce = _not_here(ctx.routed_to, name, key)
    if ctx.shared_cache is not None:
        from .cache.shared import SharedStore

        entry, came_from = SharedStore(ctx.store, ctx.shared_cache).get(name, key, produce, log)
        return StepResult(name=name, cache_hit=came_from != "built", duration_s=time.perf_counter() - t0, key=key,
                          digest=entry.digest, path=entry.output_dir, outputs=entry_outputs(entry),
                          detail=entry.detail, layer=came_from,
                          pulled_bytes=sum(f.bytes for f in entry.files) if came_from == "remote" else 0,
                          ran_on=ctx.runner if came_from == "built" else None, started_at=began)
    store = ctx.store
    entry = store.lookup(name, key)
    hit = entry is not None
    if hit:
        log(f"{name}: cache hit {key} ({len(entry.files)} files)")
    else:
        log(f"{name}: cache miss {key}, running")
        entry = store.publish(name, key, produce)
    return StepResult(name=name, cache_hit=hit, duration_s=time.perf_counter() - t0, key=key,
                      digest=entry.digest, path=entry.output_dir, outputs=entry_outputs(entry),
                      detail=entry.detail, layer="local" if hit else "built", ran_on=None if hit else ctx.runner,
                      started_at=began)


def _not_here(deployment: str, name: str, key: str) -> Callable[[Path], dict]:
    def refuse(out: Path) -> dict:
        from .errors import StokerError

        raise StokerError(f"{name}: {key} is not in the shared cache after the routed run of {deployment}; "
                          "it runs there, not here")
    return refuse
