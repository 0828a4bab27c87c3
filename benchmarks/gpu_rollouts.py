"""The rollout `stoker plan` chooses (stoker/gpu/rollout.py) for the example GPU specs and for 1, 2 and 8 GPUs:
surge, shared (with its KV split) or reload (with its expected gap). Arithmetic on the plan's memory estimate, no
GPU: writes benchmarks/results/gpu_rollouts.json and prints the markdown table docs/targets.md carries.

    python3 benchmarks/gpu_rollouts.py [OUT.json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stoker.errors import PlanRefused  # noqa: E402
from stoker.gpu import facts as facts_mod  # noqa: E402
from stoker.gpu import matrix, rollout  # noqa: E402
from stoker.spec.load import parse_spec  # noqa: E402

# Meta-Llama-3-70B-Instruct's shapes: the large engine of the table (not in known_models.json: no spec serves it).
LLAMA70 = facts_mod.from_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                                 "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                                 "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
                                 "torch_dtype": "bfloat16", "eos_token_id": 128009}, source="known")
# 70B fp8 (+ fp8 KV), 8192-token sequences: the TP-2/4/8 cases, on the GPUs that run fp8 and hold it.
LARGE = [(gpu, tp, count) for gpu in ("h100-80gb", "h200") for tp, count in ((1, 1), (2, 2), (2, 8), (4, 8), (8, 8))]


def _row(name: str, spec, facts) -> dict:
    gpu = matrix.gpu_info(spec.gpus.type)
    row = {"spec": name, "gpu": gpu.name, "gpus": spec.gpus.count, "tp": spec.parallel.world_size,
           "format": spec.quantization.format, "kv_cache_dtype": spec.quantization.kv_cache_dtype,
           "max_seq_len": spec.build.max_seq_len or facts.context}
    b = rollout.backend_of(spec, facts)
    row["engine_gib_per_gpu"] = round(b.engine_bytes / rollout.GIB, 1)
    try:
        row |= rollout.plan_rollout(spec, facts).to_dict()
    except PlanRefused as err:
        row |= {"choice": "refused", "refusal": str(err)}
    return row


def rows() -> list[dict]:
    out = []
    llama8 = facts_mod.known("meta-llama/Meta-Llama-3-8B-Instruct")
    for path in sorted((ROOT / "deployments/specs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if data.get("target") not in ("tensorrt", "pytorch"):
            continue
        for count in (1, 2, 8):  # one backend per GPU (the specs' TP 1); the rest are spare
            data["gpus"] = {**data["gpus"], "count": count}
            out.append(_row(path.name, parse_spec(data, path.name), llama8))
    base = yaml.safe_load((ROOT / "deployments/specs/llama3-8b-fp8-h100-engine.yaml").read_text())
    for gpu, tp, count in LARGE:
        data = {**base, "model": {"repo_id": "meta-llama/Meta-Llama-3-70B-Instruct"},
                "gpus": {"type": gpu, "count": count}, "parallel": {"tensor": tp}}
        out.append(_row("Llama-3-70B fp8 (llama3-8b-fp8-h100-engine.yaml's settings)", parse_spec(data), LLAMA70))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| spec | GPU | GPUs | TP | engine GiB/GPU | rollout | KV tokens alone | KV tokens each | KV cost | gap |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["choice"] == "refused":
            lines.append(f"| `{r['spec']}` | {r['gpu']} | {r['gpus']} | {r['tp']} | {r['engine_gib_per_gpu']} | "
                         f"refused: {r['refusal']} | | | | |")
            continue
        name = f"`{r['spec']}`" if r["spec"].endswith(".yaml") else r["spec"]
        cost = f"−{r['kv_cost_pct']}%" if r["kv_cost_pct"] else "0"
        gap = f"~{r['gap_s']:.0f} s" if r["gap_s"] is not None else "none"
        lines.append(f"| {name} | {r['gpu'].removeprefix('NVIDIA ')} | {r['gpus']} | {r['tp']} | "
                     f"{r['engine_gib_per_gpu']} | {r['choice']} | {r['kv_tokens_alone']:,} | {r['kv_tokens']:,} | "
                     f"{cost} | {gap} |")
    return "\n".join(lines)


def main() -> None:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "benchmarks/results/gpu_rollouts.json"
    data = rows()
    dest.write_text(json.dumps({"about": "stoker plan's GPU rollout for the example specs and 1/2/8 GPUs "
                                         "(benchmarks/gpu_rollouts.py): estimates, no GPU ran",
                                "rows": data}, indent=1) + "\n")
    print(table(data))


if __name__ == "__main__":
    main()
