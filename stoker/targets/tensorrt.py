"""`tensorrt`: a TensorRT-LLM engine served by Triton's tensorrtllm backend (`inflight_batcher_llm` layout).

Its build exports a TensorRT-LLM checkpoint and runs trtllm-build; the engine is the artifact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import target_traits
from ..gpu import matrix, standin
from ..gpu.checkpoint_check import CheckpointError, check_trtllm_checkpoint
from .gpu import GpuTarget


class TensorRT(GpuTarget):
    traits = target_traits.TENSORRT
    name, runs_on, layout = traits.name, traits.runs_on, traits.layout
    complete_configs = True  # the LLM API's model, by contrast, takes max_batch_size and decoupled from model.yaml

    serves_adapters = True  # engine LoRA (stoker/gpu/lora.py): built for the rank limit, adapters preloaded

    def adapters_refusal(self, spec, base_config: dict) -> str | None:
        from ..gpu.lora import PLUGIN_DTYPE

        dtype = spec.build.dtype if spec.build.dtype != "auto" else str(base_config.get("torch_dtype") or base_config.get("dtype")
                                                                     or "float16")
        dtype = dtype if dtype in ("float16", "bfloat16") else "float16"  # what trtllm.resolved_dtype builds
        if dtype != PLUGIN_DTYPE:
            return (f"target tensorrt with adapters needs a {PLUGIN_DTYPE} engine, and this one would be {dtype} "
                    f"(the model's dtype): stoker converts adapters to {PLUGIN_DTYPE}, and the LoRA plugin ignores "
                    f"weights of another type without an error (tensorrtllm_backend #791); set build.dtype: "
                    f"{PLUGIN_DTYPE}")
        return None

    def package(self, steps, spec, fetched, built, ctx):
        lora = steps["adapters"] if "adapters" in steps else None  # converted and preloaded (stoker/gpu/lora.py)
        return steps.run("package", steps.tasks.package_gpu, spec, fetched, built, ctx, lora)

    def scores_perplexity(self, spec) -> bool:
        # An engine returns context logits only when built with --gather_context_logits (engine memory:
        # max_num_tokens × vocab × 4 B); without them the evaluation measures greedy agreement only.
        return spec.build.gather_context_logits

    def check_built(self, ws, spec) -> dict:
        q = spec.quantization
        detail = {"checkpoint": check_trtllm_checkpoint(ws.checkpoint, q.format, q.kv_cache_dtype,
                                                        spec.parallel.world_size),
                  "engine": check_engine(ws.engine, spec)}
        shutil.rmtree(ws.checkpoint)  # the engine is the artifact; the unified checkpoint stays
        return detail

    def fill_repository(self, slot: Path, fetched, built, standin_ran: bool = False) -> None:
        if standin_ran:
            # STAND-IN builds (stoker/gpu/standin.py) are the reference artifact itself; it goes where the engine
            # goes, holding what an engine folder holds: trtllm-build writes config.json and rank<i>.engine, no
            # tokenizer (TensorRT-LLM docs, "trtllm-build"), so nothing downstream may find one there.
            shutil.copytree(built.path, slot / "engine", ignore=shutil.ignore_patterns(*standin.NOT_IN_AN_ENGINE))
            return
        shutil.copytree(built.path / "engine", slot / "engine")


def check_engine(engine: Path, spec) -> dict:
    """The engine's config.json says which TRT-LLM built it; it must be the serving image's."""
    try:
        config = json.loads((engine / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{engine}/config.json unreadable: {err}") from None
    want = matrix.image_info(spec.deploy.image).trtllm
    if str(config.get("version")) != want:
        raise CheckpointError(f"engine built by TRT-LLM {config.get('version')}, serving image has {want}")
    ranks = sorted(p.name for p in engine.glob("rank*.engine"))
    if len(ranks) != spec.parallel.world_size:
        raise CheckpointError(f"{engine}: {len(ranks)} rank engines, expected {spec.parallel.world_size}")
    return {"version": config.get("version"), "ranks": ranks, "build_config": config.get("build_config", {})}


TARGET = TensorRT()
