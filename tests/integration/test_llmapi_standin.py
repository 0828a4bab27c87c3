"""The LLM-API STAND-IN model (stoker/triton/models/llmapi.py) behind the repository stoker renders for `target:
pytorch`, in a real tritonserver: config.pbtxt, model.yaml and the shim exactly as rendered (the shim finds the
stand-in where it would find TensorRT-LLM's llmapi model), spoken to with the LLM API's interface
(stoker/protocol.py) by the smoke test, the benchmark client and plain gRPC / HTTP. STAND-IN, NOT TensorRT-LLM.

One difference from a container: model.yaml's `model` is the absolute path a container mounts
(/models/tensorrt_llm/1/checkpoint); here it points at the same folder on the host.
tests/integration/test_standin_pytorch.py serves the rendered repository unchanged in the stand-in image.
"""

from __future__ import annotations

import json
import queue
import shutil
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from stoker.bench.client import BenchConfig, run_sweep
from stoker.bench.load import Level
from stoker.bench.workload import make_prompts
from stoker.gpu import llmapi
from stoker.protocol import LLMAPI
from stoker.runtime.generate import generate
from stoker.runtime.model import load_model
from stoker.serving import probe
from stoker.spec.load import parse_spec
from stoker.stack import local_triton
from stoker.triton.models import RUNTIME_PACKAGE, model_source, runtime_sources

from test_triton_models import PROMPT, train_tokenizer, write_artifact

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("llmapi")
    repo = root / "repo"
    spec = parse_spec({"model": {"repo_id": "org/tiny"}, "storage": {"bucket": "bkt"}, "target": "pytorch",
                       "gpus": {"type": "h100-80gb", "count": 1}})
    for rel, text in llmapi.render_all(spec, 512, ()).items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    checkpoint = repo / "tensorrt_llm" / "1" / "checkpoint"
    tok = train_tokenizer(checkpoint)
    end_id, pad_id = tok.token_to_id("</s>"), tok.token_to_id("<pad>")
    write_artifact(checkpoint, tok.get_vocab_size(), end_id, pad_id)
    doc = yaml.safe_load((repo / "tensorrt_llm/1/model.yaml").read_text())
    assert doc["model"] == llmapi.CHECKPOINT_DIR
    doc["model"] = str(checkpoint)  # the host's path of what a container mounts there
    (repo / "tensorrt_llm/1/model.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    # Where the stand-in image keeps it (/app/all_models/llmapi/tensorrt_llm/1), here a folder of the test's.
    upstream = root / "app" / "llmapi" / "tensorrt_llm" / "1"
    (upstream / RUNTIME_PACKAGE).mkdir(parents=True)
    shutil.copyfile(model_source("llmapi"), upstream / "model.py")
    for src in runtime_sources():
        shutil.copyfile(src, upstream / RUNTIME_PACKAGE / src.name)
    server = local_triton.start(repo, local_triton.pick_free_ports(), root / "tritonserver.log",
                                env={"STOKER_LLMAPI_MODEL_DIR": str(upstream)}, auto_complete=True)
    try:
        yield {"server": server, "tok": tok, "model": load_model(checkpoint, num_threads=1), "end_id": end_id}
    finally:
        server.stop(deadline_s=30)


def _reference_text(served, max_tokens: int) -> str:
    ids = served["tok"].encode(PROMPT).ids
    out = list(generate(served["model"], ids, max_tokens, served["end_id"]))
    return served["tok"].decode(out, skip_special_tokens=True)


KINDS = {str: ("BYTES", np.object_), bool: ("BOOL", np.bool_), int: ("INT32", np.int32), float: ("FP32", np.float32)}


def _send(served, values: dict) -> list[tuple[str, str]]:
    """(text_output, finish_reason) of every response to one request over a gRPC stream; an error fails."""
    inputs = []
    for name, value in values.items():
        kind, dtype = KINDS[type(value)]
        t = grpcclient.InferInput(name, [1], kind)
        t.set_data_from_numpy(np.array([value.encode() if kind == "BYTES" else value], dtype=dtype))
        inputs.append(t)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served["server"].grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(llmapi.MODEL_NAME, inputs, request_id="r1", enable_empty_final_response=True)
        out = []
        while True:
            result, error = results.get(timeout=60)
            assert error is None, str(error)
            response = result.get_response()
            if response.outputs:
                out.append((result.as_numpy("text_output")[0].decode(), result.as_numpy("finish_reason")[0].decode()))
            if response.parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


def test_streamed_text_grows_to_the_reference_runtimes_greedy_text(served):
    responses = _send(served, LLMAPI.request(PROMPT, 12))
    texts = [t for t, _ in responses]
    assert len(texts) > 1 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # the output so far, each time
    assert texts[-1] == _reference_text(served, 12)
    assert [f for _, f in responses[:-1]] == ["None"] * (len(responses) - 1)
    assert responses[-1][1] in ("length", "stop")


def test_without_exclude_input_the_prompt_comes_first_and_a_stop_string_cuts(served):
    body = {"text_input": PROMPT, "sampling_param_max_tokens": 12, "streaming": False, "return_finish_reason": True}
    req = urllib.request.Request(f"{served['server'].http_url}/v2/models/tensorrt_llm/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
    full = _reference_text(served, 12)
    assert answer["text_output"] == PROMPT + full
    word = full.strip().split()[-1]
    stopped = _send(served, LLMAPI.request(PROMPT, 12, streaming=False) | {"sampling_param_stop": word})
    assert stopped == [(full[:full.find(word)], "stop")]


def test_the_smoke_and_the_benchmark_speak_the_llm_api(served):
    smoke = probe.smoke(served["server"].http_url, LLMAPI)
    assert smoke["events"] >= 1 and smoke["text"]
    prompts = make_prompts(8, 6, seed=0)
    for protocol, url in (("grpc", served["server"].grpc_url), ("http", served["server"].http_url)):
        result = run_sweep(BenchConfig(url=url, model=LLMAPI.model, interface=LLMAPI, protocol=protocol,
                                       levels=[Level(concurrency=2)], max_tokens=6, requests_per_level=4,
                                       warmup_requests=1, timeout_s=60), prompts)
        level = result.levels[0]
        assert (level.requests, level.completed, level.errors) == (4, 4, 0), result.warnings
        # Cumulative responses taken as new parts: each record holds one output's chunks, never a sum of outputs.
        assert all(0 < r.output_tokens <= 6 for r in result.records if r.concurrency == 2)


def test_a_request_the_stand_in_cannot_serve_is_refused_alone(served):
    with pytest.raises(AssertionError, match="best_of"):
        _send(served, LLMAPI.request(PROMPT, 4) | {"sampling_param_best_of": 2})
    assert _send(served, LLMAPI.request(PROMPT, 4))[-1][0] == _reference_text(served, 4)
