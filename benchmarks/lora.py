"""LoRA adapters on the reference runtime, in process: exactness against transformers + PEFT per architecture, and
output tok/s with 0, 1 and 4 adapters mixed under concurrent load against the base alone; writes JSON.

    .venv/bin/python benchmarks/lora.py --out benchmarks/results/lora.json

Exactness: for each architecture the reference path serves (Llama, Qwen2, Mistral, Phi-3), a tiny seeded base
(stoker.workers.tinymodel) and two adapters (stoker.workers.tinyadapter: r 4 on q/v, r 8 on every linear layer);
each prompt's greedy ids from stoker's runtime — the adapter's sequence alone, and again with the base's and the
other adapter's sequences in the same batched passes — against transformers + PEFT (PeftModel.from_pretrained,
`generate(do_sample=False)`) on the same unquantized base. Counts are prompts × tokens.

Throughput: the demo's tiny Llama with 4 adapters, stoker's in-flight batcher (max batch 8, 2 torch threads),
concurrency 4, 32 output tokens per request (the end id held back), the same prompts in every mode: every request
on the base; every request on one adapter; the requests spread over 4 adapters; each mode's tok/s and its ratio to
the base's. The scheduler alone (no Triton, no network): what adapters cost the model's passes. Not measured here:
the time from a new adapter commit to serving (tests/integration/test_lora_served.py runs that path; its
manifest's step times say it), and any GPU.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ARCHS = ("llama", "qwen2", "mistral", "phi3")
PROMPTS = [[1, 17, 300, 5, 999, 42, 7, 1500, 64, 3], [1, 5, 9, 27, 81, 243, 729, 100], [1, 2000, 1000, 500, 250],
           [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
TOKENS = 16


def exactness(tmp: Path) -> dict:
    import peft
    import torch
    import transformers

    from stoker.runtime.batch import Batcher
    from stoker.runtime.generate import generate
    from stoker.runtime.model import load_model
    from stoker.workers import build_reference
    from stoker.workers.tinyadapter import make
    from stoker.workers.tinymodel import make_tiny_model

    out = {}
    for arch in ARCHS:
        base_dir, artifact = tmp / arch / "base", tmp / arch / "artifact"
        make_tiny_model(base_dir, seed=0, architecture=arch)
        build_reference.build(base_dir, artifact)
        config = json.loads((base_dir / "config.json").read_text())
        from stoker.runtime.lora_config import LINEAR_MODULES

        adapters = {"qv": make(base_dir, tmp / arch / "qv", 1, 4, list(LINEAR_MODULES[arch][:2]) if arch == "phi3"
                               else ["q_proj", "v_proj"], "tiny"),
                    "all": make(base_dir, tmp / arch / "all", 2, 8, list(LINEAR_MODULES[arch]), "tiny")}
        folders = {name: tmp / arch / name for name in adapters}
        model = load_model(artifact, num_threads=2, adapters=folders)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        row = {"model_type": config["model_type"], "prompts": len(PROMPTS), "tokens_per_prompt": TOKENS}
        names = [None, "qv", "all", "qv"]
        batcher = Batcher(model, max_batch=8).start()
        try:
            mixed = [list(s) for s in [batcher.submit(p, TOKENS, -1, adapter=n, min_new_tokens=TOKENS)
                                       for p, n in zip(PROMPTS, names)]]
        finally:
            batcher.stop()
        for name, folder in folders.items():
            ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(folder)).eval()
            matched = same_alone = prompts_exact = changed = 0
            for p in PROMPTS:
                ids = torch.tensor([p])
                with torch.no_grad():
                    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS,
                                        min_new_tokens=TOKENS, do_sample=False)[0, len(p):].tolist()
                    plain = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS,
                                          min_new_tokens=TOKENS, do_sample=False)[0, len(p):].tolist()
                got = list(generate(model, p, TOKENS, -1, adapter=name, min_new_tokens=TOKENS))
                matched += sum(a == b for a, b in zip(got, want))
                prompts_exact += got == want
                changed += want != plain
            for p, n, got in zip(PROMPTS, names, mixed):
                if n == name:
                    ids = torch.tensor([p])
                    with torch.no_grad():
                        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=TOKENS,
                                            min_new_tokens=TOKENS, do_sample=False)[0, len(p):].tolist()
                    same_alone += got == want
            row[name] = {"tokens_equal": matched, "tokens": len(PROMPTS) * TOKENS, "prompts_exact": prompts_exact,
                         "prompts_where_the_adapter_changes_the_answer": changed,
                         "mixed_batch_prompts_exact": same_alone, "mixed_batch_prompts": names.count(name)}
        out[arch] = row
        print(arch, json.dumps(row), flush=True)
    return out


def throughput(tmp: Path, rounds: int = 3) -> dict:
    from stoker.runtime.batch import Batcher
    from stoker.runtime.model import load_model
    from stoker.workers import build_reference
    from stoker.workers.tinyadapter import make
    from stoker.workers.tinymodel import make_tiny_model

    base_dir, artifact = tmp / "demo" / "base", tmp / "demo" / "artifact"
    make_tiny_model(base_dir, seed=0)
    build_reference.build(base_dir, artifact)
    folders = {f"a{i}": tmp / "demo" / f"a{i}" for i in range(4)}
    for i, (name, folder) in enumerate(folders.items()):
        make(base_dir, folder, 10 + i, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], "tiny")
    model = load_model(artifact, num_threads=2, adapters=folders)
    concurrency, n_requests, tokens = 4, 16, 32
    prompts = [[1, *range(10 + i, 42 + i)] for i in range(n_requests)]
    modes = {"base": [None] * n_requests, "one_adapter": ["a0"] * n_requests,
             "four_adapters_mixed": [f"a{i % 4}" for i in range(n_requests)]}
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):  # modes interleaved, so a slow moment of the host falls on all of them alike
        for mode, names in modes.items():
            batcher = Batcher(model, max_batch=8).start()
            try:
                t0 = time.perf_counter()
                done = 0
                for start in range(0, n_requests, concurrency):
                    streams = [batcher.submit(p, tokens, -1, adapter=n, min_new_tokens=tokens)
                               for p, n in zip(prompts[start:start + concurrency], names[start:start + concurrency])]
                    done += sum(len(list(s)) for s in streams)
                rates[mode].append(done / (time.perf_counter() - t0))
            finally:
                batcher.stop()
    medians = {m: round(statistics.median(r), 1) for m, r in rates.items()}
    return {"model": "demo tiny Llama (hidden 256, 4 layers), 4 adapters of r 8 on q/k/v/o",
            "concurrency": concurrency, "requests_per_mode": n_requests, "output_tokens": tokens, "rounds": rounds,
            "output_tok_s_median": medians, "output_tok_s_rounds": {m: [round(x, 1) for x in r] for m, r in rates.items()},
            "ratio_to_base": {m: round(v / medians["base"], 3) for m, v in medians.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lora.json")
    args = parser.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="stoker-lora-") as tmp:
        result = {"what": __doc__.split("\n\n")[0].replace("\n", " "),
                  "exactness": exactness(Path(tmp)), "throughput": throughput(Path(tmp))}
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
                         "seconds": round(time.time() - t0, 1)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["throughput"]["ratio_to_base"]))


if __name__ == "__main__":
    main()
