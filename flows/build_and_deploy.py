"""build_and_deploy: (preflight) fetch → quantize → build → package → upload → deploy → benchmark → gate → switch.

"deploy" stages a candidate behind the deployment's stable endpoint; the benchmark and its gate run on
the candidate's own ports; only a candidate that passed them gets traffic ("switch").
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from stoker.gpu_slot import gpu_slot
from stoker.manifest import build_manifest, write_atomic, write_local
from stoker.report import benchmark_rows, markdown
from stoker.run import RunContext, StepResult
from stoker.spec import Spec
from tasks.hub import fetch_weights
from tasks.modelopt import quantize_weights
from tasks.preflight import preflight_checks
from tasks.reference import build_reference
from tasks.rollout import (abandon_candidate, emit_failure, read_rollback, scrape_metrics, stage_candidate,
                           switch_traffic)
from tasks.s3 import store_manifest, upload_repository
from tasks.gate import gate_benchmark, promote_run
from tasks.triton_client import benchmark_endpoint
from tasks.triton_repo import package_repository
from tasks.trtllm import build_gpu, deploy_gpu, package_gpu


class Steps(dict[str, StepResult]):
    """Runs each step, keeping a failed step's duration and one-line cause for the manifest."""

    def run(self, name: str, task: Callable[..., StepResult], *args) -> StepResult:
        t0 = time.perf_counter()
        try:
            result = task(*args)
        except Exception as exc:
            self[name] = StepResult(name=name, status="failed", duration_s=time.perf_counter() - t0,
                                    error=one_line(exc))
            raise
        self[name] = result
        return result


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


@flow(name="build_and_deploy", log_prints=True)
def build_and_deploy(spec: Spec, home: str | None = None) -> dict:
    """Turn the spec's model revision into a benchmarked Triton endpoint; returns the run manifest."""
    ctx = RunContext.new(Path(home) if home else None)
    started, t0 = time.time(), time.perf_counter()
    steps, error, metrics = Steps(), None, []
    try:
        preflight_checks(spec)
        fetched = steps.run("fetch", fetch_weights, spec, ctx)
        with gpu_slot(spec.target):  # a global concurrency limit per GPU (stoker/gpu_slot.py); CPU: no slot
            if spec.target == "reference":
                quantized = steps.run("quantize", quantize_weights, spec, fetched, ctx)
                built = steps.run("build", build_reference, spec, quantized, ctx)
            else:  # GPU targets: quantize + checkpoint + engine in the pinned serving image, one cache key
                built = steps.run("build", build_gpu, spec, fetched, ctx)
        if spec.target == "reference":
            packaged = steps.run("package", package_repository, spec, built, ctx)
        else:
            packaged = steps.run("package", package_gpu, spec, fetched, built, ctx)
        uploaded = steps.run("upload", upload_repository, spec, packaged, ctx)
        if spec.target == "reference":
            staged = steps.run("deploy", stage_candidate, spec, uploaded, ctx)  # proven, no traffic yet
            try:
                benchmarked = steps.run("benchmark", benchmark_endpoint, spec, staged, built, ctx)
                metrics = scrape_metrics(staged)  # before the gate: a failed run's report shows them too
                # A failed gate fails the run with a table of what regressed; the candidate never serves.
                steps.run("gate", gate_benchmark, spec, benchmarked, ctx)
            except Exception as exc:
                abandon_candidate(spec, staged, ctx, one_line(exc))
                raise
            steps.run("switch", switch_traffic, spec, staged, ctx)  # switch, watch, retire (or switch back)
        else:  # GPUs: device requests, shm, ulimits, MPI launch for TP×PP > 1 (tasks/trtllm.py); one container
            deployed = steps.run("deploy", deploy_gpu, spec, packaged, ctx)
            benchmarked = steps.run("benchmark", benchmark_endpoint, spec, deployed, built, ctx)
            metrics = scrape_metrics(deployed)
            steps.run("gate", gate_benchmark, spec, benchmarked, ctx)
        steps.run("promote", promote_run, spec, benchmarked, ctx)  # its summary becomes the baseline
    except Exception as exc:
        error = one_line(exc)
        raise
    finally:
        source = steps["fetch"].detail if "fetch" in steps else {}
        rollback = read_rollback(ctx)
        manifest = build_manifest(spec, ctx, steps, source, started, time.perf_counter() - t0,
                                  "failed" if error else "completed", error, rollback=rollback, metrics=metrics)
        if error:
            emit_failure(spec, ctx, error, rollback)
        publish_run(spec, ctx, manifest, s3_ok="upload" in steps and steps["upload"].status == "completed")
    return manifest


def publish_run(spec: Spec, ctx: RunContext, manifest: dict, s3_ok: bool) -> None:
    """Manifest to S3 and disk (last), report and artifacts to Prefect."""
    logger = get_run_logger()
    uris = []
    if s3_ok:
        try:
            uris.append(store_manifest(spec, manifest))
        except Exception as exc:  # the local manifest still records the run
            logger.warning(f"manifest not stored in S3: {one_line(exc)}")
    report = markdown(manifest, uris + [(ctx.run_dir / "manifest.json").as_uri()])
    write_atomic(ctx.run_dir / "report.md", report)
    key = f"stoker-{spec.deploy.name}"
    create_markdown_artifact(report, key=f"{key}-report", description="stoker run report")
    if manifest["benchmark"]["levels"]:
        create_table_artifact(benchmark_rows(manifest), key=f"{key}-benchmark", description="benchmark by level")
    if manifest["endpoint"]:
        create_link_artifact(manifest["endpoint"]["http"], link_text="stable HTTP endpoint", key=f"{key}-endpoint")
    for uri in uris:
        create_link_artifact(uri, link_text="run manifest (S3)", key=f"{key}-manifest")
    path = write_local(ctx, manifest)
    logger.info(f"manifest: {path}")
