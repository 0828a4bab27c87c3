"""GPU steps (TensorRT-LLM engine and LLM-API targets): build and package, container steps in the pinned serving
image. Their backends are deployed by stoker/serving like every target's (stoker/targets/gpu.py says what differs).

Not run on stoker's machines (no GPU, no TensorRT-LLM): these tasks are what a GPU host
runs; their commands and configs are contract-tested (tests/contract), and the container
executor they use is tested for real with the CPU image (tests/integration/test_container_exec.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prefect import get_run_logger

from stoker import adapters, targets
from stoker.containers.execute import choose_executor
from stoker.errors import StepError
from stoker.gpu import decision, facts as facts_mod, inflight, matrix, planning, repository, standin, trtllm
from stoker.gpu import lora as gpu_lora
from stoker.gpu.checkpoint_check import CheckpointError, check_unified_checkpoint
from stoker.cache.keys import calibration_file, gpu_build_key, gpu_package_key
from stoker.cache.remote import empty_dirs
from stoker.run import RunContext, StepResult, cached_step, stoker_home
from stoker.spec.schema import Spec

from . import step_task


def fetched_facts(fetched: StepResult):
    """The model's facts from the fetch step's files: what the run decides with, not a second Hub read."""
    return facts_mod.from_folder(fetched.path) if (Path(fetched.path) / "config.json").is_file() else None


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
    It runs on the GPUs the candidate gets (the run's decision, ctx.gpu), not on those the live backend holds.
    """
    logger = get_run_logger()
    facts = fetched_facts(fetched)
    gpus = list(decision.build_gpus(spec, ctx.gpu))
    q = spec.quantization
    target = targets.get(spec.target)

    def produce(out: Path) -> dict:
        ws = _workspace(spec, fetched, out)
        detail: dict = {"target": spec.target, "image": planning.image_summary(spec), "steps": []}
        for step in trtllm.gpu_steps(spec, facts, ws):
            step = replace(step, gpus=gpus) if step.gpus is not None else step
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

    return cached_step(ctx, "build", gpu_build_key(spec, fetched.digest, trtllm.step_argvs(spec)), produce, logger.info)


@step_task("package", retries=0)
def package_gpu(spec: Spec, fetched: StepResult, built: StepResult, ctx: RunContext,
                lora: StepResult | None = None) -> StepResult:
    """inflight_batcher_llm (engine) or llmapi (LLM-API) repository; the target puts its model files inside.

    Under a `shared` GPU rollout both backends hold the same GPUs during the overlap: the repository carries the
    run's decision's cap (max_tokens_in_paged_kv_cache), so the backend that starts alone leaves the candidate room.
    ``lora``: the fetched adapters, converted to TensorRT-LLM's format and preloaded (stoker/gpu/lora.py)."""
    logger = get_run_logger()
    facts = fetched_facts(fetched)
    spec = decision.with_cap(spec, ctx.gpu)

    def produce(out: Path) -> dict:
        slot = out / "tensorrt_llm" / "1"
        params, extra = None, {}
        if lora is not None:
            described = lora.detail["adapters"]
            # STAND-IN: the reference runtime's float32 build reads float32 files (exact); an engine, the plugin's.
            dtype = "float32" if standin.applies(spec, ctx.standin) else gpu_lora.PLUGIN_DTYPE
            converted = gpu_lora.convert_all(Path(lora.path), described, slot / gpu_lora.FOLDER, dtype)
            gpu = matrix.gpu_info(spec.gpus.type) if spec.gpus else None
            params = gpu_lora.cache_parameters(converted, spec.lora.max_rank, gpu.memory_mib if gpu else None,
                                               inflight.LORA_DIR)
            adapters.place_table(described, slot)
            logger.info(f"package: {len(converted)} adapter(s) in TensorRT-LLM's format ({dtype}), preloaded from "
                        f"{inflight.LORA_DIR}; host cache {params['lora_cache_host_memory_bytes']} B, GPU cache "
                        f"fraction {params['lora_cache_gpu_memory_fraction']}")
            extra = {"adapters": {n: d["task_id"] for n, d in described.items()}, "lora": converted}
        info = repository.write_repository(spec, facts, out, tokenizer_src=fetched.path, lora_parameters=params)
        targets.get(spec.target).fill_repository(slot, fetched, built, standin.applies(spec, ctx.standin))
        # Empty folders (the ensemble's `1/`, which Triton requires) are recorded for the upload: file records carry
        # none, so a repository read back from S3 (stoker rollback after a prune) would otherwise lack them.
        return info | extra | {"pending": [], "empty_dirs": empty_dirs(out)}

    key = gpu_package_key(spec, built.digest, lora.digest if lora is not None else None)
    return cached_step(ctx, "package", key, produce, logger.info)
