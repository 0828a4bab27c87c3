"""GPU steps (TensorRT-LLM engine and LLM-API targets): container steps in the pinned serving image.

Not run on stoker's machines (no GPU, no TensorRT-LLM): these tasks are what a GPU host
runs; their commands and configs are contract-tested (tests/contract), and the container
executor they use is tested for real with the CPU image (tests/integration/test_container_exec.py).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger

from stoker import targets
from stoker.container_exec import choose_executor
from stoker.errors import StepError
from stoker.gpu import planning, repository, trtllm
from stoker.gpu.checkpoint_check import CheckpointError, check_unified_checkpoint
from stoker.keys import calibration_file, gpu_build_key, gpu_package_key
from stoker.run import RunContext, StepResult, cached_step, stoker_home
from stoker.spec import Spec

from . import step_task


def _workspace(spec: Spec, fetched: StepResult, out: Path) -> trtllm.Workspace:
    return trtllm.Workspace(hf=fetched.path, calibration=calibration_file(spec), unified=out / "unified",
                            checkpoint=out / "trtllm_checkpoint", engine=out / "engine",
                            timing_cache=stoker_home() / "timing-cache", repository=out / "repository",
                            stoker_src=planning.stoker_src())


@step_task("build", retries=0)
def build_gpu(spec: Spec, fetched: StepResult, ctx: RunContext) -> StepResult:
    """Quantize/convert then trtllm-build (engine) or quantize only (LLM-API), in the serving image; the
    target (stoker/targets/) checks what its steps left.

    One cache entry, keyed by weights + quant + build config + image/TRT-LLM + GPU arch: a hit skips all GPU work.
    """
    logger = get_run_logger()
    facts = planning.model_facts(spec)
    q = spec.quantization
    target = targets.get(spec.target)

    def produce(out: Path) -> dict:
        ws = _workspace(spec, fetched, out)
        detail: dict = {"target": spec.target, "image": planning.image_summary(spec), "steps": []}
        for step in trtllm.gpu_steps(spec, facts, ws)[:-1]:  # the last one serves
            log_file = out / f"{step.name}.log"
            with open(log_file, "w") as fh:
                def log(line: str, fh=fh) -> None:
                    fh.write(line + "\n")
                    logger.info(line)

                res = choose_executor(step, planning.env_executor_mode()).run(step, log)
            detail["steps"].append({"name": step.name, "argv": step.argv, "duration_s": round(res.duration_s, 1),
                                    "log": log_file.name})
        try:
            detail.update(target.check_built(ws, spec))
            if (out / "unified").is_dir():
                detail["unified"] = check_unified_checkpoint(ws.unified, q.format, q.kv_cache_dtype)
        except CheckpointError as err:
            raise StepError(str(err)) from None
        return detail

    return cached_step(ctx, "build", gpu_build_key(spec, fetched.digest), produce, logger.info)


@step_task("package", retries=0)
def package_gpu(spec: Spec, fetched: StepResult, built: StepResult, ctx: RunContext) -> StepResult:
    """inflight_batcher_llm (engine) or llmapi (LLM-API) repository; the target puts its model files inside."""
    logger = get_run_logger()
    facts = planning.model_facts(spec)

    def produce(out: Path) -> dict:
        info = repository.write_repository(spec, facts, out, tokenizer_src=fetched.path)
        targets.get(spec.target).fill_repository(out / "tensorrt_llm" / "1", fetched, built)
        return info | {"pending": []}

    return cached_step(ctx, "package", gpu_package_key(spec, built.digest), produce, logger.info)


@step_task("deploy", retries=0)
def deploy_gpu(spec: Spec, packaged: StepResult, ctx: RunContext) -> StepResult:
    """Serve the repository on the spec's GPUs (device requests, shm, ulimits; MPI launch for TP×PP > 1)."""

    from stoker import docker_engine
    from stoker.gpu import openai_frontend
    from stoker.serving import probe

    logger = get_run_logger()
    t0 = time.perf_counter()
    ws = trtllm.Workspace(hf=Path("/"), calibration=Path("/"), unified=Path("/"), checkpoint=Path("/"),
                          engine=Path("/"), timing_cache=Path("/"), repository=packaged.path,
                          stoker_src=planning.stoker_src())
    serve = trtllm.gpu_steps(spec, planning.model_facts(spec), ws)[-1]
    client = docker_engine.connect(spec.deploy.docker_host)
    name = f"stoker-{spec.deploy.name}-gpu"
    for old in client.containers.list(all=True, filters={"name": name}):
        old.remove(force=True)
    from stoker.container_exec import DockerExecutor

    kwargs = DockerExecutor(client, labels={"ai.stoker.deployment": spec.deploy.name}).create_kwargs(serve, {})
    container = client.containers.run(**kwargs, name=name, ports=trtllm.serve_ports(spec))
    http = f"http://127.0.0.1:{spec.deploy.ports.http}"
    try:
        waited = probe.wait_ready(f"{http}/v2/health/ready", spec.deploy.ready_timeout_s)
        logger.info(f"deploy: {name} ready after {waited:.1f}s")
    except Exception:
        container.remove(force=True)
        raise
    endpoint = {"http": http, "grpc": f"127.0.0.1:{spec.deploy.ports.grpc}"}
    if openai_frontend.renders(spec):  # Triton's own OpenAI frontend serves on the metrics role's port
        endpoint["openai"] = f"http://127.0.0.1:{spec.deploy.ports.metrics}/v1"
    return StepResult(name="deploy", duration_s=time.perf_counter() - t0, key=packaged.digest[:24],
                      digest=packaged.digest, detail={"container": name, "http": http, "grpc": endpoint["grpc"],
                                                      "endpoint": endpoint, "image": trtllm.serving_image(spec)})
