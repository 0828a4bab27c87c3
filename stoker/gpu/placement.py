"""Where a run's GPU build goes, and whether it fits there beside what serves. Pure: numbers in, a dict or a
PlanRefused (one line with the GiB it needs and has) out.

A GPU host serves while stoker rebuilds, so the build's containers (the quantize worker, trtllm-build) meet the live
backend's memory unless they run elsewhere. Per GPU, what each holds (estimates from upstream's mechanisms; no
TensorRT-LLM runs on stoker's machines):

- the quantize worker: stoker/gpu/memory.py (16-bit weights spread over the build's GPUs, quantizer state,
  calibration's and export's working sets, the CUDA context), compared with nvidia-smi on 2x H200 in
  benchmarks/results/gpu_quantize.json;
- trtllm-build: the rank's engine weights, the activations TensorRT profiles tactics with and the runtime reserve
  (rules.estimate_memory's fixed part; TensorRT-LLM's docs on memory usage name these for the engine);
- a live backend: that fixed part plus its KV cache, which TensorRT-LLM sizes at start to
  kv_cache_free_gpu_mem_fraction of the memory then free (KvCacheConfig), capped by max_tokens_in_paged_kv_cache
  (a shared rollout's cap): what is left beside it is all another container on that GPU can have.

The build goes, in order: to listed GPUs no backend holds (surge's other set, ids beyond the generations), else
beside the live backend when it fits there, else the plan refuses naming what would make it fit.
"""

from __future__ import annotations

from . import matrix, memory, rules, trtllm
from .facts import ModelFacts
from .rollout import GIB, Rollout, backend_of, kv_tokens
from ..errors import PlanRefused


def quantize_need_bytes(spec, facts: ModelFacts) -> int:
    """The quantize worker's peak on its busiest GPU: it spans the build's GPUs (tensor × pipeline)."""
    cal = spec.quantization.calibration
    return memory.quantize_peak_bytes(facts, spec.quantization.format, spec.parallel.world_size, cal.batch_size,
                                      cal.seq_len)


def build_need_bytes(spec, facts: ModelFacts) -> dict[str, int]:
    """Per-GPU peak of each container step the build runs (stoker.gpu.trtllm's names)."""
    steps = trtllm.step_names(spec)
    need: dict[str, int] = {}
    if "quantize" in steps or "checkpoint" in steps:
        need["quantize"] = quantize_need_bytes(spec, facts)
    if "build" in steps:
        est = rules.estimate_memory(spec, facts, matrix.gpu_info(spec.gpus.type))
        need["build"] = est.weights_per_gpu + est.activations_per_gpu + rules.RUNTIME_RESERVE_BYTES
    return need


def live_bytes(spec, facts: ModelFacts, planned: Rollout) -> int:
    """What one live backend holds on each of its GPUs under ``planned``: engine, activations, reserve, KV cache."""
    backend = backend_of(spec, facts)
    cap = planned.max_tokens_in_paged_kv_cache if planned.choice == "shared" else spec.runtime.max_tokens_in_paged_kv_cache
    tokens = kv_tokens(planned.gpu_bytes - backend.fixed_bytes, planned.fraction, backend.kv_bytes_per_token, cap)
    return backend.fixed_bytes + tokens * backend.kv_bytes_per_token


def place_build(spec, facts: ModelFacts, planned: Rollout, held: tuple[int, ...],
                serving: str = "the live backend") -> dict:
    """The build's GPUs given the device ids ``held`` by what serves (() when nothing does): a dict for the run's
    decision and manifest (gpus, where, need/free bytes per GPU), or PlanRefused when it fits nowhere."""
    world = spec.parallel.world_size
    need = build_need_bytes(spec, facts)
    if not need:
        return {"gpus": [], "where": "no GPU step", "need_bytes": {}}
    peak, step = max((v, k) for k, v in need.items())
    memory_bytes = planned.gpu_bytes
    what = f"the build's {step} step needs ~{_gib(peak)} per GPU on {world} GPU(s)"
    if peak > memory_bytes:
        raise PlanRefused(f"gpus.type: {what} but the {planned.gpu} has {_gib(memory_bytes)}: raise parallel.tensor "
                          "(quantization then spans more GPUs) or use a GPU with more memory")
    free = [i for i in spec.gpus.ids if i not in held]
    record = {"need_bytes": need, "gpu_bytes": memory_bytes}
    if len(free) >= world:
        return record | {"gpus": free[:world], "where": "GPUs no backend holds" if held else "nothing serves yet"}
    beside = memory_bytes - live_bytes(spec, facts, planned)
    if peak <= beside:
        return record | {"gpus": list(held[:world]), "where": f"beside {serving}", "free_bytes": beside}
    more = world - len(free)
    raise PlanRefused(f"gpus: a rebuild while {serving} serves on GPUs {list(held)}: {what}, but beside it each has "
                      f"~{_gib(max(0, beside))} of {_gib(memory_bytes)} ({planned.choice} rollout): list {more} more "
                      f"device id(s) (gpus.count {len(spec.gpus.ids) + more}) so builds run on a GPU nothing serves "
                      "from, or use a GPU with more memory")


def plan_rebuild(spec, facts: ModelFacts, planned: Rollout) -> dict:
    """`stoker plan`'s check: the build of a rebuild while the first generation serves (its GPUs: planned.blue)
    must fit somewhere; PlanRefused otherwise. A first deploy fits wherever a rebuild does."""
    return place_build(spec, facts, planned, planned.blue, "the first backend")


def place_baseline(spec, facts: ModelFacts, planned: Rollout, held: tuple[int, ...]) -> dict:
    """Where the automatic bf16 baseline (a `none` build of the same weights, staged to be scored, then removed)
    would stand: on GPUs nothing serves from, alone, never beside the live backend (it would take memory the live
    backend's KV cache may grow into) and never instead of it. ``{"gpus": [...]}`` or ``{"gpus": None, "why": …}``."""
    world = spec.parallel.world_size * spec.deploy.replicas
    bf16 = spec.model_copy(update={"quantization": spec.quantization.model_copy(update={"format": "none",
                                                                                       "kv_cache_dtype": "none"})})
    need = backend_of(bf16, facts).min_bytes
    if need > planned.gpu_bytes:
        # ``fits: False``: no choice of GPUs changes this; decision.settle keeps the refusal as it is.
        return {"gpus": None, "fits": False, "why": f"a bf16 backend needs ~{_gib(need)} per GPU on {world} GPU(s), "
                                                    f"the {planned.gpu} has {_gib(planned.gpu_bytes)}"}
    return baseline_gpus(spec, held, need)


def baseline_gpus(spec, held: tuple[int, ...], need: int | None) -> dict:
    """The baseline's GPUs among those nothing serves from (``held`` serve), once it is known to fit one GPU."""
    world = spec.parallel.world_size * spec.deploy.replicas
    free = [i for i in spec.gpus.ids if i not in held]
    if len(free) < world:
        return {"gpus": None, "fits": True, "why": f"it needs {world} free GPUs nothing serves from and the spec "
                                                   f"lists {list(spec.gpus.ids)}, {list(held)} serving"}
    return {"gpus": free[:world], "fits": True, "need_bytes": need}


def note(placed: dict) -> str:
    """The plan's line for a placement."""
    steps = ", ".join(f"{k} ~{_gib(v)}" for k, v in placed["need_bytes"].items())
    return (f"a rebuild while serving runs on GPUs {placed['gpus']} ({placed['where']}): per GPU {steps} of "
            f"{_gib(placed['gpu_bytes'])}" + (f", ~{_gib(placed['free_bytes'])} free there" if "free_bytes" in placed
                                              else ""))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
