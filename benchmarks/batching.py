"""In-flight batching of the reference `tensorrt_llm` model: before (one request at a time) and after, side by
side in one run, on a real tritonserver; writes JSON.

Two models, both built here as the demo builds its model (stoker.workers.tinymodel → build_reference →
stoker.triton.repository.assemble, the full ensemble with the spec's defaults, 2 torch threads): the demo's tiny
Llama (hidden 256, 4 layers) and a larger tiny Llama (hidden 512, 8 layers). Each is served twice by a local
tritonserver (nvidia-pytriton wheel): "before" with `max_concurrent_requests` 1 in the model's config.pbtxt (the
old path: requests one after another), "after" with the default (the config's max_batch_size, 8: in-flight
batching). stoker's own benchmark client (stoker.bench, gRPC stream_infer on the ensemble) runs concurrency 1, 2,
4, 8, the same prompts (demo workload: 32 input tokens, 32 output tokens with min_tokens so every request runs to
32) and the same number of requests at every level; it reports output tok/s, TTFT and ITL (p50/p99) per level,
and each level's ratio to concurrency 1 of the same mode. Client and server share this host's cores, as in the
demo. Goal (issue 31): tok/s at c=4 >= 2x c=1, TTFT p50 at c=4 <= 3x c=1.

    python benchmarks/batching.py --out benchmarks/results/batching.json
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


def measure(repo: Path, log: Path, requests: int, tokens: int, input_tokens: int) -> list[dict]:
    from stoker.bench.client import BenchConfig, run_sweep
    from stoker.bench.load import Level
    from stoker.bench.workload import make_prompts
    from stoker.stack import local_triton

    with local_triton.start(repo, local_triton.pick_free_ports(), log) as server:
        config = BenchConfig(url=server.grpc_url, model="ensemble", levels=[Level(concurrency=c) for c in CONCURRENCY],
                             max_tokens=tokens, requests_per_level=requests, warmup_requests=4, timeout_s=300,
                             ignore_eos=True)
        result = run_sweep(config, make_prompts(requests, input_tokens, seed=0),
                           progress=lambda line: print(f"  {line}", file=sys.stderr))
    rows = []
    for level in result.levels:
        rows.append({"concurrency": level.concurrency, "requests": level.requests, "completed": level.completed,
                     "errors": level.errors, "short_outputs": level.short_outputs,
                     "output_tokens": round(level.output_tokens.mean * level.completed) if level.output_tokens else 0,
                     "output_tok_per_s": round(level.output_tokens_per_s, 1), "ttft_ms": _stats(level.ttft_ms),
                     "itl_ms": _stats(level.itl_ms), "duration_s": round(level.duration_s, 2),
                     "client_saturated": level.client_saturated})
    base = rows[0]
    for row in rows:
        row["tok_per_s_over_c1"] = round(row["output_tok_per_s"] / base["output_tok_per_s"], 2)
        row["ttft_p50_over_c1"] = round(row["ttft_ms"]["p50"] / base["ttft_ms"]["p50"], 2)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/batching.json"))
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request (demo: 32)")
    ap.add_argument("--input-tokens", type=int, default=32, help="prompt words per request (demo: 32)")
    ap.add_argument("--models", default=",".join(MODELS), help="which of " + ", ".join(MODELS))
    args = ap.parse_args()
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
            for mode, limit in MODES.items():
                print(f"{name} {mode} (max_concurrent_requests {limit or 'default: max_batch_size 8'})", file=sys.stderr)
                repo = Path(tmp) / f"{name}-{mode}"
                write_repo(artifact, repo, limit)
                results[name][mode] = measure(repo, Path(tmp) / f"{name}-{mode}.log", args.requests, args.tokens,
                                              args.input_tokens)
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
                     "requests_per_level": args.requests, "warmup_requests": 4, "concurrency": list(CONCURRENCY)},
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
