"""The three python-backend models and an ensemble on a real tritonserver (nvidia-pytriton wheel).

The repository is written here with hand-written minimal config.pbtxt files, a tiny random
Llama (transformers, saved as a stoker reference artifact) and a byte-level BPE tokenizer
trained on the lines below. Expected outputs come from the same runtime run in-process.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.triton

transformers = pytest.importorskip("transformers")
pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from stoker.runtime.generate import generate
from stoker.runtime.model import load_model
from stoker.stack import local_triton
from stoker.triton.models import install_model_code

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model streams one token at a time through the ensemble.",
    "Triton serves the preprocessing, the model and the postprocessing steps.",
    "Quantization trades a little accuracy for a lot of speed.",
    "The reference runtime runs on the CPU with a key value cache.",
    "Every request carries a prompt, a token budget and sampling settings.",
    "Streaming responses arrive as server sent events or over gRPC.",
    "We measure tokens per second, time to first token and latency.",
] * 4
PROMPT = "The quick brown fox streams tokens"
SPECIALS = ["<s>", "</s>", "<pad>"]


def train_tokenizer(out: Path) -> Tokenizer:
    """Byte-level BPE on CORPUS, with <s> prepended like Llama tokenizers do."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    # No stoker_runtime.json here: preprocessing must find the end id through tokenizer_config.json.
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok


def write_artifact(out: Path, vocab: int, end_id: int, pad_id: int) -> None:
    """A tiny random Llama as a stoker reference artifact."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=vocab,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(config.to_json_string())
    (out / "stoker_runtime.json").write_text(json.dumps({
        "format": "stoker-reference/1", "dtype": "float32", "end_id": end_id, "pad_id": pad_id,
        "quantization": {"format": "none", "kv_cache_dtype": None, "kv_scales": {}}}))


def _tensors(kind: str, specs: list[tuple]) -> str:
    blocks = []
    for name, dtype, dims, *optional in specs:
        opt = " optional: true" if optional and optional[0] else ""
        blocks.append(f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ]{opt} }}')
    return f"{kind} [\n" + ",\n".join(blocks) + "\n]\n"


def _params(values: dict[str, str]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in values.items())


def _python_config(name: str, inputs: list, outputs: list, params: dict[str, str], decoupled: bool = False) -> str:
    text = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n'
    if decoupled:
        text += "model_transaction_policy { decoupled: true }\n"
    return text + _tensors("input", inputs) + _tensors("output", outputs) + _params(params) + \
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f'      input_map {{ key: "{k}" value: "{v}" }}\n' for k, v in inputs.items())
    maps += "".join(f'      output_map {{ key: "{k}" value: "{v}" }}\n' for k, v in outputs.items())
    return f'    {{\n      model_name: "{model}"\n      model_version: -1\n{maps}    }}'


def write_configs(repo: Path) -> None:
    """Minimal hand-written configs: the three models, a non-decoupled copy of the model step, the ensemble."""
    i32, b, f32 = "TYPE_INT32", "TYPE_BOOL", "TYPE_FP32"
    (repo / "preprocessing" / "config.pbtxt").write_text(_python_config(
        "preprocessing",
        [("QUERY", "TYPE_STRING", [1]), ("REQUEST_OUTPUT_LEN", i32, [1]), ("END_ID", i32, [1], True),
         ("PAD_ID", i32, [1], True)],
        [("INPUT_ID", i32, [-1]), ("REQUEST_INPUT_LEN", i32, [1]), ("REQUEST_OUTPUT_LEN", i32, [1]),
         ("OUT_END_ID", i32, [1]), ("OUT_PAD_ID", i32, [1])],
        {"tokenizer_dir": "tokenizer", "add_special_tokens": "true"}))
    model_inputs = [
        ("input_ids", i32, [-1]), ("input_lengths", i32, [1]), ("request_output_len", i32, [1]),
        ("end_id", i32, [1], True), ("pad_id", i32, [1], True), ("streaming", b, [1], True),
        ("temperature", f32, [1], True), ("runtime_top_k", i32, [1], True), ("runtime_top_p", f32, [1], True),
        ("repetition_penalty", f32, [1], True), ("seed", "TYPE_UINT64", [1], True),
        ("exclude_input_in_output", b, [1], True),
    ]
    model_outputs = [("output_ids", i32, [-1, -1]), ("sequence_length", i32, [-1])]
    for name, decoupled in (("tensorrt_llm", True), ("tensorrt_llm_unary", False)):
        (repo / name / "config.pbtxt").write_text(_python_config(
            name, model_inputs, model_outputs, {"gpt_model_path": "weights", "num_threads": "1"}, decoupled))
    (repo / "postprocessing" / "config.pbtxt").write_text(_python_config(
        "postprocessing",
        [("TOKENS_BATCH", i32, [-1, -1]), ("SEQUENCE_LENGTH", i32, [-1])],
        [("OUTPUT", "TYPE_STRING", [-1])],
        {"tokenizer_dir": "tokenizer", "skip_special_tokens": "true"}))
    ensemble_inputs = [("text_input", "TYPE_STRING", [1]), ("max_tokens", i32, [1]), ("stream", b, [1], True),
                       ("end_id", i32, [1], True), ("pad_id", i32, [1], True), ("top_k", i32, [1], True),
                       ("top_p", f32, [1], True), ("temperature", f32, [1], True),
                       ("repetition_penalty", f32, [1], True), ("seed", "TYPE_UINT64", [1], True),
                       ("exclude_input_in_output", b, [1], True)]
    steps = [
        _step("preprocessing",
              {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "END_ID": "end_id", "PAD_ID": "pad_id"},
              {"INPUT_ID": "_ids", "REQUEST_INPUT_LEN": "_in_len", "REQUEST_OUTPUT_LEN": "_out_len",
               "OUT_END_ID": "_end", "OUT_PAD_ID": "_pad"}),
        _step("tensorrt_llm",
              {"input_ids": "_ids", "input_lengths": "_in_len", "request_output_len": "_out_len", "end_id": "_end",
               "pad_id": "_pad", "streaming": "stream", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
               "temperature": "temperature", "repetition_penalty": "repetition_penalty", "seed": "seed",
               "exclude_input_in_output": "exclude_input_in_output"},
              {"output_ids": "_tokens", "sequence_length": "_seq_len"}),
        _step("postprocessing", {"TOKENS_BATCH": "_tokens", "SEQUENCE_LENGTH": "_seq_len"}, {"OUTPUT": "text_output"}),
    ]
    (repo / "ensemble" / "config.pbtxt").write_text(
        'name: "ensemble"\nplatform: "ensemble"\nmax_batch_size: 8\n' + _tensors("input", ensemble_inputs)
        + _tensors("output", [("text_output", "TYPE_STRING", [-1])])
        + "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}\n")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tritonserver on a freshly written repository, plus the in-process reference pieces."""
    root = tmp_path_factory.mktemp("triton")
    repo = root / "repo"
    tok = train_tokenizer(repo / "preprocessing" / "1" / "tokenizer")
    shutil.copytree(repo / "preprocessing" / "1" / "tokenizer", repo / "postprocessing" / "1" / "tokenizer")
    end_id, pad_id = tok.token_to_id("</s>"), tok.token_to_id("<pad>")
    write_artifact(repo / "tensorrt_llm" / "1" / "weights", tok.get_vocab_size(), end_id, pad_id)
    (repo / "ensemble" / "1").mkdir(parents=True)
    install_model_code(repo)
    shutil.copytree(repo / "tensorrt_llm", repo / "tensorrt_llm_unary")
    write_configs(repo)
    started = time.monotonic()
    server = local_triton.start(repo, local_triton.pick_free_ports(), root / "tritonserver.log")
    print(f"tritonserver ready in {time.monotonic() - started:.1f}s")
    model = load_model(repo / "tensorrt_llm" / "1" / "weights", num_threads=1)
    try:
        yield {"server": server, "tok": tok, "model": model, "end_id": end_id}
    finally:
        code = server.stop(deadline_s=30)
        print(f"tritonserver exit code {code}")


def reference(served, max_tokens: int, **kwargs) -> list[int]:
    ids = served["tok"].encode(PROMPT).ids
    return list(generate(served["model"], ids, max_tokens, kwargs.pop("end_id", served["end_id"]), **kwargs))


def _inputs(max_tokens: int, stream: bool, **optional) -> list:
    types = {"end_id": ("INT32", np.int32), "top_k": ("INT32", np.int32), "top_p": ("FP32", np.float32),
             "temperature": ("FP32", np.float32), "seed": ("UINT64", np.uint64),
             "exclude_input_in_output": ("BOOL", bool)}
    values = [("text_input", "BYTES", np.array([[PROMPT.encode()]], dtype=object)),
              ("max_tokens", "INT32", np.array([[max_tokens]], np.int32)),
              ("stream", "BOOL", np.array([[stream]], bool))]
    values += [(k, types[k][0], np.array([[v]], types[k][1])) for k, v in optional.items()]
    inputs = []
    for name, dtype, data in values:
        tensor = grpcclient.InferInput(name, list(data.shape), dtype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def grpc_stream(served, max_tokens: int, stream: bool = True, **optional) -> tuple[list[str], list[str], list[float]]:
    """(texts, errors, arrival times) of one ensemble request over gRPC stream_infer."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served["server"].grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error, time.perf_counter())), results))
    try:
        client.async_stream_infer("ensemble", _inputs(max_tokens, stream, **optional), request_id="r1",
                                  enable_empty_final_response=True)
        texts, errors, times = [], [], []
        while True:
            result, error, at = results.get(timeout=120)
            if error is not None:
                errors.append(str(error))
                break
            response = result.get_response()
            if result.as_numpy("text_output") is not None:
                texts.append(result.as_numpy("text_output").reshape(-1)[0].decode())
                times.append(at)
            if response.parameters["triton_final_response"].bool_param:
                break
        return texts, errors, times
    finally:
        client.stop_stream()
        client.close()


def http_post(served, path: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(served["server"].http_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_grpc_stream_sends_one_response_per_token(served) -> None:
    expected = reference(served, 16)
    assert len(expected) == 16, "the random model hit the end id; pick another seed"
    texts, errors, _ = grpc_stream(served, 16)
    assert errors == []
    assert len(texts) == 16
    assert texts == [served["tok"].decode([t]) for t in expected]
    assert "".join(texts) == served["tok"].decode(expected)


def test_http_generate_stream_sse(served) -> None:
    expected = reference(served, 12)
    status, body = http_post(served, "/v2/models/ensemble/generate_stream",
                             {"text_input": PROMPT, "max_tokens": 12, "stream": True})
    assert status == 200
    events = [json.loads(line[len(b"data: "):]) for line in body.splitlines() if line.startswith(b"data: ")]
    assert all("error" not in e for e in events), events
    assert len(events) == 12
    assert "".join(e["text_output"] for e in events) == served["tok"].decode(expected)


def test_non_streaming_returns_one_response(served) -> None:
    tok, expected = served["tok"], reference(served, 10)
    status, body = http_post(served, "/v2/models/ensemble/generate",
                             {"text_input": PROMPT, "max_tokens": 10, "stream": False, "exclude_input_in_output": True})
    assert status == 200, body
    assert json.loads(body)["text_output"] == tok.decode(expected)
    # TensorRT-LLM's default keeps the prompt in non-streaming output.
    status, body = http_post(served, "/v2/models/ensemble/generate", {"text_input": PROMPT, "max_tokens": 10})
    assert status == 200, body
    assert json.loads(body)["text_output"] == tok.decode(tok.encode(PROMPT).ids + expected)
    texts, errors, _ = grpc_stream(served, 10, stream=False, exclude_input_in_output=True)
    assert (texts, errors) == ([tok.decode(expected)], [])


def test_end_id_stops_generation_and_is_not_returned(served) -> None:
    greedy = reference(served, 16)
    k = next(i for i in range(2, 16) if greedy[i] not in greedy[:i])
    texts, errors, _ = grpc_stream(served, 16, end_id=greedy[k])
    assert errors == []
    assert "".join(texts) == served["tok"].decode(greedy[:k])


def test_seeded_sampling_matches_in_process_runtime(served) -> None:
    expected = reference(served, 12, temperature=1.5, top_k=40, top_p=1.0, seed=11)
    assert expected != reference(served, 12)
    runs = [grpc_stream(served, 12, temperature=1.5, top_k=40, seed=11)[0] for _ in range(2)]
    assert runs[0] == runs[1]
    assert "".join(runs[0]) == served["tok"].decode(expected)


def test_invalid_request_gets_an_error_and_server_keeps_serving(served) -> None:
    texts, errors, _ = grpc_stream(served, 0)
    assert texts == [] and len(errors) == 1 and "request_output_len" in errors[0]
    status, body = http_post(served, "/v2/models/ensemble/generate", {"text_input": PROMPT, "max_tokens": -3})
    assert status != 200 or "error" in json.loads(body)
    assert len(grpc_stream(served, 4)[0]) == 4


def _infer(served, model: str, arrays: dict[str, np.ndarray]) -> grpcclient.InferResult:
    dtypes = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL"}
    inputs = []
    for name, data in arrays.items():
        tensor = grpcclient.InferInput(name, list(data.shape), dtypes[data.dtype])
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    with grpcclient.InferenceServerClient(served["server"].grpc_url) as client:
        return client.infer(model, inputs)


def test_each_model_handles_a_batch(served) -> None:
    tok, queries = served["tok"], ["Hi", PROMPT]
    pre = _infer(served, "preprocessing", {
        "QUERY": np.array([[q.encode()] for q in queries], dtype=object),
        "REQUEST_OUTPUT_LEN": np.array([[6], [6]], np.int32)})
    encoded = [tok.encode(q).ids for q in queries]
    ids, lengths = pre.as_numpy("INPUT_ID"), pre.as_numpy("REQUEST_INPUT_LEN")
    assert lengths.tolist() == [[len(e)] for e in encoded]
    assert ids.shape == (2, len(encoded[1]))
    pad = tok.token_to_id("<pad>")
    assert ids[0].tolist() == encoded[0] + [pad] * (len(encoded[1]) - len(encoded[0]))
    assert pre.as_numpy("OUT_END_ID").tolist() == [[served["end_id"]]] * 2  # from tokenizer_config.json
    assert pre.as_numpy("OUT_PAD_ID").tolist() == [[pad]] * 2

    out = _infer(served, "tensorrt_llm_unary", {
        "input_ids": ids, "input_lengths": lengths, "request_output_len": np.array([[6], [3]], np.int32),
        "exclude_input_in_output": np.array([[True], [True]])})
    expected = [list(generate(served["model"], e, n, served["end_id"])) for e, n in zip(encoded, (6, 3))]
    output_ids, seq_len = out.as_numpy("output_ids"), out.as_numpy("sequence_length")
    assert output_ids.shape == (2, 1, 6)
    assert seq_len.tolist() == [[len(expected[0])], [len(expected[1])]]
    assert output_ids[0, 0, :6].tolist() == expected[0]
    assert output_ids[1, 0].tolist() == expected[1] + [pad] * 3

    post = _infer(served, "postprocessing", {"TOKENS_BATCH": output_ids, "SEQUENCE_LENGTH": seq_len})
    texts = [t.decode() for t in post.as_numpy("OUTPUT").reshape(-1)]
    assert texts == [tok.decode(e) for e in expected]


def _raw_stream(served, ids: list[int], n: int, cancel_after: int | None = None) -> tuple[list[int], list[str]]:
    """(streamed ids, errors) of one streaming request straight to tensorrt_llm; `cancel_after` tokens: cancel it."""
    arrays = {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
              "request_output_len": np.array([[n]], np.int32), "end_id": np.array([[-1]], np.int32),
              "streaming": np.array([[True]])}
    inputs = []
    for name, data in arrays.items():
        tensor = grpcclient.InferInput(name, list(data.shape), "BOOL" if data.dtype == bool else "INT32")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(served["server"].grpc_url)
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), results))
    tokens, errors = [], []
    try:
        client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                errors.append(str(error))
                return tokens, errors
            if result.as_numpy("output_ids") is not None:
                tokens += result.as_numpy("output_ids").reshape(-1).tolist()
            if cancel_after is not None and len(tokens) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return tokens, errors
            if result.get_response().parameters["triton_final_response"].bool_param:
                return tokens, errors
    finally:
        client.stop_stream()
        client.close()


def test_concurrent_requests_are_batched_and_each_equals_alone(served) -> None:
    """Requests in flight together (in-flight batching) stream what each streams alone; one cancelled and one
    over-long request change nothing for the others."""
    from concurrent.futures import ThreadPoolExecutor

    tok, model = served["tok"], served["model"]
    prompts = [tok.encode(text).ids for text in CORPUS[:5]]
    budgets = [40, 12, 40, 25, 33]
    alone = [list(generate(model, p, n, end_id=-1)) for p, n in zip(prompts, budgets)]
    too_long = list(range(3, 3 + model.max_positions))
    with ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(_raw_stream, served, p, n) for p, n in zip(prompts, budgets)]
        cancelled = pool.submit(_raw_stream, served, prompts[0], 400, cancel_after=3)
        refused = pool.submit(_raw_stream, served, too_long, 4)
        got = [job.result(timeout=180) for job in jobs]
        assert len(cancelled.result(timeout=180)[0]) >= 3
        tokens, errors = refused.result(timeout=180)
    assert got == [(a, []) for a in alone]
    assert tokens == [] and len(errors) == 1 and "max_position_embeddings" in errors[0]
    assert grpc_stream(served, 4)[0] != []  # still serving


def test_streaming_throughput_tiny_model_cpu(served) -> None:
    """Not a benchmark: records tokens/s of the tiny model through the whole stack, for the report."""
    n = 64
    ids = served["tok"].encode(PROMPT).ids
    start = time.perf_counter()
    local = list(generate(served["model"], ids, n, end_id=-1))
    local_tps = len(local) / (time.perf_counter() - start)
    sent = time.perf_counter()
    texts, errors, times = grpc_stream(served, n, end_id=-1)
    assert errors == [] and len(texts) == n
    ttft_ms = (times[0] - sent) * 1000
    stream_tps = (n - 1) / (times[-1] - times[0])
    print(f"\ntiny model, CPU: in-process {local_tps:.0f} tok/s; through Triton ensemble (gRPC stream) "
          f"TTFT {ttft_ms:.1f} ms, {stream_tps:.0f} tok/s after the first token")
    assert stream_tps > 5


def _echo_repo(root: Path, model_code: str) -> Path:
    """A one-model repository whose model.py is `model_code` (no torch: starts in a few seconds)."""
    version = root / "repo" / "echo" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(model_code)
    (version.parent / "config.pbtxt").write_text(_python_config(
        "echo", [("X", "TYPE_INT32", [1])], [("X", "TYPE_INT32", [1])], {}))
    return root / "repo"


def test_local_triton_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    code = "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    server = local_triton.start(_echo_repo(tmp_path, code), local_triton.pick_free_ports(), tmp_path / "log")
    pid = server.process.pid
    assert server.stop(deadline_s=0.0) == -9  # no time for a graceful exit: the group is killed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not server.work_dir.exists()


def test_local_triton_reports_a_model_that_fails_to_load(tmp_path: Path) -> None:
    code = "raise RuntimeError('broken on purpose')\n"
    with pytest.raises(local_triton.TritonStartError, match="broken on purpose"):
        local_triton.start(_echo_repo(tmp_path, code), local_triton.pick_free_ports(), tmp_path / "log",
                           ready_timeout_s=60)


@pytest.mark.parametrize("taken", ["grpc", "metrics"])
def test_local_triton_starts_again_on_fresh_ports_when_one_is_taken_before_it_binds(tmp_path: Path, taken) -> None:
    """Seen in CI runs: another process took a picked port before tritonserver bound it (gRPC: it exits while
    starting; metrics: it exits just after answering ready)."""
    import socket

    code = "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    picked = local_triton.pick_free_ports()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("0.0.0.0", getattr(picked, taken)))
        squatter.listen()
        with local_triton.start(_echo_repo(tmp_path, code), picked, tmp_path / "log") as server:
            assert getattr(server.ports, taken) != getattr(picked, taken)
            assert server.process.poll() is None
            with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=10) as resp:
                assert resp.status == 200
    assert "already in use" in (tmp_path / "log").read_text()
