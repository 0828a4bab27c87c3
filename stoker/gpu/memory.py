"""GPU memory the quantize worker (stoker/gpu/quantize_worker.py) needs: the peak on its busiest GPU.

Pure arithmetic on ModelFacts, no I/O. Each term is something the worker really holds on a GPU, named with the
upstream code that makes it; nothing here is fitted to measurements. The one constant that is not derived is the
CUDA context (CUDA_CONTEXT_BYTES), measured on its own in an otherwise empty process.
benchmarks/results/gpu_quantize.json compares these estimates with nvidia-smi on H100s.

What the worker holds, in the order it runs:
1. load: the weights in 16 bits, whatever the format (from_pretrained in --dtype). On several GPUs, whole decoder
   layers per GPU as Accelerate's balanced map places them (`split`).
2. calibrate (mtq.quantize): the quantizers' state, which stays, plus the forward pass's working set, which goes.
3. export (export_tensorrt_llm_checkpoint, the heavier of the two exports): 16-bit copies of every layer's fused
   qkv and gate/up, the scale tensors, a copy of the embedding table, then one layer at a time packed and moved
   to the CPU.
Calibration and export do not overlap, so the peak is weights + state + the larger of the two working sets + the
context. The export's working set is the larger for the calibration sizes specs use (up to about 8 × 2048 tokens
on a 128k vocabulary), because it grows with the model while calibration grows with the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .facts import ModelFacts
from .rules import weight_bytes

MIB = 1 << 20
# The CUDA context, the kernels it loads (PyTorch's, ModelOpt's extensions) and what else the driver holds outside
# PyTorch's allocator: nvidia-smi's memory.used minus torch.cuda.memory_reserved for a process that imported torch
# and ModelOpt, loaded ModelOpt's CUDA extensions and ran one bf16 matmul (H100 80GB HBM3, driver 580.159.04,
# torch 2.11.0+cu130; benchmarks/results/gpu_quantize.json "context"). Per GPU the worker touches.
CUDA_CONTEXT_BYTES = 512 * MIB

# Persistent quantizer state per quantized weight parameter, in bytes, after calibration (ModelOpt 0.47 presets,
# modelopt_recipes/configs/ptq): fp8 and nvfp4 keep one amax per tensor (nvfp4's 16-element blocks are "dynamic",
# scaled at use); int4_awq keeps a float32 amax per static 128-element block (numerics/int4_per_block.yaml).
_STATE_PER_PARAM = {"int4_awq": 4 / 128, "w4a8_awq": 4 / 128, "int4_wo": 4 / 128}
# Scale tensors the TRT-LLM export builds for every layer before packing any (export/layer_utils.py
# build_linear_config → quant_utils.get_weights_scaling_factor): nvfp4 one FP8 scale per 16 weights, the AWQ
# formats a float32 scale per 128-weight block, per-tensor/per-channel formats next to nothing.
_EXPORT_SCALES_PER_PARAM = {"nvfp4": 1 / 16, "int4_awq": 4 / 128, "w4a8_awq": 4 / 128, "int4_wo": 4 / 128}
# Formats whose calibration searches (AWQ-lite, model_calib.awq_lite): each quantized linear's forward tries
# scaled copies of its weight, a 16-bit scaled copy and a float32 fake-quantized one; max calibration reads |W|
# once (one 16-bit copy).
_SEARCHING = {"int4_awq", "w4a8_awq"}


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
        return self.weights + self.state + max(self.calibration, self.export) + self.context


def _layer_params(f: ModelFacts) -> int:
    """Quantized parameters of one decoder layer: attention q/k/v/o and the gated MLP (norms stay 16-bit)."""
    return f.hidden * f.head_dim * (2 * f.heads + 2 * f.kv_heads) + 3 * f.hidden * f.intermediate


def _table_bytes(f: ModelFacts, dtype_bytes: int) -> int:
    return f.vocab * f.hidden * dtype_bytes


def _layer_bytes(f: ModelFacts, dtype_bytes: int) -> int:
    """One decoder layer in 16 bits: the 16-bit weights less the tables and the final norm, per layer."""
    rest = weight_bytes(f, "none", dtype_bytes) - f.embedding_params * dtype_bytes - f.hidden * dtype_bytes
    return rest // f.layers


def split(facts: ModelFacts, gpus: int, dtype_bytes: int = 2) -> list[Share]:
    """Decoder layers per GPU as from_pretrained(device_map='auto') places them on `gpus` equal GPUs.

    Follows transformers' integrations/accelerate.py get_balanced_memory (each GPU but the last gets total/gpus
    plus a buffer of 1.25 × the largest unsplittable block) and Accelerate's utils/modeling.py
    infer_auto_device_map (fills GPUs in module order, keeping room for the largest block on the first GPU).
    The GPU count is what matters; GPU size only caps the map when the model is near the limit.
    """
    if gpus <= 1:
        return [Share(facts.layers, True, True)]
    table, layer = _table_bytes(facts, dtype_bytes), _layer_bytes(facts, dtype_bytes)
    total = weight_bytes(facts, "none", dtype_bytes)
    largest = max(layer, table)
    caps = [total // gpus + int(1.25 * largest)] * (gpus - 1) + [total]
    caps[0] -= largest
    modules = [("embedding", table)] + [("layer", layer)] * facts.layers
    if not facts.tied_embeddings:  # a tied lm_head is the embedding's tensor, on its GPU
        modules.append(("lm_head", table))
    used, counts = [0] * gpus, [{"layer": 0, "embedding": 0, "lm_head": 0} for _ in range(gpus)]
    gpu = 0
    for kind, size in modules:
        while gpu < gpus - 1 and used[gpu] + size > caps[gpu]:
            gpu += 1
        used[gpu] += size
        counts[gpu][kind] += 1
    shares = [Share(c["layer"], c["embedding"] > 0, c["lm_head"] > 0) for c in counts]
    if facts.tied_embeddings:
        shares = [Share(s.layers, s.embedding, s.embedding) for s in shares]
    return shares


def gpu_peaks(facts: ModelFacts, fmt: str, gpus: int, calib_batch: int, calib_seq: int,
              dtype_bytes: int = 2) -> list[GpuPeak]:
    """Each GPU's peak while the worker quantizes on `gpus` GPUs and exports a TRT-LLM checkpoint of tensor
    parallelism `gpus` (stoker gives the worker the spec's GPUs and --tp parallel.tensor)."""
    tokens = calib_batch * calib_seq
    h, i = facts.hidden, facts.intermediate
    table, layer = _table_bytes(facts, dtype_bytes), _layer_bytes(facts, dtype_bytes)
    layer_params = _layer_params(facts)
    fused_per_layer = h * (facts.heads * facts.head_dim + 2 * facts.kv_heads * facts.head_dim + 2 * i)
    quantized = fmt != "none"
    tp = max(1, gpus)
    out = []
    for share in split(facts, gpus, dtype_bytes):
        body = share.layers * layer_params
        tables = share.embedding + (share.lm_head and not facts.tied_embeddings)
        weights = share.layers * layer + tables * table
        state = int(body * _STATE_PER_PARAM.get(fmt, 0))
        calibration = 0
        if share.layers and quantized:
            # One decoder layer's forward (no grad, freed layer by layer): the MLP's gate, its activation and up
            # (t × intermediate each) and about six t × hidden tensors (residual, the RMSNorm's float32 input
            # counted twice, q/k/v, attention output); plus the KV cache transformers keeps for the whole pass
            # (use_cache defaults on) for this GPU's layers; plus the quantizer's copy of the largest weight.
            calibration += tokens * (3 * i + 6 * h) * dtype_bytes
            calibration += 2 * share.layers * tokens * facts.kv_heads * facts.head_dim * dtype_bytes
            calibration += h * i * (dtype_bytes + 4 if fmt in _SEARCHING else dtype_bytes)
        if share.lm_head and quantized:
            # The logits, in the model's dtype: transformers' LlamaForCausalLM upcasts only to compute a loss.
            calibration += tokens * facts.vocab * dtype_bytes
        # merge_qkv / merge_gate_fc (export/model_config_utils.py) concatenate q|k|v and gate|up of every layer of
        # a rank before pack_linear_weights quantizes them one by one and moves them to the CPU; with tensor
        # parallelism the ranks are done one after another, each holding 1/tp of each layer.
        export = share.layers * fused_per_layer * dtype_bytes // tp
        export += int(body * _EXPORT_SCALES_PER_PARAM.get(fmt, 0))
        if share.layers and quantized:
            # pack's working copy of one fused gate|up matrix (to_quantized_weight divides in float32).
            export += 2 * h * i * 4 // tp
        if share.embedding:
            # build_embedding_config multiplies the table by its normalization constant: a full copy.
            export += table
        out.append(GpuPeak(weights, state, calibration, export))
    return out


def quantize_peak_bytes(facts: ModelFacts, fmt: str, gpus: int, calib_batch: int, calib_seq: int,
                        dtype_bytes: int = 2) -> int:
    """The quantize worker's peak GPU memory on its busiest GPU, in bytes (what nvidia-smi's memory.used rises by)."""
    return max(p.total for p in gpu_peaks(facts, fmt, gpus, calib_batch, calib_seq, dtype_bytes))
