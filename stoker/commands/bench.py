"""`stoker bench`: the streaming benchmark against any Triton LLM endpoint (gRPC or HTTP SSE)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..bench.errors import InvalidBenchmarkConfig


def _numbers(kind: type) -> callable:
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None

    return parse


def _extra(text: str) -> tuple[str, int | float | bool]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME=VALUE")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value)
    except ValueError:
        try:
            return name, float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: VALUE must be a number or true/false") from None


def _tokenizer(path: Path | None) -> Path | None:
    if path is None:
        return None
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise InvalidBenchmarkConfig(f"tokenizer {path}: no such file (give tokenizer.json or its folder)")
    return path


def _bench(args: argparse.Namespace) -> int:
    from ..bench.client import BenchConfig
    from ..bench.session import Workload, execute, levels_from

    protocol = args.protocol or ("http" if args.url.startswith(("http://", "https://")) else "grpc")
    if args.request_rate and args.concurrency:
        raise InvalidBenchmarkConfig("give --concurrency or --request-rate, not both (cap rates with --max-concurrency)")
    levels = levels_from(args.concurrency or ([] if args.request_rate else [1]), args.request_rate, args.max_concurrency)
    config = BenchConfig(
        url=args.url, model=args.model, levels=levels, max_tokens=args.output_tokens,
        requests_per_level=None if args.duration else args.requests, duration_s=args.duration,
        warmup_requests=args.warmup, timeout_s=args.timeout, protocol=protocol, arrival=args.arrival,
        seed=args.seed, workers=args.workers, ignore_eos=args.ignore_eos, http_streaming=not args.no_stream,
        extra_inputs=dict(args.extra_input or []))
    workload = Workload(input_tokens=args.input_tokens, output_tokens=args.output_tokens,
                        input_stddev=args.input_tokens_stddev, output_stddev=args.output_tokens_stddev,
                        seed=args.seed, tokenizer_json=_tokenizer(args.tokenizer), prompt_file=args.prompt_file)
    out = args.out or Path(f"bench-{time.strftime('%Y%m%dT%H%M%S')}")
    say = (lambda msg: print(msg, file=sys.stderr)) if not args.quiet else None
    _, summary, files = execute(config, workload, out, progress=say, progress_bar=not args.quiet and sys.stderr.isatty())
    from ..bench.output import markdown_table

    print(markdown_table(summary["levels"]), end="")
    for path in files:
        print(f"wrote {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a Triton LLM endpoint (TTFT, ITL, throughput; GenAI-Perf definitions)",
                       description=__doc__)
    p.add_argument("--url", required=True, help="gRPC host:port, or http://host:port for HTTP generate_stream")
    p.add_argument("--protocol", choices=("grpc", "http"), help="default: from the URL")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--no-stream", action="store_true", help="HTTP only: /generate, one response per request")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=_numbers(int), help="levels, e.g. 1,4,16 (default 1)")
    load.add_argument("--request-rate", type=_numbers(float), help="requests/s levels, e.g. 2,5,10")
    load.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight in request-rate mode")
    load.add_argument("--requests", type=int, default=64, help="per level (default 64)")
    load.add_argument("--duration", type=float, help="seconds per level, instead of --requests")
    load.add_argument("--warmup", type=int, default=2, help="unmeasured requests first (default 2)")
    load.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    load.add_argument("--workers", type=int, default=1, help="load-generator processes (default 1)")
    wl = p.add_argument_group("workload")
    wl.add_argument("--input-tokens", type=int, default=32)
    wl.add_argument("--input-tokens-stddev", type=float, default=0.0)
    wl.add_argument("--output-tokens", type=int, default=32, help="max_tokens per request")
    wl.add_argument("--output-tokens-stddev", type=float, default=0.0)
    wl.add_argument("--ignore-eos", action="store_true", help="send min_tokens = max_tokens (exact OSL)")
    wl.add_argument("--tokenizer", type=Path, help="tokenizer.json (or its folder): exact ISL, OSL counted in tokens")
    wl.add_argument("--prompt-file", type=Path, help='JSONL prompts: {"text": ..., "output_tokens": N}')
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--extra-input", type=_extra, action="append", help="NAME=VALUE model input, e.g. end_id=2")
    p.add_argument("--out", type=Path, help="output folder (default ./bench-<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(fn=_bench)
