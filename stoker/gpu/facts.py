"""What the GPU rules need to know about a model: shape, context, dtype, special ids, gating.

Read from a local checkpoint, from the Hub (config files only, at the pinned sha),
or from known_models.json when the Hub cannot be reached. Pure arithmetic on top.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..triton.models.stop_words import collect

KNOWN_FILE = Path(__file__).resolve().parent / "known_models.json"


@dataclass(frozen=True)
class ModelFacts:
    source: str  # "local", "hub" or "known" — said in plan notes
    architecture: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int  # max_position_embeddings × rope factor
    dtype: str
    tied_embeddings: bool
    end_id: int | None
    pad_id: int | None
    gated: bool | None  # None: unknown
    stop_ids: tuple[int, ...] = ()  # the other eos ids: one-token stop words (triton_models/stop_words.py)
    model_type: str = "?"
    # What the reference runtime (a hand-written Llama) must know to refuse a model it would serve wrong.
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope_type: str = "default"

    @property
    def params(self) -> int:
        """Parameter count of a Llama-style decoder (attention + gated MLP + norms + embeddings)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        per_layer = attn + mlp + 2 * self.hidden
        embed = self.vocab * self.hidden
        return self.layers * per_layer + self.hidden + embed * (1 if self.tied_embeddings else 2)

    @property
    def embedding_params(self) -> int:
        """Embedding + lm_head: ModelOpt leaves these in 16-bit for every format."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)


def _first(v) -> int | None:
    if isinstance(v, list):
        return int(v[0]) if v else None
    return int(v) if isinstance(v, int) else None


def choose_end_id(config: dict, generation: dict, tokenizer_eos: int | None) -> int | None:
    """The id that ends a response: the tokenizer's eos (Llama 3 Instruct: <|eot_id|>), as TensorRT-LLM's
    LLM API takes it; every other eos id becomes a stop word (stop_words.collect)."""
    return collect(generation, config, tokenizer_eos).end_id


def _rope_type(config: dict) -> str:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return str(rope.get("rope_type") or rope.get("type") or "default") if isinstance(rope, dict) else "?"


def from_config(config: dict, generation: dict | None = None, tokenizer_eos: int | None = None,
                source: str = "local", gated: bool | None = None) -> ModelFacts:
    generation = generation or {}
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    rope = config.get("rope_scaling") or {}
    # linear/dynamic/yarn stretch the trained context; Llama 3.1's "llama3" rope does not (its
    # max_position_embeddings already is the real context).
    stretch = rope.get("rope_type", rope.get("type")) in ("linear", "dynamic", "yarn")
    factor = float(rope.get("factor", 1.0)) if stretch else 1.0
    end_id, stop_ids = collect(generation, config, tokenizer_eos)
    pad = _first(generation.get("pad_token_id", config.get("pad_token_id")))
    return ModelFacts(
        source=source, architecture=(config.get("architectures") or ["?"])[0], hidden=hidden,
        intermediate=int(config.get("intermediate_size", 4 * hidden)), layers=int(config["num_hidden_layers"]),
        heads=heads, kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or hidden // heads), vocab=int(config["vocab_size"]),
        context=int(int(config.get("max_position_embeddings", 2048)) * factor),
        dtype=str(config.get("torch_dtype") or config.get("dtype") or "float16"),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), end_id=end_id,
        pad_id=pad if pad is not None else end_id, gated=gated, stop_ids=stop_ids,
        model_type=str(config.get("model_type", "?")), attention_bias=bool(config.get("attention_bias")),
        mlp_bias=bool(config.get("mlp_bias")), hidden_act=str(config.get("hidden_act", "silu")),
        rope_type=_rope_type(config))


def tokenizer_eos_id(folder: Path) -> int | None:
    """The id of tokenizer_config.json's eos_token, looked up in tokenizer.json's vocabulary/added tokens."""
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
        tok = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    eos = tok_cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    for added in tok.get("added_tokens", []):
        if added.get("content") == eos:
            return int(added["id"])
    vocab = (tok.get("model") or {}).get("vocab") or {}
    return int(vocab[eos]) if isinstance(vocab, dict) and eos in vocab else None


def from_folder(folder: Path, source: str = "local", gated: bool | None = None) -> ModelFacts:
    config = json.loads((folder / "config.json").read_text())
    gen_file = folder / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    return from_config(config, generation, tokenizer_eos_id(folder), source, gated)


@lru_cache(maxsize=1)
def _known() -> dict:
    return json.loads(KNOWN_FILE.read_text())


def known(repo_id: str) -> ModelFacts | None:
    e = _known().get(repo_id)
    if e is None:
        return None
    return from_config(e["config"], e.get("generation_config"), e.get("tokenizer_eos_id"), "known", e.get("gated"))
