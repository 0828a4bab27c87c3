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
any GPU.

Serving (`--part serving`): on the demo (its spec, its stack: the olah Hub mirror, moto S3, Docker, the CPU Triton
image), a cold `stoker run`, then rounds of: a new commit of the demo's adapter repo (a new seed), `stoker run`; a new
commit of the base repo (a new seed, the same shapes), `stoker run`. Each is timed from the commit to the moment
traffic moves to the new build at the stable address (the switch; Prefect's start included), and to the command's
end (after the switch: the watch window, then the old backend's retirement). The manifest's steps say which heavy
steps ran.

    .venv/bin/python benchmarks/lora.py --part serving   # merged into --out's JSON; the other parts are kept
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


HEAVY = ("fetch", "quantize", "build", "adapters", "package", "upload", "deploy", "switch")


def serving(tmp: Path, rounds: int) -> dict:
    """A new adapter commit vs a new base commit, each until it serves, on the demo's spec and stack."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    os.environ.update({"STOKER_HOME": str(tmp / "stack-home"), "STOKER_DEMO_HUB_PORT": "18390",
                       "STOKER_DEMO_S3_PORT": "19390"})
    import uuid

    from operate_helpers import free_base_port
    from stoker_runs import cleanup, manifest_of, stoker, write_spec

    from stoker.demo import DEMO_ADAPTER_REPO, DEMO_REPO, demo_spec, start_stack, state_dir
    from stoker.orchestration.child import run_module
    from stoker.stack.hub_mirror import publish_model, repos_dir

    hub, s3_url = start_stack(log=lambda _l: None)
    repos = repos_dir(state_dir())
    name, port = f"lora-{uuid.uuid4().hex[:4]}", free_base_port()
    path = write_spec(demo_spec(hub, s3_url).model_dump(mode="json", exclude_none=True), tmp / "spec.yaml",
                      storage__bucket=f"lora-{uuid.uuid4().hex[:8]}", deploy__name=name,
                      deploy__ports={"http": port, "grpc": port + 1, "metrics": port + 2})
    env = {**os.environ, "STOKER_HOME": str(tmp / "home"), "PREFECT_HOME": str(tmp / "prefect"),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}

    def run(label: str, commit: str | None) -> dict:
        since = time.time()
        wall, r = stoker(["run", str(path)], env)
        m = manifest_of(r, tmp / "home", since)
        steps = m["steps"]
        served = steps["adapters"]["detail"]["adapters"]["demo-lora"]["sha"] if "adapters" in steps else None
        switch = steps.get("switch", {})
        # Traffic moves to the new build at the switch (its switch_s into the step); the step then watches it for
        # deploy.watch_s before the old backend retires, and the command ends after that. The time before the flow
        # (the process, Prefect's start) is taken as wall - flow wall: at most that, as some of it follows the flow.
        to_traffic = (wall - m["wall_s"] + switch["started_s"] + switch["detail"]["switch_s"]
                      if switch.get("detail", {}).get("switched") else None)
        row = {"what": label, "status": m["status"], "commit_to_command_end_s": round(wall, 1),
               "commit_to_traffic_s": round(to_traffic, 1) if to_traffic is not None else None,
               "watch_s": switch.get("detail", {}).get("watch_s"), "flow_wall_s": m.get("wall_s"), "ran": [s for s in HEAVY if s in steps and not steps[s]["cache_hit"]],
               "cache_hits": [s for s in HEAVY if s in steps and steps[s]["cache_hit"]],
               "step_s": {k: v["duration_s"] for k, v in steps.items()}, "adapter_sha_served": served,
               "model_sha_served": m["model"]["sha"]}
        if label == "adapter commit":
            row["new_commit_served"] = served == commit
        elif label == "base commit":
            row["new_commit_served"] = m["model"]["sha"] == commit
        print(label, row["status"], row["commit_to_command_end_s"], row["commit_to_traffic_s"], "ran", row["ran"],
              flush=True)
        if m["status"] != "completed":
            raise SystemExit(f"{label}: {m.get('error')}")
        return row

    def publish(module: str, repo: str, seed: int, extra: list[str]) -> str:
        out = tmp / f"{repo.split('/')[-1]}-{seed}"
        run_module(module, ["--out", str(out), "--seed", str(seed), *extra], lambda _l: None)
        return publish_model(repos, repo, out, f"benchmark: seed {seed}")

    runs = [run("cold", None)]
    try:
        for i in range(rounds):
            sha = publish("stoker.workers.tinyadapter", DEMO_ADAPTER_REPO, 100 + i,
                          ["--base", str(repos / "models" / DEMO_REPO), "--repo-id", DEMO_REPO])
            runs.append(run("adapter commit", sha))
            sha = publish("stoker.workers.tinymodel", DEMO_REPO, 100 + i, [])
            runs.append(run("base commit", sha))
    finally:
        cleanup([name])
    out = {"spec": "stoker/demo.yaml (fp8, the demo-lora adapter, its default 30 s watch) on the demo's stack, its "
                   "own ports and bucket", "rounds": rounds, "runs": runs}
    for field in ("commit_to_traffic_s", "commit_to_command_end_s"):
        adapter = statistics.median(r[field] for r in runs if r["what"] == "adapter commit")
        base = statistics.median(r[field] for r in runs if r["what"] == "base commit")
        out[f"{field}_median"] = {"adapter_commit": adapter, "base_commit": base,
                                  "adapter_over_base": round(adapter / base, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lora.json")
    parser.add_argument("--part", choices=("all", "exactness", "throughput", "serving"), default="all",
                        help="measure one part, merged into --out's JSON (the others are kept)")
    parser.add_argument("--rounds", type=int, default=2, help="serving: adapter-commit/base-commit pairs")
    args = parser.parse_args()
    t0 = time.time()
    parts = {"exactness": exactness, "throughput": throughput, "serving": lambda t: serving(t, args.rounds)}
    result = json.loads(args.out.read_text()) if args.part != "all" and args.out.is_file() else {}
    result["what"] = __doc__.split("\n\n")[0].replace("\n", " ")
    machine = {"cpus": os.cpu_count(), "python": platform.python_version()}
    with tempfile.TemporaryDirectory(prefix="stoker-lora-") as tmp:
        for part, measure in parts.items():
            if args.part in ("all", part):
                t = time.time()
                result[part] = measure(Path(tmp) / part)
                result[part]["machine"] = machine | {"load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
                                                     "seconds": round(time.time() - t, 1)}
    result.pop("machine", None)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
