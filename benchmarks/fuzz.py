"""Issue 51's measure: every HTTP surface fuzzed from its schema (benchmarks/fuzz_surfaces), a longer run than CI's.

Starts what the surfaces need, the way the other benchmarks do: the tiny Llama (seed 0) on the local tritonserver
with the OpenAI service in front (tests/integration/openai_process.tiny_model_served, given the tool-calling
template so ``tools`` reach the model), and ``stoker webhook serve`` over a specs folder holding the demo spec as
``tiny`` (Prefect's API unreachable, so a valid signed trigger ends in the documented 503 "could not start"; its
rate limit raised so the fuzzer is not answered 429 throughout). Then every surface module present in
benchmarks/fuzz_surfaces runs for its budget (triton at a stable address: the deployment
tests/integration/test_fuzz_triton.py makes on Docker and S3, its bounded test run with this budget), and the result goes to
benchmarks/results/fuzz.json: per surface, requests generated, by status, 5xx, distinct failures with an
example, seconds; and the failures found and fixed on the way, with the commit that fixed each.

    .venv/bin/python benchmarks/fuzz.py [--out benchmarks/results/fuzz.json] [--examples N] [--seed S]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from benchmarks.fuzz_surfaces import Target  # noqa: E402

# Requests per surface in the long run: about 3 minutes each on 2 cores.
EXAMPLES = {"openai": 2000, "webhook": 3000, "triton": 1500}

# What the fuzzer found and what fixed it (each with a regression test that fails before the fix).
FIXED = [
    {"surface": "webhook", "failure": "500 for a signature header holding a non-ASCII character (hmac.compare_digest "
     "raises TypeError on such a str)", "now": "401 bad or missing signature", "commit": "8779b1a",
     "test": "tests/unit/test_webhook_fuzz_findings.py"},
    {"surface": "webhook", "failure": "500 for a signed body nested deeper than the JSON parser's stack "
     "(RecursionError)", "now": "400 invalid trigger", "commit": "8779b1a",
     "test": "tests/unit/test_webhook_fuzz_findings.py"},
    {"surface": "webhook", "failure": "500 for a signed timestamp beyond a float's range, e.g. 10**400 (OverflowError "
     "in the window check)", "now": "400 invalid trigger (timestamp must fit an int64)", "commit": "8779b1a",
     "test": "tests/unit/test_webhook_fuzz_findings.py"},
    {"surface": "webhook", "failure": "404 and 405 in Starlette's plain text ('Not Found'), not the receiver's "
     "{\"error\": ...} shape", "now": "{\"error\": \"not found: ...\"} / {\"error\": \"method GET not allowed ...\"}"
     " (405 keeps its Allow header)", "commit": "8779b1a", "test": "tests/unit/test_webhook_fuzz_findings.py"},
    {"surface": "openai", "failure": "500 backend_error ('INTERNAL: Invalid metadata', or 'internal error: "
     "ExecuteBatchError') for an authorization header with a byte outside printable ASCII, forwarded to Triton as "
     "gRPC metadata", "now": "401 invalid_api_key in OpenAI's shape, before any work", "commit": "cd57bdc",
     "test": "tests/unit/test_openai_fuzz_findings.py"},
    {"surface": "openai", "failure": "500 backend_error ('RESOURCE_EXHAUSTED: received metadata size exceeds soft "
     "limit (8555 vs. 8192)') for an authorization header of 8,000 characters, forwarded to Triton as gRPC metadata",
     "now": "401 invalid_api_key over 1,024 characters (no key is over 512)", "commit": "f1a0670",
     "test": "tests/unit/test_openai_fuzz_findings.py"},
    {"surface": "triton", "failure": "500 at the stable address for a client's malformed JSON on generate, "
     "generate_stream and infer (Triton's 'Unable to parse ...', 'failed to parse the request JSON buffer', "
     "'attempt to get members for non-object', 'Expected JSON object for keyword'; the outside fuzz's text_input null, "
     "stop_words {}, stream 2147483648, invalid UTF-8), and 501 text/plain for infer on a decoupled model or an "
     "unsupported Content-Encoding: 5 distinct classes in 60 requests on the code before",
     "now": "400 in Triton's {\"error\": ...} shape (HAProxy maps only Triton's own client-input texts; a model's "
     "failure stays 500)", "commit": "731934d", "test": "tests/integration/test_fuzz_triton.py"},
]


def surfaces() -> list[str]:
    """The surface modules present (each helper adds its own)."""
    import benchmarks.fuzz_surfaces as pkg

    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def _triton_at_the_stable_address(root: Path, examples: int, seed: int) -> dict:
    """The triton surface needs a stable address (HAProxy before Triton, where a client's mistake becomes a 400):
    the deployment tests/integration/test_fuzz_triton.py makes on the real Docker engine and S3, its bounded test
    run with this budget, its tally read back."""
    import subprocess

    out = root / "triton.json"
    print(f"fuzz: triton: {examples} HTTP requests (+ a third as many gRPC), seed {seed}, at a stable address",
          flush=True)
    env = {**os.environ, "STOKER_FUZZ_TRITON_EXAMPLES": str(examples), "STOKER_FUZZ_SEED": str(seed),
           "STOKER_FUZZ_TRITON_OUT": str(out)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           f"--basetemp={root / 'pytest'}", "tests/integration/test_fuzz_triton.py",
                           "-k", "bounded_fuzz_run"], cwd=ROOT, env=env)
    if not out.exists():
        raise SystemExit(f"fuzz: the triton surface's run ended (rc {done.returncode}) without a tally")
    result = json.loads(out.read_text())
    result["seed"], result["max_examples"] = seed, examples
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fuzz.json")
    p.add_argument("--examples", type=int, default=None, help="requests per surface (default: each one's EXAMPLES)")
    p.add_argument("--seed", type=int, default=51)
    p.add_argument("--only", nargs="*", default=None, help="surface names to run (default: every one present)")
    args = p.parse_args(argv)

    from openai_process import TOOLS_TEMPLATE, tiny_model_served
    from webhook_process import WEBHOOK_SECRET, webhook_receiver

    names = [n for n in surfaces() if args.only is None or n in args.only]
    results, processes = [], {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stoker-fuzz-") as tmp:
        root = Path(tmp)
        with tiny_model_served(root / "model", chat_template=TOOLS_TEMPLATE) as (server, _artifact, base), \
                webhook_receiver(root / "webhook") as (hook, receiver):
            target = Target(http=server.http_url, grpc=server.grpc_url, openai=base, model="tiny", webhook=hook,
                            webhook_secret=WEBHOOK_SECRET)
            processes = {"tritonserver": server.process, "webhook": receiver}
            for name in names:
                module = importlib.import_module(f"benchmarks.fuzz_surfaces.{name}")
                examples = args.examples or EXAMPLES.get(module.SURFACE, 1000)
                if name == "triton":
                    results.append(_triton_at_the_stable_address(root, examples, args.seed))
                    continue
                print(f"fuzz: {module.SURFACE}: {examples} requests, seed {args.seed}", flush=True)
                # Target.model is the name a surface's clients use: the deployment's for OpenAI, the entry model's
                # (the ensemble) for Triton's own routes.
                tally = module.run(replace(target, model="ensemble") if name == "triton" else target, examples,
                                   args.seed)
                out = tally.as_json()
                out["seed"], out["max_examples"] = args.seed, examples
                results.append(out)
                print(json.dumps({k: v for k, v in out.items() if k != "failures"}), flush=True)
                for kind, example in out["failures"].items():
                    print(f"  FAILURE {kind}: {example[:300]}", flush=True)
            alive = {k: proc.poll() is None for k, proc in processes.items()}
    report = {
        "what": "issue 51: every HTTP surface fuzzed from its schema (hypothesis), the longer run; CI runs the same "
                "surfaces with a small fixed-seed budget (tests/integration/test_fuzz_api.py, test_fuzz_triton.py); "
                "the triton surface at a stable address (HAProxy before the CPU Triton serving the scripted ensemble "
                "of test_fuzz_triton.py), the others straight at their service",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU (the tiny Llama on the CPU tritonserver)",
        "surfaces": results,
        "processes_alive_after": alive,
        "total_seconds": round(time.monotonic() - t0, 1),
        "longest_run_seconds": max((r["seconds"] for r in results), default=0),
        "found_and_fixed": FIXED,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"fuzz: wrote {args.out}")
    return 0 if all(not r["failures"] for r in results) and all(alive.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
