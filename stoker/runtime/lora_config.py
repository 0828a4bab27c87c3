"""A LoRA adapter's adapter_config.json (PEFT's format), read and checked against its base; no torch.

What stoker serves is PEFT's plain LoRA on linear layers: y = W x + s · B(A(x)), s = lora_alpha / r, or
lora_alpha / √r with rsLoRA. What would change that computation and is not implemented is refused in one line
(DoRA, trained biases, fan-in-fan-out weights, per-module rank or alpha patterns, extra saved modules, layer
subsets), never served as if it were plain LoRA. Used by `stoker plan` / the fetch (stoker.adapters) and by the
reference runtime (lora.py), so the rules are one.

Imports are relative only (the package is copied next to a Triton model.py as `stoker_runtime`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The linear layers of each architecture's decoder that a LoRA adapter may target, by transformers' names.
LINEAR_MODULES = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "mistral": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen2": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}
# PEFT's key prefix in adapter_model.safetensors before the base model's own module path.
KEY_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter stoker cannot serve, or one that does not fit its base: one line naming the cause."""


@dataclass(frozen=True)
class AdapterConfig:
    r: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # the module names (last path part) the adapter targets
    base_model: str | None

    @property
    def scaling(self) -> float:
        """PEFT's scale of B(A(x))."""
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


def parse_config(raw: dict[str, Any], where: str) -> AdapterConfig:
    """adapter_config.json's fields, refusing what plain LoRA on linear layers is not."""
    if str(raw.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {raw.get('peft_type')!r}: only LoRA adapters are served")
    refused = [(raw.get("use_dora"), "use_dora (DoRA)"), (raw.get("bias", "none") != "none", f"bias {raw.get('bias')!r}"),
               (raw.get("fan_in_fan_out"), "fan_in_fan_out"), (raw.get("rank_pattern"), "rank_pattern"),
               (raw.get("alpha_pattern"), "alpha_pattern"), (raw.get("modules_to_save"), "modules_to_save"),
               (raw.get("layers_to_transform") is not None, "layers_to_transform"),
               (raw.get("trainable_token_indices"), "trainable_token_indices")]
    found = [name for on, name in refused if on]
    if found:
        raise AdapterError(f"{where}: {', '.join(found)} is not served (plain LoRA on linear layers only)")
    r = raw.get("r")
    if not isinstance(r, int) or r < 1:
        raise AdapterError(f"{where}: r {r!r} is not a positive integer")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        raise AdapterError(f"{where}: target_modules as a regular expression ({targets!r}) is not served: "
                           "list the module names")
    if not targets:
        raise AdapterError(f"{where}: target_modules is empty")
    names = tuple(sorted({str(t).rsplit(".", 1)[-1] for t in targets}))
    return AdapterConfig(r=r, alpha=float(raw.get("lora_alpha", 8)), use_rslora=bool(raw.get("use_rslora", False)),
                         target_modules=names, base_model=raw.get("base_model_name_or_path"))


def read_config(folder: Path, where: str | None = None) -> AdapterConfig:
    path = folder / CONFIG_FILE
    where = where or str(folder)
    try:
        return parse_config(json.loads(path.read_text()), where)
    except FileNotFoundError:
        raise AdapterError(f"{where}: no {CONFIG_FILE}") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{where}: {CONFIG_FILE} is not JSON ({exc.msg})") from None


def check_against_base(cfg: AdapterConfig, base_config: dict[str, Any], max_rank: int, where: str) -> None:
    """Target modules the base's architecture has, and a rank within ``max_rank`` (the spec's lora.max_rank)."""
    model_type = str(base_config.get("model_type", ""))
    linear = LINEAR_MODULES.get(model_type)
    if linear is None:
        raise AdapterError(f"{where}: adapters are served on {', '.join(sorted(LINEAR_MODULES))} models, not "
                           f"{model_type or 'this'} ({base_config.get('architectures')})")
    unknown = [m for m in cfg.target_modules if m not in linear]
    if unknown:
        raise AdapterError(f"{where}: target module(s) {', '.join(unknown)} are not linear layers of a {model_type} "
                           f"decoder ({', '.join(linear)})")
    if cfg.r > max_rank:
        raise AdapterError(f"{where}: rank {cfg.r} is above lora.max_rank {max_rank}")


def module_of(key: str) -> tuple[str, str] | None:
    """(module path in the base model, "A" or "B") for a PEFT tensor name; None for anything else."""
    m = _KEY.match(key)
    return (m["module"], m["ab"]) if m else None


def expected_shapes(base_config: dict[str, Any], module: str) -> tuple[int, int] | None:
    """(in, out) features of a decoder linear layer named ``module`` in the base, from its config; None: unknown."""
    h = base_config.get("hidden_size")
    inter = base_config.get("intermediate_size")
    heads = base_config.get("num_attention_heads")
    kv = base_config.get("num_key_value_heads") or heads
    head_dim = base_config.get("head_dim") or (h // heads if h and heads else None)
    if not (h and inter and heads and head_dim):
        return None
    shapes = {"q_proj": (h, heads * head_dim), "k_proj": (h, kv * head_dim), "v_proj": (h, kv * head_dim),
              "o_proj": (heads * head_dim, h), "gate_proj": (h, inter), "up_proj": (h, inter),
              "down_proj": (inter, h), "qkv_proj": (h, (heads + 2 * kv) * head_dim),
              "gate_up_proj": (h, 2 * inter)}
    return shapes.get(module.rsplit(".", 1)[-1])


def check_shapes(shapes: dict[str, tuple[int, ...]], cfg: AdapterConfig, base_config: dict[str, Any],
                 where: str) -> int:
    """Every A is [r, in] and every B [out, r] of the base's layer; returns how many layers the adapter changes."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        found = module_of(key)
        if found is None:
            raise AdapterError(f"{where}: tensor {key} is not a LoRA A or B weight")
        pairs.setdefault(found[0], {})[found[1]] = tuple(shape)
    if not pairs:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    layers = int(base_config.get("num_hidden_layers") or 0)
    linear = LINEAR_MODULES.get(str(base_config.get("model_type", "")), ())
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: {module} has lora_{'B' if 'A' in ab else 'A'} missing")
        # Every tensor is checked, not only those of the modules the config names: the runtime wraps the layer a
        # tensor names, so a weight for lm_head or an embedding would otherwise be served unchecked.
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in cfg.target_modules:
            raise AdapterError(f"{where}: tensors for {module}, a module {CONFIG_FILE} does not target "
                               f"({', '.join(cfg.target_modules)})")
        if leaf not in linear:
            raise AdapterError(f"{where}: tensors for {module}, which is not a decoder linear layer stoker serves "
                               f"adapters on ({', '.join(linear) or 'none for this base'})")
        index = re.search(r"\.layers\.(\d+)\.", f".{module}.")
        if not index:
            raise AdapterError(f"{where}: tensors for {module}, which is outside the decoder's layers")
        if layers and int(index[1]) >= layers:
            raise AdapterError(f"{where}: {module}: layer {index[1]} but the base has {layers} layers")
        want = expected_shapes(base_config, module)
        if want is None:
            raise AdapterError(f"{where}: the base's config gives no sizes to check {module} against (hidden_size, "
                               "intermediate_size, num_attention_heads)")
        if len(ab["A"]) != 2 or len(ab["B"]) != 2:
            raise AdapterError(f"{where}: {module}: lora_A {list(ab['A'])} and lora_B {list(ab['B'])} must be "
                               "matrices")
        (r_a, n_in), (n_out, r_b) = ab["A"], ab["B"]
        if r_a != cfg.r or r_b != cfg.r:
            raise AdapterError(f"{where}: {module}: rank {r_a}/{r_b} in the weights, {cfg.r} in {CONFIG_FILE}")
        if (n_in, n_out) != want:
            raise AdapterError(f"{where}: {module} maps {n_in} -> {n_out} features but the base's maps "
                               f"{want[0]} -> {want[1]}: an adapter made for another base")
    return len(pairs)
