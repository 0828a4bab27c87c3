"""heavy_steps: fetch → the target's heavy steps (quantize, build), on the work pool where the resource is.

build_and_deploy starts it with `run_deployment` when the spec names a deployment in `routing.heavy` (a docker
pool of GPU hosts, say), waits for it, then reads its results through the shared step cache: this flow never
hands files back itself, so it may run in a container that is removed when it ends. Its manifest goes to S3
next to the others (runs/<run_id>/manifest.json) and records which host ran each step.
"""

from __future__ import annotations

import time

from prefect import flow

from flows.build_and_deploy import Steps
from stoker.errors import one_line
from stoker.record.manifest import build_manifest, write_local
from stoker.run import RunContext, stoker_home
from stoker.spec.schema import Spec
from stoker.spec.load import target_of
from tasks.hub import fetch_weights
from tasks.s3 import store_manifest


@flow(name="heavy_steps", log_prints=True)
def heavy_steps(spec: Spec, run_id: str, standin: bool = False) -> dict:
    """Run and publish to the shared cache the spec's fetch, quantize and build; returns the manifest.

    Args:
        spec: the calling run's spec (its revision pinned to the commit it fetched).
        run_id: this run's id in S3's runs/ (the calling run's id + "-heavy").
        standin: the calling run's recorded stand-in decision (stoker/gpu/standin.py); this worker's environment
            does not change it.
    """
    if not spec.storage.shared_cache:
        raise ValueError("heavy_steps needs storage.shared_cache: true (its results leave through the bucket)")
    ctx = RunContext(run_id=run_id, home=stoker_home(), shared_cache=spec.storage, standin=standin)
    target = target_of(spec)  # a parameter Prefect validated without the registry: checked here
    started, t0 = time.time(), time.perf_counter()
    steps, error = Steps(), None
    try:
        fetched = steps.run("fetch", fetch_weights, spec, ctx)
        with target.heavy_slot(spec, ctx):  # the per-GPU global concurrency limit is taken where the GPU is
            target.build(steps, spec, fetched, ctx)
    except Exception as exc:
        error = one_line(exc)
        raise
    finally:
        manifest = build_manifest(spec, ctx, steps, steps["fetch"].detail if "fetch" in steps else {}, started,
                                  time.perf_counter() - t0, "failed" if error else "completed", error)
        manifest["kind"] = "heavy_steps"
        try:
            store_manifest(spec, manifest)
        finally:
            write_local(ctx, manifest)
    return manifest
