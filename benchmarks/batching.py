"""In-flight batching of the reference `tensorrt_llm` model: before (one request at a time) and after, side by
side in one run, on a real tritonserver; writes JSON.

Two models, both built here as the demo builds its model (stoker.workers.tinymodel → build_reference →
stoker.triton.repository.assemble, the full ensemble with the spec's defaults, 2 torch threads): the demo's tiny
Llama (hidden 256, 4 layers) and a larger tiny Llama (hidden 512, 8 layers). Each is served by two local
tritonservers at once (nvidia-pytriton wheel), measured in turn at each level: "before" with `max_concurrent_requests` 1 in the model's config.pbtxt (the
old path: requests one after another), "after" with the default (the config's max_batch_size, 8: in-flight
batching). stoker's own benchmark client (stoker.bench, gRPC stream_infer on the ensemble) runs concurrency 1, 2,
4, 8, the same prompts (demo workload: 32 input tokens, 32 output tokens with min_tokens so every request runs to
32) and the same number of requests at every level; it reports output tok/s, TTFT and ITL (p50/p99) per level,
and each level's ratio to concurrency 1 of the same mode. Client and server share this host's cores, as in the
demo. Goal (issue 31): tok/s at c=4 >= 2x c=1, TTFT p50 at c=4 <= 3x c=1.

    python benchmarks/batching.py --out benchmarks/results/batching.json
    PYTHONPATH=. taskset -c 0,1 python benchmarks/batching.py --in-process   # the scheduler alone, no Triton

The committed benchmarks/results/batching.json is an --in-process run (its `machine` and `note` say where and why).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

MODELS = {  # name -> (hidden, intermediate, layers)
    "demo_tiny_llama": (256, 512, 4),
    "larger_tiny_llama": (512, 1024, 8),
}
MODES = {"before": "1", "after": None}  # max_concurrent_requests in config.pbtxt; None: the default
CONCURRENCY = (1, 2, 4, 8)
LOAD_AT_START: list[float] = []  # this host's load average when the run began (other work shares the cores)


def build_artifact(root: Path, hidden: int, intermediate: int, layers: int) -> Path:
    """The demo's tiny model at another size, as a reference artifact."""
    from stoker.workers import build_reference, tinymodel

    saved = tinymodel.HIDDEN_SIZE, tinymodel.INTERMEDIATE_SIZE, tinymodel.NUM_LAYERS
    tinymodel.HIDDEN_SIZE, tinymodel.INTERMEDIATE_SIZE, tinymodel.NUM_LAYERS = hidden, intermediate, layers
    try:
        tinymodel.build(root / "checkpoint", seed=0)
    finally:
        tinymodel.HIDDEN_SIZE, tinymodel.INTERMEDIATE_SIZE, tinymodel.NUM_LAYERS = saved
    build_reference.build(root / "checkpoint", root / "artifact")
    return root / "artifact"


def write_repo(artifact: Path, repo: Path, max_concurrent: str | None) -> None:
    from stoker.spec.schema import Triton
    from stoker.triton.repository import assemble, settings_for

    assemble(artifact, repo, settings_for(Triton()))  # the spec's defaults: max_batch_size 8, 2 threads
    (repo / "ensemble" / "1").mkdir(parents=True, exist_ok=True)
    if max_concurrent is not None:
        config = repo / "tensorrt_llm" / "config.pbtxt"
        config.write_text(config.read_text() + f'parameters {{ key: "max_concurrent_requests" '
                                               f'value {{ string_value: "{max_concurrent}" }} }}\n')


def _stats(s) -> dict | None:
    return None if s is None else {"p50": round(s.p50, 2), "p99": round(s.p99, 2), "mean": round(s.mean, 2)}


def _row(level) -> dict:
    return {"concurrency": level.concurrency, "requests": level.requests, "completed": level.completed,
            "errors": level.errors, "short_outputs": level.short_outputs,
            "output_tokens": round(level.output_tokens.mean * level.completed) if level.output_tokens else 0,
            "output_tok_per_s": round(level.output_tokens_per_s, 1), "ttft_ms": _stats(level.ttft_ms),
            "itl_ms": _stats(level.itl_ms), "duration_s": round(level.duration_s, 2),
            "client_saturated": level.client_saturated}


def measure(repos: dict[str, Path], logs: Path, requests: int, tokens: int, input_tokens: int) -> dict[str, list[dict]]:
    """Both modes served at once; each concurrency level runs before then after, so load from elsewhere on the host
    falls on both alike."""
    from contextlib import ExitStack

    from stoker.bench.client import BenchConfig, progress_line, run_sweep
    from stoker.bench.load import Level
    from stoker.bench.workload import make_prompts
    from stoker.stack import local_triton

    prompts = make_prompts(requests, input_tokens, seed=0)
    rows: dict[str, list[dict]] = {mode: [] for mode in repos}
    with ExitStack() as stack:
        servers = {mode: stack.enter_context(local_triton.start(repo, local_triton.pick_free_ports(),
                                                                 logs / f"{repo.name}.log"))
                   for mode, repo in repos.items()}
        for c in CONCURRENCY:
            for mode, server in servers.items():
                config = BenchConfig(url=server.grpc_url, model="ensemble", levels=[Level(concurrency=c)],
                                     max_tokens=tokens, requests_per_level=requests, warmup_requests=2,
                                     timeout_s=300, ignore_eos=True)
                level = run_sweep(config, prompts).levels[0]
                print(f"  {mode}: {progress_line(level)}", file=sys.stderr)
                rows[mode].append(_row(level))
    for mode_rows in rows.values():
        base = mode_rows[0]
        for row in mode_rows:
            row["tok_per_s_over_c1"] = round(row["output_tok_per_s"] / base["output_tok_per_s"], 2)
            row["ttft_p50_over_c1"] = round(row["ttft_ms"]["p50"] / base["ttft_ms"]["p50"], 2)
    return rows



def in_process(args) -> dict:
    """The scheduler alone (stoker.runtime.batch.Batcher) in this process: no Triton, no client stack. Client threads
    (one per concurrency slot) submit random-id prompts and time each token as the scheduler hands it over."""
    import random
    import threading

    import torch
    import transformers

    from stoker.runtime.batch import Batcher
    from stoker.runtime.model import load_model

    def artifact(root: Path, hidden: int, intermediate: int, layers: int) -> Path:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=intermediate,
                                          num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                                          max_position_embeddings=2048, tie_word_embeddings=False)
        transformers.LlamaForCausalLM(config).float().eval().save_pretrained(root)
        (root / "stoker_runtime.json").write_text(json.dumps({
            "format": "stoker-reference/1", "dtype": "float32", "end_id": 2, "pad_id": 3,
            "quantization": {"format": "none", "kv_cache_dtype": None, "kv_scales": {}}}))
        return root

    def level(model, limit: int, c: int) -> dict:
        rng = random.Random(0)
        prompts = [[rng.randrange(4, 2048) for _ in range(args.input_tokens)] for _ in range(args.requests)]
        batcher = Batcher(model, max_batch=limit).start()
        todo = iter(range(args.requests))
        lock = threading.Lock()
        ttft, itl, e2e, tokens = [], [], [], []

        def client() -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                sent = time.perf_counter()
                stamps = [time.perf_counter() for _ in batcher.submit(prompts[i], args.tokens, -1,
                                                                        min_new_tokens=args.tokens)]
                with lock:
                    ttft.append(stamps[0] - sent)
                    itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
                    e2e.append(stamps[-1] - sent)
                    tokens.append(len(stamps))

        for warm in prompts[:2]:
            list(batcher.submit(warm, 4, -1))
        t0 = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        batcher.stop()

        def pct(values: list[float], q: float) -> float:
            ordered = sorted(values)
            return round(1000 * ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))], 2)

        return {"concurrency": c, "requests": len(tokens), "errors": args.requests - len(tokens),
                "output_tokens": sum(tokens), "output_tok_per_s": round(sum(tokens) / wall, 1),
                "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)}, "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99)},
                "duration_s": round(wall, 2), "decode_steps": batcher.steps,
                "mean_sequences_per_step": round(batcher.stepped_sequences / max(1, batcher.steps), 2)}

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="stoker-batching-") as tmp:
        for name in args.models.split(","):
            hidden, intermediate, layers = MODELS[name]
            model = load_model(artifact(Path(tmp) / name, hidden, intermediate, layers), num_threads=2)
            rows: dict[str, list[dict]] = {"before": [], "after": []}
            for c in CONCURRENCY:
                for mode, limit in (("before", 1), ("after", 8)):
                    rows[mode].append(level(model, limit, c))
                    r = rows[mode][-1]
                    print(f"  {name} {mode} c={c}: {r['output_tok_per_s']} tok/s, TTFT p50 {r['ttft_ms']['p50']} ms, "
                          f"ITL p50 {r['itl_ms']['p50']} ms", file=sys.stderr)
            for mode_rows in rows.values():
                for row in mode_rows:
                    row["tok_per_s_over_c1"] = round(row["output_tok_per_s"] / mode_rows[0]["output_tok_per_s"], 2)
                    row["ttft_p50_over_c1"] = round(row["ttft_ms"]["p50"] / mode_rows[0]["ttft_ms"]["p50"], 2)
            results[name] = {"shape": {"hidden": hidden, "intermediate": intermediate, "layers": layers}, **rows}
            summarize_goal(results[name])
    return results


def summarize_goal(entry: dict) -> None:
    before, after = entry["before"], entry["after"]
    at4 = next(r for r in after if r["concurrency"] == 4)
    entry["after_over_before_tok_per_s"] = {
        str(a["concurrency"]): round(a["output_tok_per_s"] / b["output_tok_per_s"], 2) for a, b in zip(after, before)}
    entry["goal"] = {"tok_per_s_c4_over_c1": at4["tok_per_s_over_c1"], "wanted_at_least": 2.0,
                     "ttft_p50_c4_over_c1": at4["ttft_p50_over_c1"], "wanted_at_most": 3.0,
                     "met": at4["tok_per_s_over_c1"] >= 2.0 and at4["ttft_p50_over_c1"] <= 3.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/batching.json"))
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request (demo: 32)")
    ap.add_argument("--input-tokens", type=int, default=32, help="prompt words per request (demo: 32)")
    ap.add_argument("--models", default=",".join(MODELS), help="which of " + ", ".join(MODELS))
    ap.add_argument("--in-process", action="store_true",
                    help="measure the scheduler alone in this process (no Triton, no client stack); "
                         "writes the same figures under harness 'in_process'")
    args = ap.parse_args()
    if args.in_process:
        started = time.time()
        LOAD_AT_START[:] = os.getloadavg()
        results = in_process(args)
        out = {"harness": "in_process",
               "what": "stoker.runtime.batch.Batcher alone in one Python process: client threads submit random-id "
                       "prompts, tokens timed as the scheduler hands them over; before = max_batch 1, after = 8. "
                       "No Triton, no gRPC, no tokenizer.",
               "workload": {"input_tokens": args.input_tokens, "output_tokens": args.tokens,
                            "requests_per_level": args.requests, "warmup_requests_per_level": 2,
                            "concurrency": list(CONCURRENCY), "torch_threads": 2},
               "models": results,
               "counts": {"requests": sum(r["requests"] for m in results.values() for mode in MODES for r in m[mode]),
                          "errors": sum(r["errors"] for m in results.values() for mode in MODES for r in m[mode]),
                          "output_tokens": sum(r["output_tokens"] for m in results.values() for mode in MODES
                                               for r in m[mode])},
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "torch_threads": 2, "load_avg_at_start": LOAD_AT_START, "load_avg_at_end": os.getloadavg()},
               "wall_s": round(time.time() - started, 1)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2) + "\n")
        return
    # A SIGTERM (timeout) unwinds the `with` blocks, so no tritonserver outlives the run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))

    results: dict[str, dict] = {}
    started = time.time()
    LOAD_AT_START[:] = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="stoker-batching-") as tmp:
        for name in args.models.split(","):
            hidden, intermediate, layers = MODELS[name]
            artifact = build_artifact(Path(tmp) / name, hidden, intermediate, layers)
            results[name] = {"shape": {"hidden": hidden, "intermediate": intermediate, "layers": layers}}
            repos = {}
            for mode, limit in MODES.items():
                repos[mode] = Path(tmp) / f"{name}-{mode}"
                write_repo(artifact, repos[mode], limit)
            print(f"{name}: before = max_concurrent_requests 1, after = default (max_batch_size 8)", file=sys.stderr)
            results[name].update(measure(repos, Path(tmp), args.requests, args.tokens, args.input_tokens))
            before, after = results[name]["before"], results[name]["after"]
            at4 = next(r for r in after if r["concurrency"] == 4)
            results[name]["after_over_before_tok_per_s"] = {
                str(a["concurrency"]): round(a["output_tok_per_s"] / b["output_tok_per_s"], 2) for a, b in zip(after, before)}
            results[name]["goal"] = {"tok_per_s_c4_over_c1": at4["tok_per_s_over_c1"], "wanted_at_least": 2.0,
                                     "ttft_p50_c4_over_c1": at4["ttft_p50_over_c1"], "wanted_at_most": 3.0,
                                     "met": at4["tok_per_s_over_c1"] >= 2.0 and at4["ttft_p50_over_c1"] <= 3.0}
            write(args, results, started)  # each model as it completes
    write(args, results, started)
    for name in results:
        g = results[name]["goal"]
        print(f"{name}: c=4 tok/s x{g['tok_per_s_c4_over_c1']} of c=1, TTFT p50 x{g['ttft_p50_c4_over_c1']} "
              f"(met: {g['met']})", file=sys.stderr)


def write(args, results: dict, started: float) -> None:
    counts = {"requests": sum(r["requests"] for m in results.values() for mode in MODES for r in m[mode]),
              "errors": sum(r["errors"] for m in results.values() for mode in MODES for r in m[mode]),
              "output_tokens": sum(r["output_tokens"] for m in results.values() for mode in MODES for r in m[mode])}
    out = {
        "what": "output tok/s, TTFT and ITL of the reference tensorrt_llm model at concurrency 1/2/4/8, one request at "
                "a time (before: max_concurrent_requests 1) vs in-flight batching (after: default, max_batch_size 8)",
        "server": "local tritonserver 2.51.0 (nvidia-pytriton 0.7.0), the stoker ensemble (preprocessing -> "
                  "tensorrt_llm -> postprocessing), spec defaults (1 model instance, 2 torch threads)",
        "client": "stoker.bench over gRPC stream_infer, same host",
        "workload": {"input_tokens": args.input_tokens, "output_tokens": args.tokens, "min_tokens": args.tokens,
                     "requests_per_level": args.requests, "warmup_requests_per_level": 2,
                     "concurrency": list(CONCURRENCY),
                     "order": "both modes served at once; at each concurrency, before then after"},
        "models": results,
        "counts": counts,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_at_start": LOAD_AT_START,
                    "load_avg_at_end": os.getloadavg()},
        "wall_s": round(time.time() - started, 1),
        "note": "one run on a shared 2-core host (client, tritonserver and its python stub share the cores); figures "
                "are noisy by several percent. No GPU involved.",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
