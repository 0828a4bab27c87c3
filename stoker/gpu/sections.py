"""Spec sections of the GPU targets (`target: tensorrt | pytorch`); stoker.spec.schema composes them.

Defaults are TensorRT-LLM 1.2's own (trtllm-build and the tensorrt_llm Triton model),
so a spec only states what it changes. A `reference` spec may omit all of them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
# GPUs one deployment may name, and so the device ids it may use (0..63): a larger id is a typo, not a host.
MAX_GPUS = 64


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Gpus(_Section):
    """The GPUs one deployment gets on its host."""

    type: str = Field(description="a key of stoker/gpu/matrix.json 'gpus', e.g. h100-80gb, a100-40gb, l4")
    count: int = Field(1, ge=1, le=MAX_GPUS)
    device_ids: list[int] | None = Field(None, description="default: 0..count-1")
    rollout: Literal["auto", "surge", "shared", "reload"] = Field(
        "auto", description="how a candidate gets GPU memory while the live backend serves (stoker/gpu/rollout.py): "
        "surge onto spare device ids, share the GPUs (KV cache split), or reload (a gap); auto: the first that fits")

    @model_validator(mode="after")
    def _ids(self) -> Gpus:
        ids = self.device_ids
        if ids is None:
            return self
        # Docker would only refuse these when the backend starts, after download and build: say it here.
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"device id {repeated[0]} is listed more than once in device_ids; list each GPU once")
        bad = [i for i in ids if not 0 <= i < MAX_GPUS]
        if bad:
            raise ValueError(f"device id {bad[0]} is out of range 0..{MAX_GPUS - 1}")
        if len(ids) != self.count:
            raise ValueError(f"device_ids must be {self.count} distinct non-negative ids (count)")
        return self

    @model_serializer(mode="wrap")
    def _omit_auto_rollout(self, handler):
        # Left at auto, rollout stays out of dumps: manifests and spec digests of earlier runs compare equal.
        out = handler(self)
        if isinstance(out, dict) and self.rollout == "auto":
            out.pop("rollout", None)
        return out

    @property
    def ids(self) -> list[int]:
        return list(self.device_ids) if self.device_ids is not None else list(range(self.count))


class Parallel(_Section):
    tensor: int = Field(1, ge=1, le=64)
    pipeline: int = Field(1, ge=1, le=64)

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline


class Build(_Section):
    """trtllm-build limits (engine target); the LLM-API target uses the same limits at load time."""

    dtype: Literal["auto", "float16", "bfloat16"] = Field("auto", description="auto: the model's torch_dtype")
    max_batch_size: int = Field(2048, ge=1, le=65536)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int | None = Field(None, ge=2, description="default: the model's context (max_position_embeddings)")
    max_num_tokens: int = Field(8192, ge=1)
    opt_num_tokens: int | None = Field(None, ge=1)
    max_beam_width: int = Field(1, ge=1, le=64)
    kv_cache_type: Literal["paged", "continuous", "disabled"] = "paged"
    tokens_per_block: int = Field(32, ge=1)
    gemm_plugin: Literal["auto", "disable", "float16", "bfloat16", "float32", "fp8", "nvfp4"] = "auto"
    gpt_attention_plugin: Literal["auto", "disable", "float16", "bfloat16", "float32"] = "auto"
    remove_input_padding: bool = True
    context_fmha: bool = True
    use_paged_context_fmha: bool = True
    use_fp8_context_fmha: bool = False
    multiple_profiles: bool = False
    gather_context_logits: bool = Field(False, description="let requests ask for context_logits "
                                        "(return_context_logits); costs engine memory")
    workers: int = Field(1, ge=1, le=64, description="parallel build workers (one per rank at most)")
    allow_long_context: bool = Field(False, description="opt in to max_seq_len beyond the model's context")
    image: str | None = Field(None, description="build in another image; refused unless its TRT-LLM matches")
    engine_dir: Path | None = Field(None, description="serve a prebuilt engine folder instead of building")

    @field_validator("tokens_per_block")
    @classmethod
    def _pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two")
        return v


class Runtime(_Section):
    """Serving options of the tensorrt_llm model (engine target) or LLM(...) (LLM-API target)."""

    kv_cache_free_gpu_mem_fraction: float = Field(0.9, gt=0, le=1)
    batch_scheduler_policy: Literal["guaranteed_no_evict", "max_utilization"] = "guaranteed_no_evict"
    enable_chunked_context: bool = False
    enable_kv_cache_reuse: bool = False
    exclude_input_in_output: bool = True
    decoupled: bool = Field(True, description="streaming needs a decoupled model")
    max_queue_delay_microseconds: int = Field(0, ge=0)
    max_queue_size: int = Field(0, ge=0)
    max_tokens_in_paged_kv_cache: int | None = Field(None, ge=1)
    max_attention_window_size: int | None = Field(None, ge=1)
    enable_context_fmha_fp32_acc: bool = False
    multi_block_mode: bool = True
    cuda_graph_mode: bool = False
    normalize_log_probs: bool = True
    cancellation_check_period_ms: int = Field(100, ge=1)
    stats_check_period_ms: int = Field(100, ge=1)


def check_image_digest(v: str | None) -> str | None:
    if v is not None and not _DIGEST.match(v):
        raise ValueError(f"{v!r} is not a digest like sha256:<64 hex>")
    return v
