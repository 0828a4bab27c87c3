"""`stoker bench`: the streaming benchmark against any Triton LLM endpoint (gRPC or HTTP SSE), or any
OpenAI-compatible server's streamed /v1/completions (--protocol openai, or a --url ending in /v1).

Tokens are counted with a tokenizer: --tokenizer, else the one of the stoker deployment serving --url
(its run's manifest, else its repository in S3). Without one it refuses, unless --count-chunks: then
stream chunks are counted, and every table and summary says so.
"""

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


def _response_format(args: argparse.Namespace) -> dict | None:
    """OpenAI's response_format for every request: --json-schema FILE (strict), or --response-format json_object."""
    import json

    if args.json_schema is not None and args.response_format is not None:
        raise InvalidBenchmarkConfig("give --json-schema or --response-format, not both")
    if args.response_format is not None:
        return {"type": args.response_format}
    if args.json_schema is None:
        return None
    try:
        schema = json.loads(args.json_schema.read_text())
    except OSError as err:
        raise InvalidBenchmarkConfig(f"--json-schema {args.json_schema}: {err.strerror or err}") from None
    except ValueError as err:
        raise InvalidBenchmarkConfig(f"--json-schema {args.json_schema}: not JSON ({err})") from None
    if not isinstance(schema, dict):
        raise InvalidBenchmarkConfig(f"--json-schema {args.json_schema}: a JSON schema is an object, "
                                     f"not {type(schema).__name__}")
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in args.json_schema.stem)[:64] or "schema"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _tokenizer(path: Path | None) -> Path | None:
    if path is None:
        return None
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise InvalidBenchmarkConfig(f"tokenizer {path}: no such file (give tokenizer.json or its folder)")
    return path


def _counting(args: argparse.Namespace):
    from ..bench.counting import choose
    from ..run import stoker_home

    def deployed():
        from ..serving.deployed_tokenizer import lookup

        return lookup(args.url, stoker_home())

    return choose(_tokenizer(args.tokenizer), args.count_chunks, deployed)


def _protocol_of(url: str) -> str:
    """OpenAI for a URL ending in /v1 (OpenAI clients' base URL), HTTP for another http(s) URL, else gRPC."""
    if url.rstrip("/").endswith("/v1"):
        return "openai"
    return "http" if url.startswith(("http://", "https://")) else "grpc"


def _interface(args: argparse.Namespace, protocol: str):
    """--interface, else the interface of the deployment serving --url (its backend's label), else the ensemble's."""
    from ..protocol import ENSEMBLE, by_layout

    if args.interface:
        return by_layout(args.interface)
    if protocol == "openai":
        return ENSEMBLE  # unused: OpenAI requests name the model, not Triton inputs
    from ..run import stoker_home
    from ..serving.deployed_tokenizer import interface_on

    return by_layout(interface_on(args.url, stoker_home()) or "ensemble")


def _bench(args: argparse.Namespace) -> int:
    from ..bench.client import BenchConfig, validate
    from ..bench.counting import CHUNKS_WARNING
    from ..bench.session import Workload, execute, for_adapter, levels_from
    from ..bench.workload import Prompt, load_prompt_file
    from ..spec.adapters import task_id

    protocol = args.protocol or _protocol_of(args.url)
    interface = _interface(args, protocol)
    if args.request_rate and args.concurrency:
        raise InvalidBenchmarkConfig("give --concurrency or --request-rate, not both (cap rates with --max-concurrency)")
    levels = levels_from(args.concurrency or ([] if args.request_rate else [1]), args.request_rate, args.max_concurrency)
    config = BenchConfig(
        url=args.url, model=args.model or interface.model, levels=levels, max_tokens=args.output_tokens,
        requests_per_level=None if args.duration else args.requests, duration_s=args.duration,
        warmup_requests=args.warmup, timeout_s=args.timeout, protocol=protocol, arrival=args.arrival,
        seed=args.seed, workers=args.workers, ignore_eos=args.ignore_eos, http_streaming=not args.no_stream,
        extra_inputs=dict(args.extra_input or []), interface=interface, response_format=_response_format(args))
    # Bad settings and a bad prompt file are refused before the deployment is looked up.
    validate(config, [Prompt("-", 1)])  # the real prompts are checked again when they are made
    adapters = {name: for_adapter(config, name, task_id(name)) for name in args.adapter or []}
    if args.prompt_file is not None:
        load_prompt_file(args.prompt_file)
    counting = _counting(args)
    workload = Workload(input_tokens=args.input_tokens, output_tokens=args.output_tokens,
                        input_stddev=args.input_tokens_stddev, output_stddev=args.output_tokens_stddev,
                        seed=args.seed, tokenizer_json=counting.tokenizer_json, prompt_file=args.prompt_file)
    out = args.out or Path(f"bench-{time.strftime('%Y%m%dT%H%M%S')}")
    say = (lambda msg: print(msg, file=sys.stderr)) if not args.quiet else None
    _, summary, files = execute(config, workload, out, progress=say, progress_bar=not args.quiet and sys.stderr.isatty(),
                                meta={"counting": counting.to_dict()})
    from ..bench.output import cost_lines, markdown_table

    # The unit of every figure in the table: said above it (and in its caption when chunks).
    print(f"{CHUNKS_WARNING}" if counting.chunks else f"tokens counted with {counting.tokenizer_json} "
          f"({counting.source})")
    print(markdown_table(summary["levels"], summary["units"]["output"]), end="")
    if config.response_format is not None:
        # The constraint's cost: the same prompts and levels again without it, side by side in one command.
        from dataclasses import replace

        _, free, more = execute(replace(config, response_format=None), workload, out / "unconstrained",
                                progress=say, progress_bar=not args.quiet and sys.stderr.isatty(),
                                meta={"counting": counting.to_dict()})
        print("unconstrained (the same workload without response_format):")
        print(markdown_table(free["levels"], free["units"]["output"]), end="")
        for line in cost_lines(summary, free):
            print(line)
        files = [*files, *more]
    for name, adapter_config in adapters.items():
        _, s, more = execute(adapter_config, workload, out / "adapters" / name, progress=say,
                             progress_bar=not args.quiet and sys.stderr.isatty(),
                             meta={"counting": counting.to_dict(), "adapter": name})
        print(f"adapter {name}:")
        print(markdown_table(s["levels"], s["units"]["output"]), end="")
        files = [*files, *more]
    for path in files:
        print(f"wrote {path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark a Triton LLM endpoint (TTFT, ITL, throughput; GenAI-Perf definitions)",
                       description=__doc__)
    p.add_argument("--url", required=True, help="gRPC host:port, http://host:port for HTTP generate_stream, or "
                   "http://host:port/v1 for an OpenAI-compatible server")
    p.add_argument("--protocol", choices=("grpc", "http", "openai"),
                   help="default: from the URL (…/v1: openai; http(s)://: http; else grpc)")
    p.add_argument("--model", help="the Triton model, or the OpenAI model id (default: the interface's model: "
                   "ensemble, or tensorrt_llm for llmapi)")
    p.add_argument("--interface", choices=("ensemble", "llmapi"),
                   help="the served layout's inputs: TensorRT-LLM's ensemble (text_input, max_tokens, stream) or the "
                        "LLM API's model (streaming, sampling_param_*); default: the deployment's serving --url, "
                        "else ensemble")
    p.add_argument("--no-stream", action="store_true",
                   help="HTTP: /generate; openai: stream false (one response per request)")
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
    wl.add_argument("--ignore-eos", action="store_true", help="send min_tokens = max_tokens (exact OSL; "
                    "on openai the min_tokens field, as vLLM and stoker's OpenAI service take it)")
    wl.add_argument("--tokenizer", type=Path, help="tokenizer.json (or its folder); default: the one of the stoker "
                    "deployment serving --url (its manifest, else its repository in S3)")
    wl.add_argument("--count-chunks", action="store_true",
                    help="no tokenizer: count stream chunks (labelled CHUNKS everywhere) and input words")
    wl.add_argument("--prompt-file", type=Path, help='JSONL prompts: {"text": ..., "output_tokens": N}')
    wl.add_argument("--seed", type=int, default=0)
    wl.add_argument("--extra-input", type=_extra, action="append",
                    help="NAME=VALUE model input, e.g. end_id=2 (openai: a request field, e.g. temperature=0)")
    wl.add_argument("--json-schema", type=Path, metavar="FILE",
                    help="openai: every request constrained to this JSON schema (response_format json_schema, "
                         "strict); the same workload is then measured without it and the cost printed per level")
    wl.add_argument("--response-format", choices=("json_object",),
                    help="openai: every request's response_format (then measured without it too, as --json-schema)")
    p.add_argument("--adapter", action="append", metavar="NAME",
                   help="also measure LoRA adapter NAME under the same load (repeatable): its model id over openai, "
                        "its lora_task_id (stoker's, from the name) over Triton")
    p.add_argument("--out", type=Path, help="output folder (default ./bench-<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(fn=_bench)
