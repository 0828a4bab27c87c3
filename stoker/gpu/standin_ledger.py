"""STAND-IN: the GPU host's memory, as a ledger, so that what would run out of memory on a GPU fails here too.

No GPU exists on stoker's machines; under the stand-in (stoker/gpu/standin.py) every container stoker would start
with GPUs (a backend) and every build it would run on them carries its per-GPU footprint in a label
(LABEL_BYTES), and a new one is admitted only where the memory of its GPUs, less what running containers hold
there, has room — refused otherwise, as CUDA refuses an allocation ("CUDA out of memory"), with the numbers.

What each holds follows upstream, not stoker's own choices:
- a TensorRT-LLM backend: its engine's weights, activations and runtime reserve (stoker/gpu/rules.py's estimate),
  then a KV cache of kv_cache_free_gpu_mem_fraction of the memory free when it starts, at most
  max_tokens_in_paged_kv_cache tokens (TensorRT-LLM's KvCacheConfig: free_gpu_memory_fraction, max_tokens), read
  from the repository it serves (config.pbtxt parameters, or model.yaml's kv_cache_config for the LLM API); a cache
  that cannot hold one max_seq_len sequence fails the start;
- a build: the quantize worker's and trtllm-build's peaks (stoker/gpu/placement.py), for the time it runs.
The GPU's size is the spec's gpus.type (stoker/gpu/matrix.json). Each deployment is its own GPU host here: the
ledger counts the deployment's own containers, so that deployments (and tests) sharing this machine's Docker do not
take each other's simulated GPUs; deployments that share a real GPU host are not modelled.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from ..errors import StokerError
from . import matrix

LABEL_BYTES = "ai.stoker.gpu.bytes"  # per GPU, what the container holds as the ledger admitted it
LABEL_GPUS = "ai.stoker.gpus"
GIB = 1 << 30


class OutOfMemory(StokerError):
    """What CUDA would raise: the container's GPUs lack the room beside what already holds them."""


def held_bytes(containers, gpus: tuple[int, ...]) -> dict[int, int]:
    """Per device id in ``gpus``: the bytes running containers hold there (their LABEL_BYTES)."""
    held = {g: 0 for g in gpus}
    for c in containers:
        if c.status not in ("running", "created", "restarting"):
            continue  # a stopped backend's memory is free again (its process exited)
        on = {int(i) for i in (c.labels.get(LABEL_GPUS) or "").split(",") if i.strip().isdigit()}
        for g in on & set(gpus):
            held[g] += int(c.labels.get(LABEL_BYTES) or 0)
    return held


def admit(what: str, gpus: tuple[int, ...], gpu_bytes: int, held: dict[int, int], minimum: int,
          take=None) -> int:
    """Bytes ``what`` takes on each of ``gpus``: ``take(free)`` (default ``minimum``) of the least free GPU, once
    ``minimum`` fits there; OutOfMemory (one line) otherwise. Pure."""
    if not gpus:
        return 0
    tightest = max(gpus, key=lambda g: held.get(g, 0))
    free = gpu_bytes - held.get(tightest, 0)
    if minimum > free:
        raise OutOfMemory(f"CUDA out of memory (STAND-IN ledger): {what} needs ~{minimum / GIB:.1f} GiB on GPU "
                          f"{tightest}, which has ~{max(0, free) / GIB:.1f} GiB free of {gpu_bytes / GIB:.1f} GiB "
                          f"(~{held.get(tightest, 0) / GIB:.1f} GiB held by running containers)")
    return take(free) if take else minimum


def kv_settings(repository: Path) -> tuple[float | None, int | None]:
    """(free_gpu_memory_fraction, max_tokens) as the served repository gives them to TensorRT-LLM."""
    yml = repository / "tensorrt_llm" / "1" / "model.yaml"
    if yml.is_file():  # the LLM API: LLM(kv_cache_config=...)
        kv = (yaml.safe_load(yml.read_text()) or {}).get("kv_cache_config") or {}
        return kv.get("free_gpu_memory_fraction"), kv.get("max_tokens")
    pbtxt = repository / "tensorrt_llm" / "config.pbtxt"
    text = pbtxt.read_text() if pbtxt.is_file() else ""

    def param(name: str) -> str | None:
        m = re.search(r'key:\s*"%s"\s*value\s*:?\s*\{\s*string_value:\s*"([^"]*)"' % name, text)
        return m.group(1) if m and m.group(1) and not m.group(1).startswith("${") else None

    fraction, cap = param("kv_cache_free_gpu_mem_fraction"), param("max_tokens_in_paged_kv_cache")
    return (float(fraction) if fraction else None), (int(cap) if cap else None)


def backend_take(spec, facts, repository: Path):
    """(minimum bytes, take(free) -> bytes) of a backend serving ``repository`` for ``spec`` on one of its GPUs."""
    fraction, cap = kv_settings(repository)
    return backend_sizing(spec, facts, fraction, cap)


def backend_sizing(spec, facts, fraction: float | None, cap: int | None):
    """(minimum bytes, take(free) -> bytes) of a backend for ``spec`` whose KV cache is sized with ``fraction``
    (None: the spec's runtime.kv_cache_free_gpu_mem_fraction) of what is free, at most ``cap`` tokens."""
    from .rollout import backend_of, kv_tokens

    backend = backend_of(spec, facts)
    fraction = spec.runtime.kv_cache_free_gpu_mem_fraction if fraction is None else fraction

    def take(free: int) -> int:
        return backend.fixed_bytes + kv_tokens(free - backend.fixed_bytes, fraction, backend.kv_bytes_per_token,
                                               cap) * backend.kv_bytes_per_token

    return backend.min_bytes, take


def gpu_bytes(spec) -> int:
    return matrix.gpu_info(spec.gpus.type).memory_mib << 20
