"""AIPerf 0.13 as a peer benchmark: its own virtual environment, one `aiperf profile` run, its JSON export read back.

AIPerf lives in a separate venv (default ``.venv-aiperf``, git-ignored) because its dependency tree (transformers 5,
datasets, plotly, …) must not move the product's pinned packages. It is created on first use.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

AIPERF_VERSION = "0.13.0"


def ensure_venv(venv: Path) -> Path:
    """The ``aiperf`` executable of ``venv``, creating the venv and installing AIPerf when missing."""
    exe = venv / "bin" / "aiperf"
    if not exe.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True).stdout.strip()
    if version != AIPERF_VERSION:  # a peer check against another version would compare other definitions
        raise RuntimeError(f"{exe} is AIPerf {version}, not {AIPERF_VERSION}: remove {venv} to rebuild it")
    return exe


def write_input_file(path: Path, prompts) -> Path:
    """AIPerf's single_turn JSONL: the very texts stoker bench sends, each with its output length."""
    path.write_text("".join(json.dumps({"text": p.text, "output_length": p.output_tokens}) + "\n" for p in prompts))
    return path


def profile(exe: Path, url: str, model: str, tokenizer_dir: Path, input_file: Path, concurrency: int,
            requests: int, warmup: int, output_tokens: int, out: Path, timeout_s: float = 300) -> dict:
    """One streamed /v1/completions run; returns AIPerf's aggregate export (profile_export_aiperf.json)."""
    argv = [str(exe), "profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", str(tokenizer_dir), "--input-file", str(input_file), "--custom-dataset-type", "single_turn",
            # In file order, as stoker bench cycles through its prompt file.
            "--dataset-sampling-strategy", "sequential",
            "--concurrency", str(concurrency), "--request-count", str(requests),
            "--warmup-request-count", str(warmup),
            # Exact OSL, as stoker bench's --ignore-eos (min_tokens = max_tokens): vLLM-style extra fields.
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{output_tokens}",
            "--output-artifact-dir", str(out), "--no-auto-plot", "--random-seed", "0", "--ui-type", "none"]
    # No HF_HUB_OFFLINE: in offline mode AIPerf 0.13 looks tokenizers up in the Hub cache layout, and a plain
    # folder fails there ("Repo id must be in the form …"); a local folder needs no network anyway.
    run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    (out / "aiperf_stdout.txt").parent.mkdir(parents=True, exist_ok=True)
    (out / "aiperf_stdout.txt").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        tail = (run.stdout + run.stderr)[-2000:]
        raise RuntimeError(f"aiperf exited {run.returncode}:\n{tail}")
    return json.loads((out / "profile_export_aiperf.json").read_text())


def metrics(export: dict) -> dict:
    """The compared figures from AIPerf's export, under stoker's names (ms, tokens/s, counts)."""
    errors = sum(e.get("count", 0) for e in export.get("error_summary") or [])
    return {
        "ttft_ms_p50": export["time_to_first_token"]["p50"],
        "ttft_ms_p99": export["time_to_first_token"]["p99"],
        "itl_ms_p50": export["inter_token_latency"]["p50"],
        "output_tokens_per_s": export["output_token_throughput"]["avg"],
        "requests": int(export["request_count"]["avg"]),
        "errors": errors,
        "osl_mean": export["output_sequence_length"]["avg"],
        "duration_s": export["benchmark_duration"]["avg"],
        "e2e_ms_p50": export["request_latency"]["p50"],
    }
