"""GPU memory the quantize worker (stoker/gpu/quantize_worker.py) needs: the peak on its busiest GPU.

Pure arithmetic on ModelFacts, no I/O. Each term is something the worker holds on a GPU, named with the upstream
code that makes it (ModelOpt 0.47, transformers 5.17, Accelerate 1.15); nothing is fitted to measurements. The one
constant that is not derived, the CUDA context, was measured on its own in an otherwise empty process.
benchmarks/results/gpu_quantize.json compares the estimates with nvidia-smi.

What the worker holds, in the order it runs:
1. load: the weights in 16 bits whatever the format (from_pretrained in --dtype); spanning GPUs, whole decoder
   layers per GPU as Accelerate's balanced map places them (`split`).
2. calibrate (mtq.quantize): the quantizers' state, which stays, and the forward pass's working set.
3. export (export_tensorrt_llm_checkpoint, the heavier of the two exports): the fused q|k|v copy of every layer, a
   copy of the embedding table and the scale tensors, held until the end; then one weight at a time quantized,
   packed and moved to the CPU.
Calibration and export do not overlap in time, but nothing calls torch.cuda.empty_cache between them: PyTorch's
caching allocator keeps calibration's freed blocks reserved, and the export's tensors, of other sizes, reuse them
only in part. So both working sets are counted (exact when nothing is reused; measured peaks sit within 2 % of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .facts import ModelFacts
from .rules import weight_bytes

MIB = 1 << 20
# The CUDA context, the kernels it loads (PyTorch's, ModelOpt's extensions) and whatever else the driver keeps outside
# PyTorch's allocator, per GPU the worker touches: nvidia-smi's memory.used minus torch.cuda.memory_reserved in an
# otherwise empty process that imported torch and ModelOpt, loaded ModelOpt's three CUDA extensions and ran one bf16
# matmul (H200, driver 580.159.04, torch 2.11.0+cu130: 685 MiB; benchmarks/results/gpu_quantize.json "context").
CUDA_CONTEXT_BYTES = 685 * MIB

# Quantizer state kept from calibration to export, bytes per quantized weight (ModelOpt's presets,
# modelopt_recipes/configs/ptq): fp8 and nvfp4 keep one amax per tensor (nvfp4's 16-weight blocks are "dynamic",
# scaled when used); the int4 AWQ formats keep a float32 amax per static 128-weight block (numerics/int4_per_block).
_STATE = {"int4_awq": 4 / 128, "w4a8_awq": 4 / 128, "int4_wo": 4 / 128}
# Scale tensors the export builds for every layer before it packs any (export/layer_utils.py build_linear_config →
# quant_utils.get_weights_scaling_factor), bytes per weight: nvfp4 an FP8 scale per 16; the AWQ formats a float32
# scale per 128-weight block; per-tensor and per-channel formats next to nothing.
_SCALES = {"nvfp4": 1 / 16, "int4_awq": 4 / 128, "w4a8_awq": 4 / 128, "int4_wo": 4 / 128}
# Calibration's working copies of the largest weight matrix, bytes per element: max calibration reads |W| (one
# 16-bit copy); AWQ-lite's search (model_calib.awq_lite) runs each linear with a scaled 16-bit copy of its weight
# and a float32 fake-quantized one.
_CALIB_COPY = {"int4_awq": 6, "w4a8_awq": 6}
# Packing one weight matrix (export/quant_utils.py to_quantized_weight), bytes per element alive at once:
# fp8 divides in 16 bits (a 0-dim float32 scale does not promote) then casts to FP8 (2 + 1); the int4 formats
# gather a float32 scale per element and divide in float32 (4 + 4, pack_int4_in_uint8); nvfp4 scales in float32
# and casts with a sign byte, an ordinal byte and a 3-wide rounding comparison (4 + 1 + 1 + 3 + 1,
# NVFP4QTensor.quantize/_cast_fp4); the rest divide per channel in float32 and round (4 + 4).
_PACK = {"fp8": 3, "nvfp4": 10, "int4_awq": 8, "w4a8_awq": 8, "int4_wo": 8}
_PACK_DEFAULT = 8
# Accelerate's balanced map gives every GPU but the last total/gpus plus a buffer of 1.25 × a block. transformers
# 5.17 (measured) takes the larger of the biggest decoder layer and the *mean* leaf module; 5.23 the larger of the
# layer and the *biggest* leaf (the embedding table, for 128k vocabularies). Both are estimated and the busier wins.
BUFFER_RULES = ("mean_leaf", "biggest_leaf")


@dataclass(frozen=True)
class Share:
    """What one GPU holds of the model: whole decoder layers, and whether the embedding / lm_head sit there."""
    layers: int
    embedding: bool
    lm_head: bool


@dataclass(frozen=True)
class GpuPeak:
    """One GPU's peak, by term (bytes)."""
    weights: int
    state: int
    calibration: int
    export: int
    context: int = CUDA_CONTEXT_BYTES

    @property
    def total(self) -> int:
        return self.weights + self.state + self.calibration + self.export + self.context


def _layer_params(f: ModelFacts) -> int:
    """Quantized parameters of one decoder layer: attention q/k/v/o and the gated MLP (norms stay 16-bit)."""
    return f.hidden * f.head_dim * (2 * f.heads + 2 * f.kv_heads) + 3 * f.hidden * f.intermediate


def _table_bytes(f: ModelFacts, dtype_bytes: int) -> int:
    return f.vocab * f.hidden * dtype_bytes


def _layer_bytes(f: ModelFacts, dtype_bytes: int) -> int:
    """One decoder layer in 16 bits: the 16-bit weights less the tables and the final norm, per layer."""
    rest = weight_bytes(f, "none", dtype_bytes) - f.embedding_params * dtype_bytes - f.hidden * dtype_bytes
    return rest // f.layers


def split(facts: ModelFacts, gpus: int, dtype_bytes: int = 2, buffer_rule: str = "mean_leaf") -> list[Share]:
    """Decoder layers per GPU as from_pretrained(device_map='auto') places them on `gpus` equal GPUs.

    transformers' integrations/accelerate.py get_balanced_memory caps every GPU but the last at total/gpus + buffer
    (BUFFER_RULES); Accelerate's utils/modeling.py infer_auto_device_map fills GPUs in module order and keeps room
    for the largest block (the embedding table or a layer) on the first. GPU size matters only near the limit.
    """
    if gpus <= 1:
        return [Share(facts.layers, True, True)]
    table, layer = _table_bytes(facts, dtype_bytes), _layer_bytes(facts, dtype_bytes)
    largest = max(layer, table)
    buffer = int(1.25 * (layer if buffer_rule == "mean_leaf" else largest))
    caps = [weight_bytes(facts, "none", dtype_bytes) // gpus + buffer] * (gpus - 1) + [None]
    caps[0] -= largest
    modules = [("embedding", table)] + [("layer", layer)] * facts.layers
    if not facts.tied_embeddings:  # a tied lm_head is the embedding's tensor, on its GPU
        modules.append(("lm_head", table))
    used, counts = [0] * gpus, [{"layer": 0, "embedding": 0, "lm_head": 0} for _ in range(gpus)]
    gpu = 0
    for kind, size in modules:
        while caps[gpu] is not None and used[gpu] + size > caps[gpu]:
            gpu += 1
        used[gpu] += size
        counts[gpu][kind] += 1
    tied = facts.tied_embeddings
    return [Share(c["layer"], c["embedding"] > 0, (c["embedding"] if tied else c["lm_head"]) > 0) for c in counts]


def gpu_peaks(facts: ModelFacts, fmt: str, gpus: int, calib_batch: int, calib_seq: int, dtype_bytes: int = 2,
              buffer_rule: str = "mean_leaf") -> list[GpuPeak]:
    """Each GPU's peak while the worker quantizes on `gpus` GPUs and exports a TRT-LLM checkpoint of tensor
    parallelism `gpus` (stoker runs the worker with the spec's GPUs and --tp parallel.tensor)."""
    tokens = calib_batch * calib_seq
    h, i, kv = facts.hidden, facts.intermediate, facts.kv_heads * facts.head_dim
    table, layer = _table_bytes(facts, dtype_bytes), _layer_bytes(facts, dtype_bytes)
    layer_params = _layer_params(facts)
    largest_matrix = h * i  # gate, up or down: the biggest weight a quantizer copies or the export packs at once
    quantized = fmt != "none"
    tp = max(1, gpus)
    out = []
    for share in split(facts, gpus, dtype_bytes, buffer_rule):
        body = share.layers * layer_params
        weights = share.layers * layer + (share.embedding + (share.lm_head and not facts.tied_embeddings)) * table
        state = int(body * _STATE.get(fmt, 0))
        calibration = 0
        if quantized and share.layers:
            # One decoder layer's forward (no grad, freed layer by layer): the MLP's gate, its activation and up
            # (tokens × intermediate each) and about six tokens × hidden tensors (residual, the RMSNorm's float32
            # input counted twice, q, attention output); the KV cache transformers keeps for the whole pass
            # (use_cache is on by default) for this GPU's layers; the quantizer's copies of the largest weight.
            calibration += tokens * (3 * i + 6 * h) * dtype_bytes
            calibration += 2 * share.layers * tokens * kv * dtype_bytes
            calibration += largest_matrix * _CALIB_COPY.get(fmt, dtype_bytes)
        if quantized and share.lm_head:
            # The logits, in the model's dtype: transformers' LlamaForCausalLM upcasts only to compute a loss.
            calibration += tokens * facts.vocab * dtype_bytes
        # merge_qkv (export/model_config_utils.py) concatenates q|k|v of every layer of a rank before
        # pack_linear_weights packs them one by one to the CPU; tensor-parallel ranks are exported one after the
        # other, each holding 1/tp of each layer. (Dense MLPs keep gate and up apart: merge_gate_fc is MoE-only.)
        export = share.layers * h * (facts.heads * facts.head_dim + 2 * kv) * dtype_bytes // tp
        export += int(body * _SCALES.get(fmt, 0))
        if quantized and share.layers:
            export += largest_matrix * _PACK.get(fmt, _PACK_DEFAULT) // tp
        if share.embedding:
            # build_embedding_config multiplies the table by its normalization constant: a full copy.
            export += table
        out.append(GpuPeak(weights, state, calibration, export))
    return out


def quantize_peak_bytes(facts: ModelFacts, fmt: str, gpus: int, calib_batch: int, calib_seq: int,
                        dtype_bytes: int = 2) -> int:
    """The quantize worker's peak GPU memory on its busiest GPU, in bytes: what nvidia-smi's memory.used rises by.
    Spanning GPUs, the busier of the two placements in BUFFER_RULES."""
    return max(p.total for rule in BUFFER_RULES
               for p in gpu_peaks(facts, fmt, gpus, calib_batch, calib_seq, dtype_bytes, rule))
