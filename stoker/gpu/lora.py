"""LoRA adapters on the engine target (TensorRT-LLM 1.2's LoRA plugin), by contract: no GPU here.

- The engine is built for adapters, never from them: `--lora_plugin float16 --max_lora_rank <lora.max_rank>
  --lora_target_modules <every decoder linear of the architecture>`, no `--lora_dir`. So any adapter within the
  rank limit fits the engine, and a new adapter revision reuses it (the build key takes only whether the spec has
  adapters and the rank limit).
- The package converts each adapter to TensorRT-LLM's format (stoker/runtime/lora_trtllm.py) in float16, the
  plugin's type: weights of another type are ignored without an error (tensorrtllm_backend #791). They go to
  tensorrt_llm/1/lora/<task id>/, the backend's lora_prefetch_dir, so every adapter is in its cache before the
  first request ("LoRA task N not found in cache", TensorRT-LLM #1552, is the cost of sending weights only with a
  task's first request), and the cache is sized to hold all of them (cache_parameters).
- The stand-in serves that repository with stoker's reference runtime, which reads the converted files back: its
  float32 build gets float32 files, so the conversion is exercised exactly (runtime/lora.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..runtime.lora_config import LINEAR_MODULES, WEIGHTS_FILE, read_config
from ..runtime.lora_trtllm import CONFIG_NPY, HF_TO_TRTLLM, WEIGHTS_NPY, to_trtllm

PLUGIN_DTYPE = "float16"
FOLDER = "lora"  # in tensorrt_llm/1/: the lora_prefetch_dir
HOST_CACHE_MIN = 1 << 30  # the backend's own default host cache (1 GiB)
GPU_FRACTION_DEFAULT = 0.05  # the backend's default lora_cache_gpu_memory_fraction


def engine_modules(model_type: str) -> list[str]:
    """TensorRT-LLM's names for every decoder linear layer an adapter of this architecture may target."""
    out: list[str] = []
    for name in LINEAR_MODULES.get(model_type, ()):
        if HF_TO_TRTLLM[name] not in out:
            out.append(HF_TO_TRTLLM[name])
    return out


def build_flags(spec, model_type: str) -> list[str]:
    """trtllm-build's LoRA switches for a spec with adapters ([] without)."""
    if not spec.adapters:
        return []
    return ["--lora_plugin", PLUGIN_DTYPE, "--max_lora_rank", str(spec.lora.max_rank),
            "--lora_target_modules", *engine_modules(model_type)]


def convert_all(folder: Path, described: dict, out: Path, dtype: str = PLUGIN_DTYPE) -> dict[str, dict]:
    """Each fetched adapter (folder/NAME, PEFT's files) into out/<task id>/ in TensorRT-LLM's format; returns
    name → {task_id, rank, rows, bytes}."""
    from safetensors.numpy import load_file

    converted = {}
    for name, d in sorted(described.items()):
        cfg = read_config(folder / name, f"adapter {name}")
        weights, config = to_trtllm(load_file(str(folder / name / WEIGHTS_FILE)), cfg, dtype)
        dest = out / str(d["task_id"])
        dest.mkdir(parents=True, exist_ok=True)
        for file, array in ((WEIGHTS_NPY, weights), (CONFIG_NPY, config)):
            tmp = dest / f".{file}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                np.save(fh, array)
            os.replace(tmp, dest / file)
        converted[name] = {"task_id": d["task_id"], "rank": cfg.r, "rows": int(config.shape[1]),
                           "bytes": int(weights.nbytes)}
    return converted


def cache_parameters(converted: dict[str, dict], max_rank: int, gpu_memory_mib: int | None,
                     prefetch_dir: str) -> dict[str, str]:
    """The tensorrt_llm model's LoRA parameters: preload every adapter, and a cache that holds all of them.

    Host: twice what the adapters take, at least the backend's 1 GiB default. GPU: the backend's 5 % of the memory
    left after the engine and the KV cache, unless twice the adapters need more of the tenth of the GPU assumed left
    (capped at half of it). Pages fit the largest adapter's rank (max_adapter_size = the engine's max_lora_rank)."""
    total = sum(c["bytes"] for c in converted.values())
    ranks = [c["rank"] for c in converted.values()] or [max_rank]
    fraction = GPU_FRACTION_DEFAULT
    if gpu_memory_mib:
        left = gpu_memory_mib * (1 << 20) * 0.1
        fraction = min(0.5, max(GPU_FRACTION_DEFAULT, round(2 * total / left, 3)))
    return {"lora_prefetch_dir": prefetch_dir, "lora_cache_optimal_adapter_size": str(max(ranks)),
            "lora_cache_max_adapter_size": str(max_rank),
            "lora_cache_host_memory_bytes": str(max(HOST_CACHE_MIN, 2 * total)),
            "lora_cache_gpu_memory_fraction": str(fraction)}

