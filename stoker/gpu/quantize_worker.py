"""ModelOpt quantization for the GPU targets; runs *inside the serving image* (or on CPU for tests).

    python3 -m stoker.gpu.quantize_worker --model HF_DIR --format fp8 --kv-cache-dtype none
        --dtype bfloat16 --calib-file TXT --calib-size 512 --calib-seq-len 512 --calib-batch-size 8
        [--hf-out DIR] [--trtllm-out DIR --tp 1 --pp 1] [--device cuda|cpu] [--seed 0]

Imports only the standard library, torch, transformers and modelopt (what the image has).
With --device cuda and several GPUs visible, the model spans them all (see `placement`): a model
too big for one GPU (a 70B tensor-parallel-2 spec) is quantized on the GPUs the spec gives it.
Format 'none' skips calibration and only exports the TRT-LLM checkpoint. The TRT-LLM
checkpoint is exported before the unified HF one because export_hf_checkpoint mutates the
model. Each output is checked structurally (stoker.gpu.checkpoint_check) before exit 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from .checkpoint_check import CheckpointError, check_trtllm_checkpoint, check_unified_checkpoint

# stoker format → modelopt.torch.quantization config name. The weight-only ones may be missing from older
# ModelOpt: then _WEIGHT_ONLY builds them (weights per channel (int8) or per 128-block (int4), no activations).
NAMED_CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
                 "int8_sq": "INT8_SMOOTHQUANT_CFG", "int4_awq": "INT4_AWQ_CFG", "w4a8_awq": "W4A8_AWQ_BETA_CFG",
                 "nvfp4": "NVFP4_DEFAULT_CFG", "int8_wo": "INT8_WEIGHT_ONLY_CFG",
                 "int4_wo": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"}
_WEIGHT_ONLY = {"int8_wo": {"num_bits": 8, "axis": 0}, "int4_wo": {"num_bits": 4, "block_sizes": {-1: 128}}}
# Share of each GPU's free memory the weights may take when the model spans GPUs. The rest is the worker's working
# room beside the weights: calibration's activations and logits, then the TRT-LLM export's copies (every layer's
# fused q|k|v, the embedding table, scales, the matrix being packed) and the CUDA context. On two H200s each GPU
# peaked at 1.17-1.42x the weights it held (Llama-3-8B shapes; benchmarks/results/gpu_quantize.json, estimate in
# stoker/gpu/memory.py), so weights up to 60 % of a GPU leave that room with some to spare for larger calibration
# batches; a model that needs more is refused before calibration rather than running out of memory after it.
WEIGHT_SHARE = 0.6
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json", "chat_template.jinja")


def log(msg: str) -> None:
    print(f"quantize_worker: {msg}", file=sys.stderr, flush=True)


def _set_rule(cfg: dict, pattern: str, settings: dict) -> None:
    """Add one quantizer rule in either config layout: a dict (ModelOpt <= 0.4x, e.g. 0.37 in the
    TRT-LLM 1.2.1 image) or the list of {quantizer_name, cfg, enable} entries (0.47)."""
    rules = cfg["quant_cfg"]
    if isinstance(rules, dict):
        rules[pattern] = dict(settings)
        return
    enable = settings.get("enable", True)
    body = {k: v for k, v in settings.items() if k != "enable"}
    rules.append({"quantizer_name": pattern, **({"cfg": body} if body else {}), "enable": enable})


def quant_config(mtq, fmt: str, kv: str) -> dict:
    import copy

    named = getattr(mtq, NAMED_CONFIGS[fmt], None)
    if named is not None:
        cfg = copy.deepcopy(named)
    else:
        cfg = {"quant_cfg": {"*": {"enable": False}}, "algorithm": "max"}
        _set_rule(cfg, "*weight_quantizer", _WEIGHT_ONLY[fmt])
        _set_rule(cfg, "*lm_head*", {"enable": False})
    if kv != "none":
        # The K/V outputs of attention: FP8 (E4M3) or INT8, one scale per tensor.
        _set_rule(cfg, "*[kv]_bmm_quantizer", {"num_bits": (4, 3) if kv == "fp8" else 8, "axis": None})
    return cfg


def placement(device: str, free_bytes: list[int]) -> dict:
    """from_pretrained's placement arguments. {} means: load, then move the whole model to `device` (one GPU or
    the CPU, as before). For plain 'cuda' with several GPUs visible: device_map 'auto' (Accelerate's balanced map,
    whole decoder layers per GPU) with max_memory capping each GPU at WEIGHT_SHARE of its free memory, as
    ModelOpt's examples/llm_ptq (example_utils.get_model) loads models that a single GPU cannot hold."""
    if device != "cuda" or len(free_bytes) < 2:
        return {}
    return {"device_map": "auto", "max_memory": {i: int(free * WEIGHT_SHARE) for i, free in enumerate(free_bytes)}}


def layers_per_device(device_map: dict) -> dict[str, int]:
    """How many entries of a from_pretrained device map sit on each device (for the log line)."""
    counts: dict[str, int] = {}
    for where in device_map.values():
        name = f"cuda:{where}" if isinstance(where, int) else str(where)
        counts[name] = counts.get(name, 0) + 1
    return counts


def calibration_batches(tokenizer, text_file: Path, samples: int, seq_len: int, batch_size: int) -> list[list[list[int]]]:
    """`samples` consecutive windows of `seq_len` tokens from the offline text (wrapping), in batches."""
    ids = tokenizer(text_file.read_text(), add_special_tokens=False)["input_ids"]
    if not ids:
        raise SystemExit("quantize_worker: calibration text tokenizes to nothing")
    need = samples * seq_len
    stream = (ids * (need // len(ids) + 1))[:need]
    windows = [stream[i * seq_len:(i + 1) * seq_len] for i in range(samples)]
    return [windows[i:i + batch_size] for i in range(0, samples, batch_size)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="stoker.gpu.quantize_worker")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--format", required=True, choices=["none", *NAMED_CONFIGS, *_WEIGHT_ONLY])
    p.add_argument("--kv-cache-dtype", default="none", choices=["none", "fp8", "int8"])
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--calib-file", type=Path)
    p.add_argument("--calib-size", type=int, default=512)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--calib-batch-size", type=int, default=8)
    p.add_argument("--hf-out", type=Path)
    p.add_argument("--trtllm-out", type=Path)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not (a.hf_out or a.trtllm_out):
        p.error("give --hf-out and/or --trtllm-out")
    if a.format != "none" and not (a.calib_file and a.calib_file.is_file()):
        p.error(f"--calib-file {a.calib_file} not found")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    gpus = torch.cuda.device_count() if a.device == "cuda" else 0
    where = placement(a.device, [torch.cuda.mem_get_info(i)[0] for i in range(gpus)] if gpus > 1 else [])
    # from_pretrained, not built in memory: ModelOpt's exporters need a loaded HF model.
    try:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, **where)
    except ValueError as err:  # Accelerate sent layers to disk: the weights exceed the GPUs' WEIGHT_SHARE
        if where and "offload" in str(err):
            raise SystemExit(f"quantize_worker: the weights need more than {WEIGHT_SHARE:.0%} of the {gpus} "
                             "visible GPUs' free memory; give the spec more or larger GPUs") from None
        raise
    model = (model if where else model.to(a.device)).eval()
    devices = sorted({str(p.device) for p in model.parameters()})
    if where and any(not d.startswith("cuda") for d in devices):
        raise SystemExit(f"quantize_worker: part of the model landed on {devices}, not on the {gpus} GPUs")
    # Calibration batches go where the model reads its input: the input embeddings' device (cuda:0 when spanning).
    input_device = model.get_input_embeddings().weight.device
    spread = f" ({layers_per_device(model.hf_device_map)} device-map entries)" if where else ""
    log(f"loaded {a.model} as {a.dtype} on {', '.join(devices)}{spread} in {time.monotonic() - t0:.1f}s")
    summary: dict = {"format": a.format, "kv_cache_dtype": a.kv_cache_dtype, "dtype": a.dtype, "devices": devices}
    if a.format != "none":
        import modelopt
        import modelopt.torch.quantization as mtq

        batches = calibration_batches(tokenizer, a.calib_file, a.calib_size, a.calib_seq_len, a.calib_batch_size)

        def forward_loop(m) -> None:
            with torch.no_grad():
                for batch in batches:
                    m(torch.tensor(batch, device=input_device))

        t1 = time.monotonic()
        model = mtq.quantize(model, quant_config(mtq, a.format, a.kv_cache_dtype), forward_loop=forward_loop)
        summary |= {"modelopt": modelopt.__version__, "calibration_s": round(time.monotonic() - t1, 2),
                    "calibration_samples": a.calib_size}
        log(f"mtq.quantize ({a.format}, kv {a.kv_cache_dtype}) took {summary['calibration_s']}s")
    try:
        if a.trtllm_out:
            from modelopt.torch.export import export_tensorrt_llm_checkpoint

            from stoker.gpu.decoders import decoder_type, refusal

            arch = type(model).__name__
            decoder = decoder_type(arch)
            if decoder is None:  # plan refuses this first; a worker run by hand says it before a confusing trace
                raise CheckpointError(refusal(arch))
            summary["decoder_type"] = decoder
            t2 = time.monotonic()
            export_tensorrt_llm_checkpoint(model, decoder_type=decoder, dtype=dtype,
                                           export_dir=a.trtllm_out, inference_tensor_parallel=a.tp,
                                           inference_pipeline_parallel=a.pp)
            summary["trtllm_export_s"] = round(time.monotonic() - t2, 2)
            summary["trtllm_checkpoint"] = check_trtllm_checkpoint(a.trtllm_out, a.format, a.kv_cache_dtype,
                                                                   a.tp * a.pp)
            log(f"TRT-LLM checkpoint in {a.trtllm_out}: {summary['trtllm_checkpoint']}")
        if a.hf_out:
            from modelopt.torch.export import export_hf_checkpoint

            export_hf_checkpoint(model, dtype=dtype, export_dir=a.hf_out)  # mutates the model: last
            for name in TOKENIZER_FILES:
                if (a.model / name).is_file():
                    shutil.copyfile(a.model / name, a.hf_out / name)
            summary["unified_checkpoint"] = check_unified_checkpoint(a.hf_out, a.format, a.kv_cache_dtype)
            log(f"unified HF checkpoint in {a.hf_out}: {summary['unified_checkpoint']}")
    except CheckpointError as err:
        print(f"quantize_worker: {err}", file=sys.stderr)
        return 1
    if a.device.startswith("cuda"):
        # What the caching allocator held at its peak on each GPU (nvidia-smi adds the CUDA context on top).
        summary["peak_reserved_mib"] = {d: torch.cuda.max_memory_reserved(torch.device(d)) >> 20
                                        for d in devices if d.startswith("cuda")}
        log(f"peak reserved per GPU (MiB): {summary['peak_reserved_mib']}")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
