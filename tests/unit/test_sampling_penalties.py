"""Presence / frequency penalties and the embedding bias (OpenAI's logit_bias) in the reference runtime, against an
independent computation with torch over the model's own full-forward logits (TensorRT-LLM's kernel semantics:
stoker/runtime/generate.py's docstring)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

import httpx  # noqa: E402
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from test_reference_top_log_probs import _Request, _Sender, served  # noqa: E402,F401 -- the installed model.py
from test_runtime import NO_END, PROMPT, hf_model, our_logits, write_artifact  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

from scripted_triton import ScriptedCall, scripted_triton

from stoker.openai_api import app as app_module  # noqa: E402
from stoker.openai_api import choices  # noqa: E402
from stoker.openai_api import mapping as m  # noqa: E402
from stoker.openai_api import triton_stream  # noqa: E402
from stoker.openai_api.served_model import LiveModel  # noqa: E402
from stoker.runtime.generate import Record, generate  # noqa: E402
from stoker.runtime.model import load_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return load_model(write_artifact(hf_model(), tmp_path_factory.mktemp("artifact")), num_threads=2)


def expected_rows(model, prompt: list[int], generated: list[int], presence: float, frequency: float,
                  bias: torch.Tensor | None, temperature: float | None) -> list[torch.Tensor]:
    """Per generated token, the log-softmax row it was chosen from, computed afresh: the full forward's logits of
    everything before it, plus the bias, over the temperature (None: greedy), less the penalties over the counts of
    the prompt and the tokens generated so far."""
    logits = our_logits(model, prompt + generated)  # row j: the logits after token j
    rows = []
    for i in range(len(generated)):
        z = logits[len(prompt) - 1 + i].double()
        if bias is not None:
            z = z + bias.double()
        if temperature is not None:
            z = z / temperature
        counts = torch.bincount(torch.tensor(prompt + generated[:i]), minlength=model.vocab_size).double()
        z = z - presence * (counts > 0).double() - frequency * counts
        rows.append(torch.log_softmax(z, dim=-1))
    return rows


def test_greedy_penalties_change_the_logits_exactly_as_defined(ours) -> None:
    record = Record()
    got = list(generate(ours, PROMPT, 12, end_id=NO_END, presence_penalty=0.7, frequency_penalty=0.4, record=record))
    rows = expected_rows(ours, PROMPT, got, 0.7, 0.4, None, None)
    assert got == [int(torch.argmax(r)) for r in rows]
    assert record.log_probs == pytest.approx([float(r[t]) for r, t in zip(rows, got)], abs=TOL)
    # The penalties matter: they change the greedy output of this prompt (42 repeats in it).
    assert got != list(generate(ours, PROMPT, 12, end_id=NO_END))


def test_sampled_penalties_come_after_the_temperature(ours) -> None:
    bias = torch.linspace(-1.0, 1.0, ours.vocab_size)
    record = Record()
    got = list(generate(ours, PROMPT, 10, end_id=NO_END, temperature=0.7, top_k=0, seed=3, presence_penalty=-0.5,
                        frequency_penalty=1.2, embedding_bias=bias, record=record))
    rows = expected_rows(ours, PROMPT, got, -0.5, 1.2, bias, 0.7)
    assert record.log_probs == pytest.approx([float(r[t]) for r, t in zip(rows, got)], abs=TOL)


def test_seed_reproduces_a_penalised_sample(ours) -> None:
    kwargs = dict(end_id=NO_END, temperature=1.0, top_k=0, presence_penalty=0.5, frequency_penalty=0.5)
    first = list(generate(ours, PROMPT, 12, seed=11, **kwargs))
    assert list(generate(ours, PROMPT, 12, seed=11, **kwargs)) == first
    assert any(list(generate(ours, PROMPT, 12, seed=s, **kwargs)) != first for s in (12, 13, 14))


def test_bias_minus_100_bans_and_plus_100_forces_a_token(ours) -> None:
    plain = list(generate(ours, PROMPT, 8, end_id=NO_END))
    banned = torch.zeros(ours.vocab_size)
    banned[plain[0]] = -100.0
    got = list(generate(ours, PROMPT, 8, end_id=NO_END, embedding_bias=banned))
    assert plain[0] not in got
    forced = torch.zeros(ours.vocab_size)
    forced[777] = 100.0
    assert list(generate(ours, PROMPT, 8, end_id=NO_END, embedding_bias=forced)) == [777] * 8
    sampled = generate(ours, PROMPT, 8, end_id=NO_END, temperature=1.0, top_k=0, seed=1, embedding_bias=forced)
    assert list(sampled) == [777] * 8


def test_off_values_leave_greedy_output_as_it_was(ours) -> None:
    plain_record, off_record = Record(), Record()
    plain = list(generate(ours, PROMPT, 12, end_id=NO_END, record=plain_record))
    off = list(generate(ours, PROMPT, 12, end_id=NO_END, presence_penalty=0.0, frequency_penalty=0.0,
                        embedding_bias=torch.zeros(ours.vocab_size), record=off_record))
    assert off == plain and off_record.log_probs == plain_record.log_probs


def test_in_the_in_flight_batch_each_sequence_keeps_its_own_penalties_and_bias(ours) -> None:
    """A penalised, a biased and a plain sequence decoded together give what each gives alone (greedy)."""
    from stoker.runtime.batch import Batcher

    bias = torch.zeros(ours.vocab_size)
    bias[5] = 4.0
    asks = [{"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"embedding_bias": bias}, {}]
    alone = [list(generate(ours, PROMPT, 10, end_id=NO_END, **kw)) for kw in asks]
    batcher = Batcher(ours, max_batch=3).start()
    try:
        streams = [batcher.submit(PROMPT, 10, NO_END, **kw) for kw in asks]
        assert [list(s) for s in streams] == alone
    finally:
        batcher.stop()
    assert len({tuple(a) for a in alone}) == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"embedding_bias": [0.0] * 5}, "embedding_bias has 5 values"),
    ({"embedding_bias": [float("nan")] * 2048}, "not finite"),
    ({"presence_penalty": float("inf")}, "presence_penalty must be finite"),
])
def test_invalid_bias_or_penalty_fails_before_compute(ours, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        generate(ours, PROMPT, 4, end_id=NO_END, **kwargs)


# ---------------------------------------------------------------- the OpenAI service: requests and their 400s

WORDS = ["<unk>", "<s>", "</s>", "user", ":", "assistant", "hi", "red", "green", "blue", "sky", "is"]
VOCAB = len(WORDS)


def _chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


def _cmpl(**kw) -> dict:
    return {"model": "tiny", "prompt": "hi", **kw}


def _gens(body: dict, interface: str = triton_stream.ENSEMBLE, seed: int = 100) -> list[triton_stream.Generation]:
    req = m.parse_chat(body) if "messages" in body else m.parse_completion(body)
    gen = triton_stream.plan(req, [1, 6], 64, seed=seed, interface=interface, prompt_text="hi")
    return choices.generations(req, gen, VOCAB, interface)


def _inputs(r) -> dict:
    kinds = {"INT32": "<i4", "FP32": "<f4", "UINT64": "<u8", "BOOL": "?"}
    return {t.name: (list(t.shape), np.frombuffer(raw, kinds[t.datatype]).tolist())
            for t, raw in zip(r.inputs, r.raw_input_contents) if t.datatype in kinds}


@pytest.mark.parametrize("body, param, code", [
    (_chat(presence_penalty=2.01), "presence_penalty", "invalid_value"),
    (_cmpl(frequency_penalty=-3), "frequency_penalty", "invalid_value"),
    (_chat(frequency_penalty="a lot"), "frequency_penalty", "invalid_value"),
    (_chat(logit_bias={"7": 100.5}), "logit_bias", "invalid_value"),
    (_chat(logit_bias={"red": 5}), "logit_bias", "invalid_value"),  # a key must be a token id
    (_chat(logit_bias={"-1": 5}), "logit_bias", "invalid_value"),
    (_cmpl(logit_bias={str(VOCAB): 5}), "logit_bias", "invalid_value"),  # outside the vocabulary
    (_chat(logit_bias=[7]), "logit_bias", "invalid_type"),
    (_chat(n=0), "n", "invalid_value"),
    (_cmpl(n=m.MAX_CHOICES + 1), "n", "unsupported_value"),
    (_chat(n="2"), "n", "invalid_type"),
])
def test_bad_sampling_requests_are_one_line_400s_naming_the_field(body, param, code):
    with pytest.raises(m.ApiError) as err:
        _gens(body)
    e = err.value
    assert (e.status, e.param, e.code, e.type) == (400, param, code, "invalid_request_error"), e.message
    assert "\n" not in e.message and param in e.message


def test_the_llm_api_target_takes_the_penalties_and_refuses_logit_bias():
    with pytest.raises(m.ApiError) as err:
        _gens(_chat(logit_bias={"7": 1}), triton_stream.LLMAPI)
    assert (err.value.status, err.value.param, err.value.code) == (400, "logit_bias", "unsupported_parameter")
    gen = _gens(_chat(presence_penalty=0.5, frequency_penalty=-1.5, temperature=0.8), triton_stream.LLMAPI)[0]
    sent = _inputs(triton_stream.llmapi_request(gen, "r"))
    assert sent["sampling_param_presence_penalty"] == ([1], [0.5])
    assert sent["sampling_param_frequency_penalty"] == ([1], [-1.5])
    plain = _inputs(triton_stream.llmapi_request(_gens(_chat(temperature=0.8), triton_stream.LLMAPI)[0], "r"))
    assert not {"sampling_param_presence_penalty", "sampling_param_frequency_penalty"} & set(plain)


def test_the_triton_request_carries_tensorrt_llms_inputs_with_their_types_and_shapes():
    gen = _gens(_chat(presence_penalty=0.5, frequency_penalty=1.25, logit_bias={"7": -100, "9": 2.5}))[0]
    r = triton_stream.triton_request(gen, "a")
    types = {t.name: t.datatype for t in r.inputs}
    assert types["presence_penalty"] == types["frequency_penalty"] == types["embedding_bias"] == "FP32"
    sent = _inputs(r)
    assert sent["presence_penalty"] == ([1, 1], [0.5]) and sent["frequency_penalty"] == ([1, 1], [1.25])
    shape, bias = sent["embedding_bias"]
    assert shape == [1, VOCAB] and bias[7] == -100 and bias[9] == 2.5 and sum(map(abs, bias)) == 102.5
    assert types["seed"] == "UINT64" and sent["seed"] == ([1, 1], [100])
    plain = _inputs(triton_stream.triton_request(_gens(_chat(presence_penalty=0, logit_bias={}))[0], "b"))
    assert not {"presence_penalty", "frequency_penalty", "embedding_bias"} & set(plain)


def test_each_choice_samples_with_seed_plus_its_index():
    assert [g.seed for g in _gens(_chat(n=3), seed=100)] == [100, 101, 102]  # no seed: the drawn one, + index
    seeded = _gens(_chat(n=4, seed=7, presence_penalty=1.0), seed=123)
    assert [g.seed for g in seeded] == [7, 8, 9, 10] and {g.presence_penalty for g in seeded} == {1.0}
    assert [g.seed for g in _gens(_chat(n=2, seed=(1 << 64) - 1))] == [(1 << 64) - 1, 0]  # UINT64 wraps
    assert len(_gens(_chat())) == 1


# ---------------------------------------------------------------- the OpenAI service: n choices, over a scripted Triton

TOKENS = [7, 8, 9, 10]  # red green blue sky


def _response(ids: list[int], scores: list[float] | None = None, final: bool = False):
    from tritonclient.grpc import service_pb2

    resp = service_pb2.ModelStreamInferResponse()
    r = resp.infer_response
    for name, datatype, raw, n in (("output_ids", "INT32", np.asarray(ids, "<i4").tobytes(), len(ids)),
                                   ("output_log_probs", "FP32", np.asarray(scores or [], "<f4").tobytes(),
                                    len(scores or []))):
        if name == "output_ids" and not ids or name == "output_log_probs" and scores is None:
            continue
        out = r.outputs.add()
        out.name, out.datatype = name, datatype
        out.shape.extend([1, 1, n])
        r.raw_output_contents.append(raw)
    r.parameters["triton_final_response"].bool_param = final
    return resp


def _scripted(request) -> list:
    """As the reference model streams a sampled answer: the tokens depend on the seed (greedy ones do not), one
    response per token, its log prob when asked; seed % 3 tokens, so choices end at different lengths."""
    inputs = _inputs(request)
    seed = inputs["seed"][1][0]
    greedy = "temperature" not in inputs
    n = 4 if greedy else 1 + seed % 3
    tokens = TOKENS[:n] if greedy else [TOKENS[(seed + j) % 4] for j in range(n)]
    scored = "return_log_probs" in inputs
    return [_response([t], [-0.5 * (j + 1)] if scored else None) for j, t in enumerate(tokens)] + [
        _response([], final=True)]


# What the app asks of Triton: streams, and the model's declared outputs.
_Triton = scripted_triton(_scripted, frozenset({"output_ids", "output_log_probs"}))


@pytest.fixture
def client(tmp_path, monkeypatch):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "max_position_embeddings": 64}))
    monkeypatch.setattr(app_module, "Triton", _Triton)
    monkeypatch.setattr(_Triton, "requests", [])
    app = app_module.create_app(app_module.Settings("tiny", "unused:0"), LiveModel(folder=tmp_path))
    transport = httpx.ASGITransport(app=app)
    http = httpx.AsyncClient(transport=transport, base_url="http://test/v1")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", max_retries=0, http_client=http), http


def _words(seed: int) -> str:
    return " ".join(WORDS[TOKENS[(seed + j) % 4]] for j in range(1 + seed % 3))


def test_n_chat_choices_each_with_its_seed_in_one_body(client):
    oai, http = client
    raw = asyncio.run(http.post("/chat/completions", json=_chat(n=3, seed=5, temperature=1, logprobs=True,
                                                                logit_bias={"8": 3})))
    body = ChatCompletion.model_validate(raw.json())
    assert [c.index for c in body.choices] == [0, 1, 2]
    assert [c.message.content for c in body.choices] == [_words(5), _words(6), _words(7)]
    assert [len(c.logprobs.content) for c in body.choices] == [3, 1, 2]
    prompt = _inputs(_Triton.requests[0])["input_lengths"][1][0]  # counted once, not per choice
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (prompt, 6, prompt + 6)
    assert [c.finish_reason for c in body.choices] == ["stop"] * 3
    sent = [_inputs(r) for r in _Triton.requests]
    assert [s["seed"][1] for s in sent] == [[5], [6], [7]] and all(s["embedding_bias"][1][8] == 3 for s in sent)
    assert len({r.id for r in _Triton.requests}) == 3  # each choice its own Triton request (its own sequence)
    # The seed reproduces every choice.
    again = asyncio.run(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                                    seed=5, temperature=1))
    assert [c.message.content for c in again.choices] == [c.message.content for c in body.choices]


def test_greedy_n_gives_n_equal_choices(client):
    oai, _ = client
    out = asyncio.run(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                                  temperature=0, max_tokens=4))
    assert [c.message.content for c in out.choices] == ["red green blue sky"] * 2
    assert [c.finish_reason for c in out.choices] == ["length"] * 2 and out.usage.completion_tokens == 8


def test_n_chat_choices_stream_by_index_and_the_client_assembles_them(client):
    oai, _ = client

    async def go():
        stream = await oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                                   seed=5, temperature=1, logprobs=True, stream=True,
                                                   stream_options={"include_usage": True})
        return [c async for c in stream]

    chunks = asyncio.run(go())
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    assert [c.index for c in final.choices] == [0, 1, 2]
    assert [c.message.content for c in final.choices] == [_words(5), _words(6), _words(7)]
    assert [[t.logprob for t in c.logprobs.content] for c in final.choices] == [[-0.5, -1.0, -1.5], [-0.5],
                                                                                [-0.5, -1.0]]
    assert [c.finish_reason for c in final.choices] == ["stop"] * 3
    assert all(len(c.choices) == 1 for c in chunks[:-1])  # one choice per chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]


def test_n_completions_streamed_and_not(client):
    oai, http = client
    raw = asyncio.run(http.post("/completions", json=_cmpl(n=2, seed=1, temperature=1, logprobs=0)))
    body = Completion.model_validate(raw.json())
    assert [(c.index, c.text) for c in body.choices] == [(0, _words(1)), (1, _words(2))]
    assert [c.logprobs.token_logprobs for c in body.choices] == [[-0.5, -1.0], [-0.5, -1.0, -1.5]]
    assert [c.logprobs.text_offset for c in body.choices] == [[0, 5], [0, 4, 7]]  # logprobs.py's offsets, per choice
    assert body.usage.completion_tokens == 5

    async def go():
        stream = await oai.completions.create(model="tiny", prompt="hi", n=2, seed=1, temperature=1, logprobs=0,
                                              stream=True)
        return [c async for c in stream]

    texts, offsets, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in asyncio.run(go()):
        assert isinstance(chunk, Completion)  # as the client parsed it (a chunk's finish_reason is None until its end)
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.logprobs is not None:
            offsets[choice.index] += choice.logprobs.text_offset
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert texts == {0: _words(1), 1: _words(2)} and offsets == {0: [0, 5], 1: [0, 4, 7]}
    assert finish == {0: "stop", 1: "stop"}


def test_n_is_refused_before_any_stream_opens(client):
    oai, _ = client
    with pytest.raises(openai.BadRequestError) as err:
        asyncio.run(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=9))
    assert err.value.body["param"] == "n" and not _Triton.requests
    with pytest.raises(openai.BadRequestError) as err:
        asyncio.run(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                                logit_bias={"12": 1}))
    assert err.value.body["param"] == "logit_bias" and not _Triton.requests


# ---------------------------------------------------------------- the reference `tensorrt_llm` model reads them


def _model_request(n: int, streaming: bool = False, **extra) -> _Request:
    return _Request(input_ids=np.array([PROMPT], np.int32), input_lengths=np.array([[len(PROMPT)]], np.int32),
                    request_output_len=np.array([[n]], np.int32), streaming=np.array([[streaming]]),
                    end_id=np.array([[NO_END]], np.int32), **extra)


def test_the_reference_model_reads_tensorrt_llms_penalty_and_bias_inputs(served):  # noqa: F811
    module, triton, _ = served
    bias = np.zeros((1, 2048), np.float32)
    bias[0, 777] = 100.0
    request = _model_request(5, presence_penalty=np.array([[0.25]], np.float32),
                             frequency_penalty=np.array([[-0.5]], np.float32), embedding_bias=bias)
    (job,) = module._parse(request, (NO_END, 0, []), True, {})
    assert job.kwargs["presence_penalty"] == 0.25 and job.kwargs["frequency_penalty"] == -0.5
    assert job.kwargs["embedding_bias"].tolist() == bias[0].tolist()
    out = {t.name: t.value for t in triton._full_output(request, [job])}
    assert out["output_ids"].reshape(-1).tolist() == [777] * 5
    sender = _Sender()
    triton._stream(request, module._parse(_model_request(3, True, embedding_bias=bias), (NO_END, 0, []), True,
                                          {})[0], sender)
    assert [int(r.tensors["output_ids"].reshape(-1)[0]) for r in sender.responses] == [777] * 3
    plain = module._parse(_model_request(5), (NO_END, 0, []), True, {})[0].kwargs
    assert (plain["presence_penalty"], plain["frequency_penalty"], plain["embedding_bias"]) == (0.0, 0.0, None)


def test_the_reference_model_refuses_a_bias_of_the_wrong_shape(served):  # noqa: F811
    module, triton, _ = served
    with pytest.raises(module.RequestError, match="embedding_bias has shape"):
        module._parse(_model_request(2, embedding_bias=np.zeros((2, 2048), np.float32)), (NO_END, 0, []), True, {})
    request = _model_request(2, embedding_bias=np.zeros((1, 5), np.float32))
    with pytest.raises(module.RequestError, match="embedding_bias has 5 values"):
        triton._full_output(request, module._parse(request, (NO_END, 0, []), True, {}))


def test_the_llmapi_stand_in_hands_the_penalties_to_the_runtime(monkeypatch):
    """The pytorch target's CPU stand-in (STAND-IN, not TensorRT-LLM) serves what the service now sends it."""
    import importlib.util
    import sys
    from pathlib import Path

    from test_reference_top_log_probs import _pb_utils

    import stoker.triton.models as models

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    monkeypatch.setattr(sys, "path", list(sys.path))  # the model puts its own folder first
    spec = importlib.util.spec_from_file_location("llmapi_standin", Path(models.__file__).parent / "llmapi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    got = module._runtime_kwargs({"frequency_penalty": 0.5, "presence_penalty": -1.0, "top_k": 1})
    assert (got["frequency_penalty"], got["presence_penalty"]) == (0.5, -1.0)
    assert module._runtime_kwargs({})["presence_penalty"] == 0.0
    with pytest.raises(module.RequestError, match="best_of"):
        module._runtime_kwargs({"best_of": 2})


def test_a_choice_that_fails_fails_the_answer_and_closes_the_others(client, monkeypatch):
    from tritonclient.grpc import service_pb2

    oai, http = client
    calls: list[ScriptedCall] = []

    def stream(self, request, authorization=None):
        type(self).requests.append(request)
        responses = _scripted(request)
        if _inputs(request)["seed"][1][0] == 41:  # choice 1 of seed 40: its second response is the backend's error
            failed = service_pb2.ModelStreamInferResponse(error_message="boom")
            responses = responses[:1] + [failed]
        calls.append(ScriptedCall(responses))
        return calls[-1]

    monkeypatch.setattr(_Triton, "stream", stream)
    whole = asyncio.run(http.post("/chat/completions", json=_chat(n=3, seed=40, temperature=1)))
    assert whole.status_code == 500 and "boom" in whole.json()["error"]["message"]
    assert all(call.done() for call in calls)
    streamed = asyncio.run(http.post("/chat/completions", json=_chat(n=3, seed=40, temperature=1, stream=True)))
    events = [line.removeprefix("data: ") for line in streamed.text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and "boom" in json.loads(events[-2])["error"]["message"]
