"""Build the CPU reference artifact from an HF checkpoint (quantized by ModelOpt or not).

    python -m stoker.workers.build_reference --checkpoint DIR --out OUTDIR

OUTDIR receives model.safetensors (float32, the checkpoint's own HF names, dequantized with the
checkpoint's own scales), config.json (without quantization_config), the tokenizer files,
generation_config.json when present, and stoker_runtime.json. The same input gives the same
bytes in every file, so the artifact can be cached by content. Progress goes to stderr, one
JSON line ({"out", "files": {name: sha256}}) to stdout; failures exit 1 with a one-line cause.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from stoker.storage.digest import file_sha256 as _sha256
from stoker.errors import StokerError
from stoker.triton.models.stop_words import collect
from stoker.workers import run_cli

ARTIFACT_FORMAT = "stoker-reference/1"
# The reference runtime tokenizes with the `tokenizers` library: tokenizer.json is a must.
REQUIRED_TOKENIZER_FILES = ("tokenizer.json",)
OPTIONAL_FILES = ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "generation_config.json", "chat_template.jinja")


class BuildError(StokerError):
    """The checkpoint cannot be turned into a reference artifact."""


def log(message: str) -> None:
    print(f"build_reference: {message}", file=sys.stderr, flush=True)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BuildError(f"cannot read {path.name}: {exc}") from None


def _first_id(value: Any) -> int | None:
    """Token ids in HF configs are an int, a list of ints (first wins) or null."""
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_id(checkpoint: Path, key: str) -> int | None:
    token = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if token is None and (checkpoint / name).is_file():
            token = _token_text(_read_json(checkpoint / name).get(key))
    if token is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).token_to_id(token)


def special_ids(checkpoint: Path, config: dict[str, Any], generation: dict[str, Any]) -> tuple[int, int, list[int]]:
    """(end_id, pad_id, stop ids): every eos id stops generation; stoker/triton/models/stop_words.py says which
    one is end_id (TensorRT-LLM takes one) and which travel as stop words. pad: generation_config, config.json,
    then the tokenizer's own token."""
    end_id, stop_ids = collect(generation, config, _tokenizer_id(checkpoint, "eos_token"))
    if end_id is None:
        raise BuildError("no eos token id in generation_config.json, config.json or the tokenizer")
    pad_id = _first_id(generation.get("pad_token_id"))
    if pad_id is None:
        pad_id = _first_id(config.get("pad_token_id"))
    if pad_id is None:
        pad_id = _tokenizer_id(checkpoint, "pad_token")
    return end_id, end_id if pad_id is None else pad_id, list(stop_ids)



def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build(checkpoint: Path, out: Path) -> dict[str, str]:
    """Write the artifact into `out`; returns {file name: sha256}."""
    if not (checkpoint / "config.json").is_file():
        raise BuildError(f"checkpoint {checkpoint} has no config.json")
    for name in REQUIRED_TOKENIZER_FILES:
        if not (checkpoint / name).is_file():
            raise BuildError(f"checkpoint {checkpoint} has no {name}")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise BuildError(f"output directory {out} is not empty")

    import torch
    from safetensors.torch import save_file

    from stoker.runtime.dequant import load_dequantized, read_quantization

    fmt, kv, _group = read_quantization(checkpoint)
    log(f"loading {checkpoint} (format {fmt}, kv cache {kv})")
    state, kv_scales = load_dequantized(checkpoint)
    if kv is not None and not kv_scales:
        raise BuildError(f"kv_cache_quant_algo set but no k_scale/v_scale tensors in {checkpoint}")
    # Contiguous float32 in sorted order; save_file's bytes then depend only on the values.
    tensors = {name: state[name].to(torch.float32).contiguous() for name in sorted(state)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    log(f"wrote {len(tensors)} float32 tensors")

    config = _read_json(checkpoint / "config.json")
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    if "torch_dtype" in config:
        config["torch_dtype"] = "float32"
    _write_json(out / "config.json", config)
    for name in REQUIRED_TOKENIZER_FILES + OPTIONAL_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / name)

    generation = _read_json(checkpoint / "generation_config.json") if (checkpoint / "generation_config.json").is_file() else {}
    end_id, pad_id, stop_ids = special_ids(checkpoint, config, generation)
    _write_json(out / "stoker_runtime.json", {
        "format": ARTIFACT_FORMAT,
        "dtype": "float32",
        "end_id": end_id,
        "pad_id": pad_id,
        "stop_ids": stop_ids,
        "quantization": {
            "format": fmt,
            "kv_cache_dtype": kv,
            "kv_scales": {str(layer): {"k": s["k"], "v": s["v"]} for layer, s in sorted(kv_scales.items())},
        },
    })
    log(f"end_id {end_id}, stop ids {stop_ids}, pad_id {pad_id}, {len(kv_scales)} layers with KV scales")
    return {p.name: _sha256(p) for p in sorted(out.iterdir()) if p.is_file()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the float32 CPU reference artifact from a checkpoint.")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="output directory (empty or absent)")
    args = parser.parse_args(argv)
    return run_cli(lambda: {"out": str(args.out), "files": build(args.checkpoint, args.out)})


if __name__ == "__main__":
    sys.exit(main())
