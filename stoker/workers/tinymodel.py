"""Build a tiny, seeded decoder checkpoint with its own byte-level BPE tokenizer, fully offline.

Run as a child process (it imports torch and transformers):

    python -m stoker.workers.tinymodel --out DIR --seed 0 [--architecture llama|qwen2|mistral|phi3|gemma]

Llama is the demo model; the others exist so tests can serve architectures nobody on the project
wrote, each with what makes it differ from Llama switched on (Qwen2's q/k/v biases, Mistral's
sliding window, Phi-3's fused qkv/gate_up projections).

It prints one JSON line {"out": DIR, "files": {name: sha256}} and exits 0. The same seed gives
byte-identical files, so the checkpoint can stand in for a pinned Hub revision in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from stoker.storage.digest import file_sha256 as sha256_file

CORPUS = Path(__file__).resolve().parent.parent / "data" / "tokenizer_corpus.txt"

# Shapes chosen so quantizers accept them: hidden/intermediate multiples of 128 (AWQ group
# size), vocab a multiple of 64; GQA (8 query heads, 2 kv heads) like current Llamas.
VOCAB_SIZE = 2048
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 4
NUM_HEADS = 8
NUM_KV_HEADS = 2
MAX_POSITIONS = 2048

# Llama's id layout: unk 0, bos 1, eos 2; a distinct pad so padding never reads as end of text.
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3


class TinyModelError(RuntimeError):
    """The tiny-model worker failed."""



def _train_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        # Order fixes the ids: unk 0, bos 1, eos 2, pad 3.
        special_tokens=[SPECIAL_TOKENS[k] for k in ("unk_token", "bos_token", "eos_token", "pad_token")],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    for key, expected in (("unk_token", UNK_ID), ("bos_token", BOS_ID), ("eos_token", EOS_ID), ("pad_token", PAD_ID)):
        if tokenizer.token_to_id(SPECIAL_TOKENS[key]) != expected:
            raise TinyModelError(f"{key} got id {tokenizer.token_to_id(SPECIAL_TOKENS[key])}, expected {expected}")
    return tokenizer


def _save_tokenizer(out: Path) -> int:
    """Save the tokenizer so that transformers 4 and 5 both load it; returns its vocab size."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(), model_max_length=MAX_POSITIONS, **SPECIAL_TOKENS)
    wrapped.save_pretrained(out)
    # transformers 5 records tokenizer_class "TokenizersBackend" and writes no
    # special_tokens_map.json; transformers 4 and other readers need both.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.update(SPECIAL_TOKENS)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS, indent=2, sort_keys=True) + "\n")
    return len(wrapped)


def _add_legacy_config_keys(config_path: Path) -> None:
    """Also spell dtype and rope theta the way transformers 4 and TensorRT-LLM's converters read them."""
    config = json.loads(config_path.read_text())
    config.setdefault("torch_dtype", config.get("dtype", "bfloat16"))
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


ARCHITECTURES = ("llama", "qwen2", "mistral", "phi3", "gemma")


def _config(architecture: str):
    """transformers' config of the architecture, with the tiny shapes and Llama's special ids."""
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if architecture == "llama":
        return transformers.LlamaConfig(**common)
    if architecture == "qwen2":  # Qwen2 always has q/k/v biases
        return transformers.Qwen2Config(**common)
    if architecture == "mistral":  # a window shorter than the tests' sequences, so it matters
        return transformers.MistralConfig(**common, sliding_window=16)
    if architecture == "phi3":
        return transformers.Phi3Config(**common)
    if architecture == "gemma":  # the engine path's decoder check (benchmarks/gpu_engine_architectures.sh) only
        return transformers.GemmaConfig(**common, head_dim=HIDDEN_SIZE // NUM_HEADS)
    raise TinyModelError(f"unknown architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")


def _randomize_biases(model) -> None:
    """Random init zeroes biases, which would make a runtime that drops them look right."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.5)


def build(out: Path, seed: int, architecture: str = "llama") -> dict[str, str]:
    """Write the checkpoint and tokenizer into out; returns {file name: sha256}."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = _config(architecture)
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    vocab = _save_tokenizer(out)
    if vocab > VOCAB_SIZE:
        raise TinyModelError(f"tokenizer has {vocab} tokens, more than the model's {VOCAB_SIZE}")
    model = AutoModelForCausalLM.from_config(config)
    _randomize_biases(model)
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out, safe_serialization=True)
    _add_legacy_config_keys(out / "config.json")
    return {path.name: sha256_file(path) for path in sorted(out.iterdir()) if path.is_file()}


# A folder where each (architecture, seed) is built once and copied from then on: the model is a pure function of
# both (test_stack_and_hub checks it), and `make test-services` generates the same few dozens of times otherwise.
CACHE_ENV = "STOKER_TINY_MODEL_CACHE"


def cached_build(cache: Path, out: Path, seed: int, architecture: str) -> dict[str, str]:
    """build() once per (architecture, seed) into ``cache`` (one process at a time), then a copy."""
    import shutil

    from stoker.atomic import make_once

    entry = cache / f"{architecture}-{seed}"

    def make() -> None:
        shutil.rmtree(entry, ignore_errors=True)
        files = build(entry / "model", seed, architecture)
        (entry / "files.json").write_text(json.dumps(files))  # last: the entry is complete

    make_once(entry, (entry / "files.json").is_file, make)
    files = json.loads((entry / "files.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for name in files:
        shutil.copyfile(entry / "model" / name, out / name)
    return files


def make_tiny_model(out: Path, seed: int = 0, timeout_s: float = 300, architecture: str = "llama") -> dict[str, str]:
    """Run this worker in a child process; returns {file name: sha256}.

    Raises:
        TinyModelError: the worker failed or timed out (message carries its last stderr line).
    """
    argv = [sys.executable, "-m", "stoker.workers.tinymodel", "--out", str(out), "--seed", str(seed),
            "--architecture", architecture]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise TinyModelError(f"tiny model worker timed out after {timeout_s:.0f} s") from exc
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        raise TinyModelError(f"tiny model worker exited {result.returncode}: {lines[-1] if lines else 'no stderr'}")
    return json.loads(result.stdout.strip().splitlines()[-1])["files"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--architecture", choices=ARCHITECTURES, default="llama")
    args = parser.parse_args(argv)
    try:
        cache = os.environ.get(CACHE_ENV)
        files = (cached_build(Path(cache), args.out, args.seed, args.architecture) if cache
                 else build(args.out, args.seed, args.architecture))
    except TinyModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"out": str(args.out), "files": files}))
    return 0


if __name__ == "__main__":
    # One thread each: the machine is shared, and single-threaded training keeps
    # tokenizer merges and weights independent of scheduling.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
