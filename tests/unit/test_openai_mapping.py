"""The OpenAI ⇄ Triton mapping (stoker.openai_api.mapping) and the build's chat template (served_model): pure."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tritonclient.grpc import service_pb2

from stoker.openai_api import mapping as m
from stoker.openai_api import triton_stream
from stoker.openai_api.served_model import (FALLBACK_CHAT_TEMPLATE, ServedModel, context_length,
                                            find_chat_template, render_chat)

TEXT = ["héllo wörld, the snow☃man says 日本語 and naïve café — twice: héllo wörld",
        "plain ascii words go here, and more words, and a few numbers 12345",
        "emoji 🎉🎉 party, ünïcödé everywhere; stop here END and after"]


def _train(pre, dec, vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre, dec
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre, pre_tokenizers.ByteLevel) else []
    tok.train_from_iterator(TEXT * 3, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                          initial_alphabet=alphabet, show_progress=False))
    return tok


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def tok(request) -> Tokenizer:
    # Small vocabularies, so that words and multi-byte characters are split across tokens.
    if request.param == "bytelevel":  # bytes as tokens (GPT-2, Llama 3)
        return _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), 280)
    return _train(pre_tokenizers.Metaspace(), decoders.Metaspace(), 90)  # leading-space marker (SentencePiece)


def _chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


# ---------------------------------------------------------------- requests


def test_valid_chat_request_and_messages():
    req = m.parse_chat(_chat(messages=[{"role": "developer", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]},
                                       {"role": "assistant", "content": None}],
                             stop="x", unknown_field=1, logprobs=False, frequency_penalty=0))
    assert m.chat_messages(req) == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                    {"role": "assistant", "content": ""}]
    assert m.stop_sequences(req) == ("x",)


@pytest.mark.parametrize("body, param, code", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "model", "missing_required_parameter"),
    ({"model": "tiny"}, "messages", "missing_required_parameter"),
    (_chat(messages=[]), "messages", "empty_array"),
    (_chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role", "invalid_value"),
    (_chat(messages=[{"role": "user"}]), "messages[0].content", "missing_required_parameter"),
    (_chat(messages=[{"role": "user", "content": 3}]), "messages[0].content", "invalid_type"),
    (_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].type", "unsupported_value"),
    (_chat(n=9), "n", "unsupported_value"),  # above mapping.MAX_CHOICES
    (_chat(n=0), "n", "invalid_value"),
    (_chat(max_tokens="8"), "max_tokens", "invalid_type"),
    (_chat(max_tokens=True), "max_tokens", "invalid_type"),
    (_chat(temperature=2.5), "temperature", "invalid_value"),
    (_chat(top_p=1.5), "top_p", "invalid_value"),
    (_chat(stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
    (_chat(stop="x" * (m.MAX_STOP_CHARS + 1)), "stop", "invalid_value"),  # issue 51: a stop's length is bound
    (_chat(stop=["ok", "y" * (m.MAX_STOP_CHARS + 1)]), "stop", "invalid_value"),
    (_chat(stream_options={"include_usage": True}), "stream_options", "invalid_value"),
    # tools are served now (tests/unit/test_openai_tools.py); OpenAI's deprecated spelling stays refused
    (_chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
    (_chat(logprobs="yes"), "logprobs", "invalid_type"),  # served now: tests/unit/test_openai_logprobs_shapes.py
    (_chat(presence_penalty=2.5), "presence_penalty", "invalid_value"),  # OpenAI's range: -2..2
    (_chat(frequency_penalty=-2.5), "frequency_penalty", "invalid_value"),
    (_chat(logit_bias={"5": 101}), "logit_bias", "invalid_value"),
])
def test_bad_chat_requests(body, param, code):
    with pytest.raises(m.ApiError) as err:
        m.parse_chat(body)
    e = err.value
    assert (e.status, e.param, e.code) == (400, param, code), e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_completion_prompts():
    one = lambda p: m.completion_prompt(m.parse_completion({"model": "tiny", "prompt": p}))  # noqa: E731
    assert one("hi") == "hi" and one(["hi"]) == "hi" and one([5, 6]) == [5, 6] and one([[5, 6]]) == [5, 6]
    for bad, code in ((["a", "b"], "unsupported_value"), (5, "invalid_type"), ([[1], [2]], "unsupported_value")):
        with pytest.raises(m.ApiError) as err:
            m.parse_completion({"model": "tiny", "prompt": bad})
        assert (err.value.param, err.value.code) == ("prompt", code)


def test_body_must_be_a_json_object():
    assert m.parse_json(b'{"a": 1}') == {"a": 1}
    for raw in (b'{"model": ', b"\xff\xfe", b"[1, 2]", b'"text"'):
        with pytest.raises(m.ApiError) as err:
            m.parse_json(raw)
        assert err.value.status == 400 and err.value.code == "invalid_json"


def test_error_bodies():
    assert m.unknown_model("gpt-4o").body() == {"error": {
        "message": "The model `gpt-4o` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert m.unknown_model("x").status == 404 and m.unavailable("down").status == 503
    assert m.backend_error("boom").status == 500


# ---------------------------------------------------------------- plan


def test_plan_defaults_and_sampling():
    chat = m.parse_chat(_chat())
    g = triton_stream.plan(chat, [1, 2, 3], 100, seed=-1)
    assert (g.max_tokens, g.greedy, g.temperature, g.top_p) == (97, False, 1.0, 1.0)
    assert g.seed == (1 << 64) - 1  # uint64 on the wire
    assert triton_stream.plan(chat, [1], None, seed=0).max_tokens == m.DEFAULT_CHAT_MAX_TOKENS
    comp = m.parse_completion({"model": "tiny", "prompt": "x", "seed": 5, "temperature": 0})
    g = triton_stream.plan(comp, [1, 2], 100, seed=9)
    assert (g.max_tokens, g.greedy, g.seed) == (16, True, 5)
    assert triton_stream.plan(comp, [1] * 95, 100, seed=0).max_tokens == 5  # the default never overruns the context
    assert triton_stream.plan(m.parse_chat(_chat(top_p=0)), [1], 10, seed=0).greedy
    both = m.parse_chat(_chat(max_tokens=3, max_completion_tokens=5))
    assert triton_stream.plan(both, [1], 10, seed=0).max_tokens == 5


@pytest.mark.parametrize("body, ids, param, code", [
    (_chat(max_tokens=0), [1], "max_tokens", "invalid_value"),
    (_chat(max_tokens=-1), [1], "max_tokens", "invalid_value"),
    (_chat(max_tokens=8), [1] * 5, "max_tokens", "context_length_exceeded"),
    (_chat(), [1] * 10, "messages", "context_length_exceeded"),
    (_chat(), [], "messages", "invalid_value"),
    ({"model": "tiny", "prompt": [1, 99]}, [1, 99], "prompt", "invalid_value"),
])
def test_plan_refusals(body, ids, param, code):
    req = m.parse_chat(body) if "messages" in body else m.parse_completion(body)
    with pytest.raises(m.ApiError) as err:
        triton_stream.plan(req, ids, 10, seed=0, vocab_size=50)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code), err.value.message


# ---------------------------------------------------------------- Triton tensors


def _inputs(r: service_pb2.ModelInferRequest) -> dict:
    kinds = {"INT32": "<i4", "FP32": "<f4", "UINT64": "<u8", "BOOL": "?"}
    return {t.name: (t.datatype, list(t.shape), np.frombuffer(raw, kinds[t.datatype]).tolist())
            for t, raw in zip(r.inputs, r.raw_input_contents)}


def test_triton_request_sampled_and_greedy():
    g = triton_stream.Generation((1, 5, 7), 12, False, 0.7, 0.9, 42, ("x",))
    r = triton_stream.triton_request(g, "req-1")
    assert (r.model_name, r.id) == ("tensorrt_llm", "req-1")
    got = _inputs(r)
    assert got["input_ids"] == ("INT32", [1, 3], [1, 5, 7])
    assert got["input_lengths"] == ("INT32", [1, 1], [3])
    assert got["request_output_len"] == ("INT32", [1, 1], [12])
    assert got["streaming"] == ("BOOL", [1, 1], [True])
    assert got["seed"] == ("UINT64", [1, 1], [42])
    assert got["temperature"][2] == pytest.approx([0.7]) and got["runtime_top_p"][2] == pytest.approx([0.9])
    # Stop sequences are matched on text here; the build's own end and stop ids stay its defaults.
    assert not {"end_id", "pad_id", "stop_words_list"} & set(got)
    assert [o.name for o in r.outputs] == ["output_ids"]
    assert r.parameters["triton_enable_empty_final_response"].bool_param
    greedy = _inputs(triton_stream.triton_request(triton_stream.Generation((1,), 4, True, 1.0, 1.0, 0, ()), "g"))
    assert "temperature" not in greedy and "runtime_top_p" not in greedy  # no top-k/top-p: greedy


def test_min_tokens_and_ignore_eos():
    """vLLM's extra fields: min_tokens holds the end id back; ignore_eos holds it back for all of max_tokens."""
    def plan(**kw):
        return triton_stream.plan(m.parse_completion({"model": "tiny", "prompt": "x", **kw}), [1, 2], 100, seed=0)

    assert plan(max_tokens=8).min_tokens == 0
    assert plan(max_tokens=8, min_tokens=5).min_tokens == 5
    assert plan(max_tokens=8, ignore_eos=True).min_tokens == 8
    assert plan(max_tokens=8, ignore_eos=True, min_tokens=3).min_tokens == 8
    assert plan(ignore_eos=True).min_tokens == m.DEFAULT_COMPLETION_MAX_TOKENS  # the default length, filled first
    eos = m.parse_chat(_chat(max_completion_tokens=6, ignore_eos=True))
    assert triton_stream.plan(eos, [1], 100, seed=0).min_tokens == 6
    for kw, code in (({"min_tokens": 9, "max_tokens": 8}, "invalid_value"), ({"min_tokens": -1}, "invalid_value")):
        with pytest.raises(m.ApiError) as err:
            plan(**kw)
        assert (err.value.status, err.value.param, err.value.code) == (400, "min_tokens", code)
    with pytest.raises(m.ApiError) as err:
        m.parse_completion({"model": "tiny", "prompt": "x", "ignore_eos": "yes"})
    assert err.value.param == "ignore_eos"
    # On the wire: the model's own min_tokens input, only when asked (absent means 0 to tensorrt_llm).
    asked = _inputs(triton_stream.triton_request(plan(max_tokens=8, ignore_eos=True), "r"))
    assert asked["min_tokens"] == ("INT32", [1, 1], [8])
    assert "min_tokens" not in _inputs(triton_stream.triton_request(plan(max_tokens=8), "r"))


def _response(ids=None, final=False, error="", length=None) -> service_pb2.ModelStreamInferResponse:
    resp = service_pb2.ModelStreamInferResponse(error_message=error)
    r = resp.infer_response
    if ids is not None:
        out = r.outputs.add()
        out.name, out.datatype = "output_ids", "INT32"
        out.shape.extend([1, 1, len(ids)])
        r.raw_output_contents.append(np.asarray(ids, "<i4").tobytes())
    if length is not None:
        out = r.outputs.add()
        out.name, out.datatype = "sequence_length", "INT32"
        out.shape.extend([1, 1])
        r.raw_output_contents.append(np.asarray([length], "<i4").tobytes())
    r.parameters["triton_final_response"].bool_param = final
    return resp


def test_parse_response():
    assert triton_stream.parse_response(_response([17])) == triton_stream.Step((17,), False)
    assert triton_stream.parse_response(_response(final=True)) == triton_stream.Step((), True)
    assert triton_stream.parse_response(_response([4, 5, 0], length=2)) == triton_stream.Step((4, 5), False)
    assert triton_stream.parse_response(_response(error="boom")) == triton_stream.Step((), True, "boom")


# ---------------------------------------------------------------- text


def _stream(tok: Tokenizer, ids: list[int], stop=()) -> tuple[list[str], triton_stream.TextStream]:
    ts = triton_stream.TextStream(lambda x: tok.decode(x, skip_special_tokens=True), stop)
    pieces = [ts.push(i) for i in ids]
    pieces.append(ts.flush())
    return pieces, ts


def test_incremental_text_equals_whole_decode(tok):
    for line in TEXT:
        ids = tok.encode(line).ids
        pieces, _ = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces)  # a character split across tokens comes out whole
    rng = random.Random(0)
    for _ in range(20):  # random ids: whatever the ids, the stream says what a full decode says
        ids = [rng.randrange(tok.get_vocab_size()) for _ in range(30)]
        assert "".join(_stream(tok, ids)[0]) == tok.decode(ids)


def test_special_tokens_are_not_text(tok):
    ids = tok.encode("plain ascii words").ids + [tok.token_to_id("</s>")]
    assert "".join(_stream(tok, ids)[0]) == tok.decode(ids, skip_special_tokens=True)


def test_stop_sequences(tok):
    line = TEXT[2]
    ids = tok.encode(line).ids
    pieces, ts = _stream(tok, ids, stop=("END", "never"))
    assert "".join(pieces) == line[: line.index("END")] and ts.stopped
    # Nothing of a stop sequence is sent before it is known not to be one.
    pieces, ts = _stream(tok, tok.encode("stop here END").ids[:-1], stop=("ENDX",))
    assert "".join(pieces) == tok.decode(tok.encode("stop here END").ids[:-1]) and not ts.stopped
    # A stop sequence spanning tokens and multi-byte characters.
    pieces, ts = _stream(tok, tok.encode(TEXT[0]).ids, stop=("☃ma",))
    assert "".join(pieces) == TEXT[0][: TEXT[0].index("☃ma")] and ts.stopped
    assert ts.push(5) == "" and ts.flush() == ""  # after a stop, nothing more


def test_finish_reason():
    assert triton_stream.finish_reason(False, 8, 8) == "length"
    assert triton_stream.finish_reason(False, 3, 8) == "stop"  # an end id or stop id ended it
    assert triton_stream.finish_reason(True, 8, 8) == "stop"


# ---------------------------------------------------------------- responses


def test_response_shapes():
    head = m.Head("chatcmpl-1", 100, "tiny", "fp_abc")
    use = m.usage(3, 2)
    assert use == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    body = m.chat_response(head, "hey", "stop", use)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hey"
    chunk = m.chat_chunk(head, {"content": "h"}, None, with_usage=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert "usage" not in m.chat_chunk(head, {}, "stop", with_usage=False)
    assert m.usage_chunk(head, "text_completion", use)["choices"] == []
    assert m.completion_response(head, "x", "length", use)["choices"][0]["text"] == "x"
    raw = m.sse(m.completion_chunk(head, "ü", None, False))
    assert raw.startswith(b"data: {") and raw.endswith(b"\n\n") and json.loads(raw[6:])["choices"][0]["text"] == "ü"
    assert m.DONE == b"data: [DONE]\n\n"


# ---------------------------------------------------------------- the build's files


def test_chat_template_sources(tmp_path):
    assert find_chat_template(tmp_path) == (None, "none")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert find_chat_template(tmp_path) == ("D", "tokenizer_config.json")
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert find_chat_template(tmp_path) == ("J", "chat_template.json")
    (tmp_path / "chat_template.jinja").write_text("F")
    assert find_chat_template(tmp_path) == ("F", "chat_template.jinja")
    assert context_length({"max_position_embeddings": 2048}) == 2048 and context_length({}) is None


def test_fallback_template_and_template_errors(tmp_path):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert render_chat(FALLBACK_CHAT_TEMPLATE, msgs, {}) == "system: s\nuser: u\nassistant:"
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(m.ApiError) as err:
        render_chat(strict, msgs, {})
    assert err.value.status == 400 and "first must be user" in err.value.message


def test_served_model_prompt_ids(tmp_path, tok):
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "vocab_size": 512}))
    model = ServedModel.load(tmp_path, "a" * 64)
    assert (model.context_len, model.vocab_size, model.fingerprint) == (64, 512, "fp_aaaaaaaaaaaa")
    msgs = [{"role": "user", "content": "plain ascii"}]
    assert model.chat_ids(msgs) == tok.encode("user: plain ascii\nassistant:").ids
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}[{{ messages[0]['content'] }}]{{ eos_token }}")
    model = ServedModel.load(tmp_path)
    # The template writes the special tokens itself, so they are not added again.
    assert model.chat_ids(msgs) == tok.encode("<s>[plain ascii]</s>", add_special_tokens=False).ids
    assert model.card()["chat_template"] == "chat_template.jinja"


def test_the_deployed_builds_limits_bound_prompts_not_the_models_training_context(tmp_path, tok):
    # An engine built with max_seq_len 48 / max_input_len 20 of a model trained for 64 positions: the service
    # answers a 400 for what the engine would fail on, from the limits file the package step writes.
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    (tmp_path / "stoker_limits.json").write_text(json.dumps({"max_seq_len": 48, "max_input_len": 20}))
    model = ServedModel.load(tmp_path)
    assert (model.context_len, model.max_input_len) == (48, 20)
    comp = m.parse_completion({"model": "tiny", "prompt": "x", "max_tokens": 8})
    assert triton_stream.plan(comp, [1] * 20, model.context_len, seed=0, max_input_len=20).max_tokens == 8
    with pytest.raises(m.ApiError) as err:
        triton_stream.plan(comp, [1] * 21, model.context_len, seed=0, max_input_len=20)
    assert (err.value.status, err.value.code) == (400, "context_length_exceeded") and "at most 20" in err.value.message
    with pytest.raises(m.ApiError):  # 30 + 20 > 48, though < 64
        triton_stream.plan(m.parse_completion({"model": "tiny", "prompt": "x", "max_tokens": 30}), [1] * 20, 48,
                           seed=0, max_input_len=20)


def test_live_model_follows_live_json(tmp_path, tok):
    import asyncio

    from stoker.openai_api.served_model import LIVE_FILE, LiveModel

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        tok.save(str(tmp_path / name / "tokenizer.json"))
    (tmp_path / "b" / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]")
    live = LiveModel(state=tmp_path)

    def get():
        return asyncio.run(live.get())

    with pytest.raises(m.ApiError) as err:
        get()
    assert err.value.status == 503 and "no build is live" in err.value.message
    (tmp_path / LIVE_FILE).write_text(json.dumps({"error": "the tokenizer files of X could not be fetched: boom"}))
    with pytest.raises(m.ApiError) as err:
        get()
    assert err.value.status == 503 and "boom" in err.value.message
    (tmp_path / LIVE_FILE).write_text(json.dumps({"assets": "a", "digest": "a" * 64}))
    first = get()
    assert (first.key, first.template_source) == ("a" * 64, "none") and get() is first  # not reloaded
    (tmp_path / LIVE_FILE).write_text(json.dumps({"assets": "b", "digest": "b" * 64, "backend": "x"}))
    assert (get().key, get().template_source) == ("b" * 64, "chat_template.jinja")
