"""Architectures nobody on the project wrote, served by the reference runtime exactly as transformers runs them.

Each case generates a tiny model offline (stoker.workers.tinymodel: Llama, Qwen2 with random q/k/v
biases, Mistral with a sliding window shorter than the sequences, Phi-3 with fused qkv/gate_up
projections), optionally quantizes it with the real ModelOpt worker, builds it with stoker's build
step, assembles stoker's repository and serves it with the real tritonserver (python backend,
local). The served stream must equal transformers' greedy `generate` token for token, one response
per token, stopping where transformers stops (TensorRT-LLM's rule: a final end_id is not returned).

What transformers is given: for unquantized builds the original bf16 checkpoint, loaded in float32;
for quantized builds our dequantized weights (the build's model.safetensors) and, when the KV cache is
quantized, our rounding cache passed to `generate`. So a runtime bug (a dropped bias, a wrong window,
a misread fused projection, a cache position off by one) shows as a mismatch; the quantization's own
error does not, by design (tests/integration/test_quantize.py measures that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.triton, pytest.mark.slow]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tokenizers import Tokenizer

from grpc_stream import stream_responses

from stoker.runtime.model import load_model
from stoker.stack import local_triton
from stoker.triton.config import RepoSettings
from stoker.triton.repository import assemble
from stoker.workers import build_reference
from stoker.workers.tinymodel import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "stoker" / "data" / "calibration.txt"
PROMPTS = ("The quick brown fox", "Hello world", "Triton serves the model one token at a time")
BUDGET = 24
# (architecture, format, kv cache dtype): every architecture unquantized, plus the quantized exports
# whose names differ from Llama's (biases beside fp8 weights and K/V scales; fused int4 projections).
CASES = [("llama", "none", None), ("qwen2", "none", None), ("mistral", "none", None), ("phi3", "none", None),
         ("qwen2", "fp8", "fp8"), ("phi3", "int4_awq", None)]


def _quantize(checkpoint: Path, fmt: str, kv: str | None, work: Path) -> Path:
    request = {"checkpoint": str(checkpoint), "format": fmt, "kv_cache_dtype": kv, "seed": 0,
               "calibration": {"text_file": str(CALIBRATION), "samples": 2, "seq_len": 64, "batch_size": 2}}
    (work / "request.json").write_text(json.dumps(request))
    out = work / "quantized"
    done = subprocess.run([sys.executable, "-m", "stoker.workers.quantize", "--request", str(work / "request.json"),
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(x for x in c if x))
def served(request, tmp_path_factory):
    arch, fmt, kv = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{fmt}")
    checkpoint = root / "checkpoint"
    make_tiny_model(checkpoint, seed=0, architecture=arch)
    source = checkpoint if fmt == "none" else _quantize(checkpoint, fmt, kv, root)
    artifact = root / "artifact"
    build_reference.build(source, artifact)
    runtime = json.loads((artifact / "stoker_runtime.json").read_text())
    assert runtime["quantization"]["format"] == fmt and runtime["quantization"]["kv_cache_dtype"] == kv

    repo = root / "repo"
    assemble(artifact, repo, RepoSettings(model_threads=1))
    (repo / "ensemble" / "1").mkdir(parents=True, exist_ok=True)
    server = local_triton.start(repo, local_triton.pick_free_ports(), root / "tritonserver.log")
    try:
        # transformers' side: the original checkpoint, or our dequantized weights (+ our KV rounding).
        hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint if fmt == "none" else artifact,
                                                               dtype=torch.float32).eval()
        reference = load_model(artifact, num_threads=1)
        yield {"server": server, "hf": hf, "reference": reference, "runtime": runtime, "arch": arch,
               "tok": Tokenizer.from_file(str(checkpoint / "tokenizer.json"))}
    finally:
        server.stop(deadline_s=30)


def _hf_greedy(served, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy continuation as TensorRT-LLM returns it (no final end_id)."""
    runtime, hf = served["runtime"], served["hf"]
    end_id = runtime["end_id"]
    cache = served["reference"].new_cache() if runtime["quantization"]["kv_cache_dtype"] else None
    hf.generation_config.eos_token_id = [end_id, *runtime["stop_ids"]]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                          max_new_tokens=BUDGET, do_sample=False, pad_token_id=runtime["pad_id"],
                          past_key_values=cache)
    new = out[0, len(prompt_ids):].tolist()
    return new[:-1] if new and new[-1] == end_id else new


def _served_stream(served, prompt_ids: list[int]) -> list[list[int]]:
    """Every streamed response's output_ids from the tensorrt_llm model (gRPC stream_infer)."""
    inputs = {"input_ids": np.array([prompt_ids], np.int32), "input_lengths": np.array([[len(prompt_ids)]], np.int32),
              "request_output_len": np.array([[BUDGET]], np.int32), "streaming": np.array([[True]])}
    return [r.as_numpy("output_ids").reshape(-1).tolist()
            for r in stream_responses(served["server"].grpc_url, "tensorrt_llm", inputs)]


def test_the_served_model_is_transformers_own_class(served) -> None:
    expected = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                "phi3": "Phi3ForCausalLM"}[served["arch"]]
    assert served["reference"].architecture == type(served["hf"]).__name__ == expected
    assert f"{expected} (transformers)" in served["server"].log_tail(100_000)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_served_greedy_stream_equals_transformers_token_for_token(served, prompt) -> None:
    ids = served["tok"].encode(prompt).ids
    expected = _hf_greedy(served, ids)
    assert expected, "transformers produced nothing to compare"
    responses = _served_stream(served, ids)
    assert all(len(r) == 1 for r in responses), "one streamed response per token"
    assert [r[0] for r in responses] == expected
