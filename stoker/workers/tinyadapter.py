"""Make a tiny, seeded LoRA adapter for a base checkpoint, in PEFT's file format, fully offline (no peft needed).

Run as a child process (it imports torch):

    python -m stoker.workers.tinyadapter --base DIR --out DIR --seed 1 [--r 4] [--targets q_proj,v_proj]

Writes adapter_config.json (peft_type LORA, r, lora_alpha 2r, the target modules) and adapter_model.safetensors with
A [r, in] and B [out, r] for each target module of each decoder layer, under PEFT's tensor names
(base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_<A|B>.weight). B is not PEFT's zero init: the
adapter must change the answers to be worth serving. The same seed gives byte-identical files. Prints one JSON line
{"out": DIR, "files": {name: sha256}}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stoker.runtime.lora_config import CONFIG_FILE, LINEAR_MODULES, WEIGHTS_FILE, expected_shapes
from stoker.storage.digest import file_sha256

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")


def make(base: Path, out: Path, seed: int, r: int, targets: list[str], repo_id: str) -> dict[str, str]:
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    allowed = LINEAR_MODULES[config["model_type"]]
    wrong = [t for t in targets if t not in allowed]
    if wrong:
        raise SystemExit(f"tinyadapter: {', '.join(wrong)} not among {', '.join(allowed)}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            n_in, n_out = expected_shapes(config, module)
            path = f"base_model.model.model.layers.{layer}.{'self_attn' if module in ATTENTION else 'mlp'}.{module}"
            # Scaled so that B(A(x)) · alpha/r moves the tiny model's logits enough to change its greedy answers.
            tensors[f"{path}.lora_A.weight"] = torch.randn(r, n_in, generator=generator) / n_in ** 0.5
            tensors[f"{path}.lora_B.weight"] = torch.randn(n_out, r, generator=generator) * 0.5
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    adapter_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
                      "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none", "use_rslora": False,
                      "fan_in_fan_out": False, "base_model_name_or_path": repo_id, "inference_mode": True}
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return {p.name: file_sha256(p) for p in sorted(out.iterdir())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the base checkpoint's folder (its config.json)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--r", type=int, default=4)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--repo-id", default="stoker/tiny-llama", help="the base's repo id, for adapter_config.json")
    args = parser.parse_args()
    files = make(args.base, args.out, args.seed, args.r, args.targets.split(","), args.repo_id)
    print(json.dumps({"out": str(args.out), "files": files}))


if __name__ == "__main__":
    main()
