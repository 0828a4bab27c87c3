"""Post-training quantization with nvidia-modelopt 0.47, exported as a unified HF checkpoint.

    python -m stoker.workers.quantize --request REQ.json --out OUTDIR

REQ = {"checkpoint": DIR, "format": "fp8|int8_sq|int4_awq|w4a8_awq", "kv_cache_dtype": null|"fp8",
       "calibration": {"text_file": PATH, "samples": N, "seq_len": N, "batch_size": N}, "seed": N,
       optional "load_dtype": "float32"|"bfloat16", optional "fake_quant_out": PATH}

Writes into OUTDIR only (config.json with quantization_config, hf_quant_config.json,
*.safetensors, tokenizer files, generation_config.json, stoker_quantize.json); progress goes
to stderr (calibration batches as `stoker-progress` lines), one JSON summary line to stdout.
Exits 1 with a one-line cause on any failure.
`fake_quant_out` (a file outside OUTDIR) receives ModelOpt's fake-quantized weights, so
tests can prove that our dequantization reads the export the way ModelOpt meant it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import itertools
import json
import logging
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoker.errors import StokerError
from stoker.record.progress import child_line
from stoker.workers import run_cli

# stoker format -> name of the modelopt.torch.quantization config (0.47).
FORMAT_CONFIGS = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
}
KV_CONFIGS = {"fp8": "FP8_KV_CFG"}
LOAD_DTYPES = ("float32", "bfloat16")
# Copied from the source checkpoint: export_hf_checkpoint writes weights and config only.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")


class QuantizeError(StokerError):
    """The request is invalid or quantization/export failed."""


@dataclass(frozen=True)
class Calibration:
    text_file: Path
    samples: int
    seq_len: int
    batch_size: int


@dataclass(frozen=True)
class Request:
    checkpoint: Path
    format: str
    kv_cache_dtype: str | None
    calibration: Calibration
    seed: int
    load_dtype: str = "float32"
    fake_quant_out: Path | None = None


def log(message: str) -> None:
    print(f"quantize: {message}", file=sys.stderr, flush=True)


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_libraries() -> None:
    """Silence what the pinned libraries say about themselves, not about the user's model; each is named.

    Call before importing modelopt.
    """
    # modelopt 0.47 compares transformers with the range it was tested on at import; the pair is pinned
    # in pyproject.toml and in the image, and the tests run that pair.
    warnings.filterwarnings("ignore", message=r"transformers .* is not tested with current version of modelopt")
    # modelopt 0.47's export copies a scale with torch.tensor(tensor) (unified_export_hf.py); harmless.
    warnings.filterwarnings("ignore", message=r"To copy construct from a tensor", module=r"modelopt\.")
    # Every format's config leaves lm_head unquantized, so SmoothQuant has nothing to smooth there.
    warnings.filterwarnings("ignore", message=r"lm_head is not calibrated, skip smoothing")
    # We pass dtype=; modelopt 0.47's export reads model.config.torch_dtype itself
    # (unified_export_hf._resolve_export_dtype), and transformers 5 warns on that read.
    logging.getLogger("transformers.configuration_utils").addFilter(_DropMessage("`torch_dtype` is deprecated"))


@contextlib.contextmanager
def library_prints():
    """ModelOpt prints its own progress ("Inserted 106 quantizers"): kept out of the log unless the call fails."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    except BaseException:
        sys.stderr.write(buffer.getvalue())
        raise


def parse_request(raw: dict[str, Any]) -> Request:
    """Validate the request up front, before any heavy import."""
    fmt = raw.get("format")
    if fmt == "none":
        raise QuantizeError("format 'none' needs no quantization: pass the checkpoint through instead")
    if fmt not in FORMAT_CONFIGS:
        raise QuantizeError(f"format {fmt!r} not supported; expected one of {sorted(FORMAT_CONFIGS)}")
    kv = raw.get("kv_cache_dtype")
    if kv == "none":
        kv = None
    if kv == "int8":
        # 0.47's export_hf_checkpoint asserts "Invalid KV cache quantization format" for INT8 KV.
        raise QuantizeError("kv_cache_dtype 'int8' cannot be exported by modelopt 0.47's unified HF export; use 'fp8'")
    if kv is not None and kv not in KV_CONFIGS:
        raise QuantizeError(f"kv_cache_dtype {kv!r} not supported; expected null or one of {sorted(KV_CONFIGS)}")
    checkpoint = Path(str(raw.get("checkpoint", "")))
    if not (checkpoint / "config.json").is_file():
        raise QuantizeError(f"checkpoint {checkpoint} has no config.json")
    cal = raw.get("calibration") or {}
    try:
        calibration = Calibration(Path(cal["text_file"]), int(cal["samples"]), int(cal["seq_len"]),
                                  int(cal["batch_size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise QuantizeError(f"calibration needs text_file, samples, seq_len, batch_size ({exc})") from None
    if not calibration.text_file.is_file():
        raise QuantizeError(f"calibration text_file {calibration.text_file} not found")
    if calibration.samples < 1 or calibration.seq_len < 2 or calibration.batch_size < 1:
        raise QuantizeError("calibration samples and batch_size must be >= 1 and seq_len >= 2")
    load_dtype = raw.get("load_dtype", "float32")
    if load_dtype not in LOAD_DTYPES:
        raise QuantizeError(f"load_dtype {load_dtype!r} not in {LOAD_DTYPES} (float16 is ~4x slower on CPU)")
    fq = raw.get("fake_quant_out")
    return Request(checkpoint, fmt, kv, calibration, int(raw.get("seed", 0)), load_dtype, Path(fq) if fq else None)


def text_windows(text: str, max_chars: int) -> list[str]:
    """`text` in consecutive pieces of at most `max_chars` characters; "".join(pieces) == text.

    Pieces end at line ends where they can, else just before a space (so the next piece starts
    with " word", as the word is tokenized in running text), else anywhere.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    pieces: list[str] = []
    current = ""
    for line in text.splitlines(keepends=True):
        if len(current) + len(line) <= max_chars:
            current += line
            continue
        if current:
            pieces.append(current)
        while len(line) > max_chars:
            cut = line.rfind(" ", 1, max_chars + 1)
            cut = cut if cut > 0 else max_chars
            pieces.append(line[:cut])
            line = line[cut:]
        current = line
    if current:
        pieces.append(current)
    return pieces


def calibration_tokens(tokenizer: Any, text: str) -> list[int]:
    """The text's ids, tokenized in windows that each fit the model's maximum length.

    One call on the whole text makes transformers warn that the sequence is longer than the model
    can take, though only `seq_len` windows of it ever reach the model. A character is at most 4
    UTF-8 bytes, so at most 4 byte-level tokens: a window of max_length // 4 characters fits.
    """
    limit = getattr(tokenizer, "model_max_length", None)
    limit = limit if isinstance(limit, int) and 0 < limit <= 1_000_000 else 4096  # unset: a huge sentinel
    ids: list[int] = []
    for piece in text_windows(text, max(1, min(limit, 4096) // 4)):
        ids.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
    return ids


def calibration_ids(token_ids: list[int], samples: int, seq_len: int, bos_id: int | None) -> list[list[int]]:
    """`samples` windows of exactly `seq_len` ids: consecutive chunks of the text, wrapping around.

    Deterministic in its inputs; each window starts with BOS when the tokenizer has one, as
    the model sees at inference.
    """
    if not token_ids:
        raise QuantizeError("calibration text tokenizes to nothing")
    body = seq_len - (1 if bos_id is not None else 0)
    needed = samples * body
    stream = (token_ids * (needed // len(token_ids) + 1))[:needed]
    windows = [stream[i * body:(i + 1) * body] for i in range(samples)]
    return [[bos_id, *w] if bos_id is not None else w for w in windows]


def quant_config(mtq: Any, fmt: str, kv: str | None) -> tuple[dict, list[str]]:
    """The modelopt config for the format (+ KV cache entries) and the names it came from."""
    names = [FORMAT_CONFIGS[fmt]]
    cfg = getattr(mtq, FORMAT_CONFIGS[fmt])
    if kv is not None:
        names.append(KV_CONFIGS[kv])
        # KV presets carry only quantizer entries; this helper appends them to the main config.
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, getattr(mtq, KV_CONFIGS[kv])["quant_cfg"])
    return cfg, names


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checkpoint_dtype(config: dict) -> str:
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return name.replace("torch.", "")


def _restore_config_dtype(config_path: Path, source_config: dict, dtype_name: str) -> None:
    """The exporter records the dtype the model was loaded in; downstream builders read it as the
    checkpoint's activation dtype, so put back the source's."""
    config = json.loads(config_path.read_text())
    config["dtype"] = dtype_name
    if "torch_dtype" in source_config or "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _dump_fake_quant(model: Any, path: Path, export_dtype: Any) -> int:
    """Save each quantized linear's fake-quantized weight (float32), as ModelOpt computes it.

    The exporter first re-smooths layers that share an input (AWQ/SmoothQuant) and then quantizes
    weights cast to the export dtype; doing the same here makes the dump comparable with the export.
    """
    import torch
    from modelopt.torch.export.unified_export_hf import (
        requantize_resmooth_fused_llm_layers,
    )
    from safetensors.torch import save_file

    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)
        dump: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            quantizer = getattr(module, "weight_quantizer", None)
            if quantizer is None or not quantizer.is_enabled:
                continue
            weight = module.weight.detach().to(export_dtype).float()
            dump[f"{name}.weight"] = quantizer(weight).float().contiguous()
            pqs = getattr(getattr(module, "input_quantizer", None), "_pre_quant_scale", None)
            if pqs is not None:
                dump[f"{name}.pre_quant_scale"] = pqs.detach().float().reshape(-1).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(dump, str(path))
    return len(dump)


def quantize(req: Request, out: Path) -> dict[str, Any]:
    """Load, calibrate, quantize and export; returns the stoker_quantize.json contents."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise QuantizeError(f"output directory {out} is not empty")
    log(f"importing torch/transformers/modelopt ({req.format}, kv {req.kv_cache_dtype})")
    quiet_libraries()
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(req.seed)
    source_config = json.loads((req.checkpoint / "config.json").read_text())
    export_name = _checkpoint_dtype(source_config)
    export_dtype = getattr(torch, export_name, None)
    if not isinstance(export_dtype, torch.dtype):
        raise QuantizeError(f"config.json dtype {export_name!r} is not a torch dtype")
    load_dtype = getattr(torch, req.load_dtype)

    tokenizer = AutoTokenizer.from_pretrained(req.checkpoint)
    text = req.calibration.text_file.read_text(encoding="utf-8")
    ids = calibration_tokens(tokenizer, text)
    windows = calibration_ids(ids, req.calibration.samples, req.calibration.seq_len, tokenizer.bos_token_id)
    batches = [torch.tensor(windows[i:i + req.calibration.batch_size], dtype=torch.long)
               for i in range(0, len(windows), req.calibration.batch_size)]
    log(f"calibration: {len(ids)} text tokens -> {len(windows)} x {req.calibration.seq_len} in {len(batches)} batches")

    t0 = time.monotonic()
    # Loaded from disk (not built in memory): ModelOpt's export needs a from_pretrained model.
    model = AutoModelForCausalLM.from_pretrained(req.checkpoint, dtype=load_dtype).eval()
    log(f"loaded {req.checkpoint} as {req.load_dtype} in {time.monotonic() - t0:.1f}s")

    passes = itertools.count(1)

    def forward_loop(m: Any) -> None:
        # ModelOpt runs this once per calibration pass (max: 1; SmoothQuant and AWQ search: more), so each
        # pass is reported on its own: the number of passes is ModelOpt's to choose.
        label = f"calibration pass {next(passes)}"
        child_line(label, 0, len(batches), "batch")
        with torch.no_grad():
            for done, batch in enumerate(batches, 1):
                m(input_ids=batch)
                child_line(label, done, len(batches), "batch")

    with library_prints():  # the KV helper prints the whole merged config
        cfg, cfg_names = quant_config(mtq, req.format, req.kv_cache_dtype)
    t0 = time.monotonic()
    with library_prints():
        model = mtq.quantize(model, cfg, forward_loop=forward_loop)
    calib_s = time.monotonic() - t0
    log(f"mtq.quantize with {'+'.join(cfg_names)} took {calib_s:.1f}s")

    fake_quant = None
    if req.fake_quant_out is not None:
        fake_quant = _dump_fake_quant(model, req.fake_quant_out, export_dtype)
        log(f"wrote {fake_quant} fake-quantized tensors to {req.fake_quant_out}")

    # Non-quantized tensors are written in the checkpoint's own dtype (we may have calibrated
    # in float32).
    model.config.dtype = export_dtype
    t0 = time.monotonic()
    # export_hf_checkpoint mutates the model (packs weights), so it is the last thing done with it.
    with library_prints():
        export_hf_checkpoint(model, dtype=export_dtype, export_dir=out)
    log(f"export_hf_checkpoint took {time.monotonic() - t0:.1f}s")
    del model
    _restore_config_dtype(out / "config.json", source_config, export_name)

    for name in TOKENIZER_FILES:
        if (req.checkpoint / name).is_file():
            shutil.copyfile(req.checkpoint / name, out / name)
    if (req.checkpoint / "generation_config.json").is_file():
        # The source's file wins over the one the exporter derives from the model config.
        shutil.copyfile(req.checkpoint / "generation_config.json", out / "generation_config.json")

    from stoker.plan.quant_check import check_checkpoint

    report = check_checkpoint(out, req.format, req.kv_cache_dtype)
    log(f"structural check: {report.quantized_weights} quantized weights, quant_algo {report.quant_algo}")
    info = {
        "format": req.format,
        "kv_cache_dtype": req.kv_cache_dtype,
        "modelopt_version": modelopt.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "modelopt_configs": cfg_names,
        "quant_algo": report.quant_algo,
        "load_dtype": req.load_dtype,
        "export_dtype": export_name,
        "seed": req.seed,
        "calibration": {
            "text_sha256": _sha256(req.calibration.text_file),
            "text_tokens": len(ids),
            "samples": req.calibration.samples,
            "seq_len": req.calibration.seq_len,
            "batch_size": req.calibration.batch_size,
            "batches": len(batches),
            "tokens_used": sum(len(w) for w in windows),
            "duration_s": round(calib_s, 3),
        },
        "fake_quant_tensors": fake_quant,
        "duration_s": round(time.monotonic() - started, 3),
    }
    (out / "stoker_quantize.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


# A folder where each distinct request (the checkpoint's files, the format, the calibration text and settings, the
# seed) is quantized once and copied from then on: the output is a pure function of them (test_quantize checks it,
# with the memo off), and `make test-services` quantizes the same tiny model the same way in many files.
MEMO_ENV = "STOKER_QUANTIZE_MEMO"


def memo_key(raw: dict[str, Any], req: Request) -> str:
    content = {k: v for k, v in raw.items() if k not in ("checkpoint", "calibration")}
    content["calibration"] = {**(raw.get("calibration") or {}), "text_file": _sha256(req.calibration.text_file)}
    content["checkpoint"] = {p.name: _sha256(p) for p in sorted(req.checkpoint.iterdir()) if p.is_file()}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


def memoized(memo: Path, raw: dict[str, Any], req: Request, out: Path) -> dict[str, Any]:
    """quantize() once per request content into ``memo`` (one process at a time), then a copy."""
    from stoker.atomic import make_once

    entry = memo / memo_key(raw, req)

    def make() -> None:
        staged = memo / f".{entry.name}.{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        quantize(req, staged)
        os.replace(staged, entry)  # last: the entry is complete

    if not make_once(entry, (entry / "stoker_quantize.json").is_file, make):
        log(f"the same request was quantized earlier in this suite: copied from {MEMO_ENV} ({entry.name})")
    if out.exists() and any(out.iterdir()):
        raise QuantizeError(f"output directory {out} is not empty")
    shutil.copytree(entry, out, dirs_exist_ok=True)
    return json.loads((out / "stoker_quantize.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Quantize an HF Llama checkpoint with nvidia-modelopt.")
    parser.add_argument("--request", type=Path, required=True, help="JSON request file")
    parser.add_argument("--out", type=Path, required=True, help="output directory (empty or absent)")
    args = parser.parse_args(argv)

    def work() -> dict:
        try:
            raw = json.loads(args.request.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise QuantizeError(f"cannot read request {args.request}: {exc}") from None
        req = parse_request(raw)
        memo = os.environ.get(MEMO_ENV)
        # ModelOpt and transformers print progress to stdout; keep stdout for our one JSON line.
        with contextlib.redirect_stdout(sys.stderr):
            if memo and not raw.get("fake_quant_out"):
                info = memoized(Path(memo), raw, req, args.out)
            else:
                info = quantize(req, args.out)
        return {"out": str(args.out), "format": info["format"], "duration_s": info["duration_s"]}

    return run_cli(work)


if __name__ == "__main__":
    sys.exit(main())
