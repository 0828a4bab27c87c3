"""How a GPU rollout gets memory for its candidate while the live backend still serves, chosen at plan time.

A candidate engine needs GPU memory before the old one lets go of its own. Three ways, from the spec's GPUs and the
engine's size (the per-GPU estimate of stoker/gpu/rules.py, not a second one):

- surge: the spec lists spare device ids (at least one backend's worth beyond the first): the candidate starts on
  the set the live backend does not hold, the old set is freed after retire, and the next rollout goes back to it
  (blue/green across GPU sets). No KV cost, no gap; it costs the spare GPUs.
- shared: both backends fit on the same GPUs during the overlap: each is capped to half of what two engines leave
  (max_tokens_in_paged_kv_cache), so the KV cache it keeps all the time is smaller than one backend alone would get.
- reload: neither fits: the old backend drains, stops, the candidate starts; clients see a gap (estimated here).

Pure: numbers in, a Rollout or a PlanRefused (one line naming the fix) out. No I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from .. import target_traits
from ..errors import PlanRefused
from . import matrix, rules

Choice = Literal["surge", "shared", "reload"]
GIB = rules.GIB

# The reload gap: estimates, not measurements (no TensorRT-LLM runs on stoker's machines; see docs/targets.md).
# Why each number: a TRT-LLM Triton server exits after its MPI ranks tear down NCCL and free their CUDA contexts,
# a few seconds; a new one spends ~30 s before reading the engine (tritonserver, the tensorrtllm backend, MPI
# ranks, CUDA context per GPU), then each rank reads its own engine file from local disk into GPU memory in
# parallel, at ~2 GB/s for a local NVMe (the conservative end), then allocates the KV cache (fast).
STOP_S = 10.0
START_S = 30.0
LOAD_BYTES_PER_S = 2e9
# TensorRT-LLM's PyTorch backend (the LLM API) loads a HF checkpoint and warms up (autotuning, CUDA graphs) before
# it is ready.
PYTORCH_EXTRA_S = 30.0


@dataclass(frozen=True)
class Backend:
    """One backend's footprint on each of its GPUs: what it holds whatever its KV cache (engine weights,
    activations, runtime reserve) and what one token of KV costs there."""

    fixed_bytes: int
    engine_bytes: int  # the weights alone: what a reload reads from disk
    kv_bytes_per_token: int
    seq_len: int  # a backend that cannot hold one full sequence of KV does not fit (rules.py's minimum)

    @property
    def min_bytes(self) -> int:
        return self.fixed_bytes + self.kv_bytes_per_token * self.seq_len


@dataclass(frozen=True)
class Rollout:
    choice: Choice
    requested: str  # the spec's gpus.rollout: auto | surge | shared | reload
    gpu: str  # the GPU's name
    world: int  # GPUs one backend uses (tensor × pipeline)
    blue: tuple[int, ...]  # device ids of the first backend
    green: tuple[int, ...]  # surge: device ids of the other one; else the same as blue (shared) or () (reload)
    unused: tuple[int, ...]  # listed device ids no backend uses
    fraction: float  # the spec's kv_cache_free_gpu_mem_fraction
    kv_tokens_alone: int  # one backend alone on its GPUs, at the spec's fraction
    kv_tokens: int  # each backend under this rollout
    max_tokens_in_paged_kv_cache: int | None  # shared: the cap each backend gets
    first_fraction: float | None  # shared: the cap as a fraction of what the first backend finds free
    gap_s: float | None  # reload: expected seconds with no backend serving
    two_backends_bytes: int  # per GPU, two backends each with one full sequence of KV: what shared needs
    gpu_bytes: int

    @property
    def kv_cost_pct(self) -> float:
        """KV capacity lost against one backend alone, in percent."""
        return round(100 * (1 - self.kv_tokens / self.kv_tokens_alone), 1) if self.kv_tokens_alone else 0.0

    def note(self) -> str:
        """The plan row's text: what happens to the GPUs, and what it costs."""
        if self.choice == "surge":
            extra = f"; GPUs {list(self.unused)} stay unused" if self.unused else ""
            return (f"surge: the candidate starts on GPUs {list(self.green)} while {list(self.blue)} serve (or the "
                    f"other way round), the old set is freed after retire and the next rollout goes back to it; "
                    f"KV ~{self.kv_tokens} tokens per backend, no gap{extra}")
        if self.choice == "shared":
            return (f"shared: both backends on GPUs {list(self.blue)} during the overlap: max_tokens_in_paged_kv_cache"
                    f" {self.max_tokens_in_paged_kv_cache} each (the first starts at {self.first_fraction} of its "
                    f"free memory, the second at the spec's {self.fraction}); KV ~{self.kv_tokens} tokens vs "
                    f"~{self.kv_tokens_alone} alone (-{self.kv_cost_pct}%)")
        return (f"reload: two backends need ~{_gib(self.two_backends_bytes)} per GPU, the {self.gpu} has "
                f"{_gib(self.gpu_bytes)}: the old backend drains (up to "
                f"deploy.drain_timeout_s), stops, the candidate starts: expected gap ~{self.gap_s:.0f} s; "
                f"KV ~{self.kv_tokens} tokens")

    def to_dict(self) -> dict:
        return asdict(self) | {"kv_cost_pct": self.kv_cost_pct}


def kv_tokens(free_bytes: int, fraction: float, kv_bytes_per_token: int, cap: int | None = None) -> int:
    """TensorRT-LLM's KV cache size: `fraction` of the memory free when it allocates, at most `cap` tokens."""
    tokens = int(max(0, free_bytes) * fraction) // kv_bytes_per_token
    return min(tokens, cap) if cap is not None else tokens


def shared_kv_bytes(gpu_bytes: int, fixed_bytes: int, fraction: float) -> int:
    """KV bytes each of two backends on one GPU can keep, the same for both whichever starts first.

    The second backend allocates `fraction` of what is free after both engines and the first one's KV cache:
    K = fraction × (M − 2F − K), so K = fraction × (M − 2F) / (1 + fraction). The first one, alone on the GPU
    when it starts, would take far more at the same fraction: it is capped at K (max_tokens_in_paged_kv_cache).
    The pair then leaves the same share of memory untouched as one backend does at that fraction."""
    return max(0, int(fraction * (gpu_bytes - 2 * fixed_bytes) / (1 + fraction)))


def shared_need_bytes(backend: Backend, fraction: float) -> int:
    """GPU memory two backends need to share it, each with one full sequence of KV: shared_kv_bytes solved for M."""
    return 2 * backend.fixed_bytes + int(-(-backend.kv_bytes_per_token * backend.seq_len * (1 + fraction) // fraction))


def reload_gap_s(engine_bytes: int, settle_s: float, pytorch_backend: bool = False) -> float:
    """Seconds with no backend serving: stop, start, engine read (ranks in parallel), the PyTorch backend's warm-up,
    the candidate's settle."""
    gap = STOP_S + START_S + engine_bytes / LOAD_BYTES_PER_S + settle_s
    return round(gap + (PYTORCH_EXTRA_S if pytorch_backend else 0.0), 1)


def choose(requested: str, gpu: matrix.GpuInfo, device_ids: list[int], world: int, backend: Backend,
           fraction: float, max_tokens: int | None = None, settle_s: float = 3.0,
           pytorch_backend: bool = False, replicas: int = 1) -> Rollout:
    """The rollout for `requested` (auto: surge, else shared, else reload: the first without a gap, then the one
    without a KV cost); PlanRefused when the spec's own choice, or any, cannot work.

    ``replicas`` (deploy.replicas): a generation is that many backends of ``world`` GPUs each, on GPUs of their own;
    the sets below are then a generation's GPUs (replica r takes the r-th ``world`` of them)."""
    memory = gpu.memory_mib << 20
    gib = _gib
    if replicas > 1 and len(device_ids) < world * replicas:
        raise PlanRefused(f"deploy.replicas: {replicas} replicas of {world} GPU(s) each (tensor x pipeline) need "
                          f"{world * replicas} GPUs but gpus lists {len(device_ids)} ({list(device_ids)}): list more "
                          "device ids or lower deploy.replicas")
    world = world * replicas
    if backend.min_bytes > memory:
        raise PlanRefused(f"gpus.type: one backend needs ~{gib(backend.min_bytes)} per GPU (engine "
                          f"{gib(backend.engine_bytes)} + activations + one {backend.seq_len}-token sequence of KV) but "
                          f"the {gpu.name} has {gib(memory)}: quantize, raise parallel.tensor or lower build.max_seq_len")
    if len(device_ids) < world:
        raise PlanRefused(f"gpus.count: one backend needs {world} GPUs (tensor x pipeline) but the spec lists "
                          f"{len(device_ids)}")
    blue, rest = tuple(device_ids[:world]), tuple(device_ids[world:])
    alone = kv_tokens(memory - backend.fixed_bytes, fraction, backend.kv_bytes_per_token, max_tokens)
    common = dict(requested=requested, gpu=gpu.name, world=world, blue=blue, fraction=fraction,
                  kv_tokens_alone=alone, two_backends_bytes=shared_need_bytes(backend, fraction), gpu_bytes=memory)

    surge_ok = len(rest) >= world
    if requested == "surge" and not surge_ok:
        raise PlanRefused(f"gpus.rollout: surge needs {world} spare GPU(s) beyond the {world} one backend uses, but "
                          f"gpus lists {len(device_ids)} ({list(device_ids)}): add device ids (count "
                          f"{2 * world}) or use rollout shared, reload or auto")
    if surge_ok and requested in ("auto", "surge"):
        return Rollout("surge", green=rest[:world], unused=rest[world:], kv_tokens=alone,
                       max_tokens_in_paged_kv_cache=None, first_fraction=None, gap_s=None, **common)

    each = shared_kv_bytes(memory, backend.fixed_bytes, fraction)
    cap = each // backend.kv_bytes_per_token
    if max_tokens is not None:
        cap = min(cap, max_tokens)  # the spec's own cap is smaller still: both fit anyway
    shared_ok = cap >= backend.seq_len
    if requested == "shared" and not shared_ok:
        need = shared_need_bytes(backend, fraction)
        raise PlanRefused(f"gpus.rollout: shared needs ~{gib(need)} per GPU for two backends (each: engine "
                          f"{gib(backend.engine_bytes)} + activations + one {backend.seq_len}-token sequence of KV) but "
                          f"the {gpu.name} has {gib(memory)}: use rollout reload or auto, or list spare device ids "
                          "for surge")
    if shared_ok and requested in ("auto", "shared"):
        first = round(cap * backend.kv_bytes_per_token / (memory - backend.fixed_bytes), 3)
        return Rollout("shared", green=blue, unused=rest, kv_tokens=cap, max_tokens_in_paged_kv_cache=cap,
                       first_fraction=first, gap_s=None, **common)

    return Rollout("reload", green=(), unused=rest, kv_tokens=alone, max_tokens_in_paged_kv_cache=None,
                   first_fraction=None, gap_s=reload_gap_s(backend.engine_bytes, settle_s, pytorch_backend), **common)


def backend_of(spec, facts) -> Backend:
    """One backend's per-GPU footprint, from the memory estimate `stoker plan` already makes (rules.py)."""
    gpu = matrix.gpu_info(spec.gpus.type)
    est = rules.estimate_memory(spec, facts, gpu)
    seq = rules.max_seq_len(spec, facts) or facts.context
    return Backend(fixed_bytes=est.weights_per_gpu + est.activations_per_gpu + rules.RUNTIME_RESERVE_BYTES,
                   engine_bytes=est.weights_per_gpu, kv_bytes_per_token=est.kv_bytes_per_token_per_gpu, seq_len=seq)


def plan_rollout(spec, facts) -> Rollout | None:
    """The spec's rollout; None where the engine's size is not estimated: model facts unknown, a prebuilt
    build.engine_dir (rules.py does not estimate its memory either), or an unknown GPU (rules.py refuses that)."""
    gpu = matrix.gpu_info(spec.gpus.type)
    if facts is None or gpu is None or spec.build.engine_dir is not None:
        return None
    return choose(spec.gpus.rollout, gpu, spec.gpus.ids, spec.parallel.world_size, backend_of(spec, facts),
                  spec.runtime.kv_cache_free_gpu_mem_fraction, spec.runtime.max_tokens_in_paged_kv_cache,
                  spec.deploy.settle_s, target_traits.of(spec.target).pytorch_backend, spec.deploy.replicas)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
