"""Log probs in the OpenAI service: bad input refused before any token, the per-target refusals, the Triton request
and responses, and the bodies the official `openai` client parses, streamed and not (the app over a scripted
Triton; values against transformers: tests/unit/test_logprobs.py and tests/integration/test_openai_logprobs.py)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from tritonclient.grpc import service_pb2

openai = pytest.importorskip("openai")
import httpx

from scripted_triton import scripted_triton

from stoker.openai_api import app as app_module
from stoker.openai_api import logprobs as lp
from stoker.openai_api import mapping as m
from stoker.openai_api import triton_stream
from stoker.openai_api.served_model import LiveModel
from stoker.openai_api.token_bytes import TokenBytes, byte_level_alphabet

WORDS = ["<unk>", "<s>", "</s>", "user", ":", "assistant", "hi", "red", "green", "blue", "sky", "is"]


def _chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


def _cmpl(**kw) -> dict:
    return {"model": "tiny", "prompt": "hi", **kw}


def _plan(body: dict, interface: str = triton_stream.ENSEMBLE) -> triton_stream.Generation:
    req = m.parse_chat(body) if "messages" in body else m.parse_completion(body)
    return triton_stream.plan(req, [1, 6], 64, seed=0, interface=interface, prompt_text="hi")


# ---------------------------------------------------------------- requests


def test_what_a_request_asks_for():
    assert _plan(_chat()).log_probs is None
    assert _plan(_chat(logprobs=False, top_logprobs=0)).log_probs is None
    assert _plan(_chat(logprobs=True)).log_probs == 0
    assert _plan(_chat(logprobs=True, top_logprobs=20)).log_probs == 20
    assert _plan(_cmpl()).log_probs is None
    assert _plan(_cmpl(logprobs=0)).log_probs == 0 and _plan(_cmpl(logprobs=5)).log_probs == 5


@pytest.mark.parametrize("body, param, code", [
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs", "invalid_value"),
    (_chat(logprobs=True, top_logprobs=-1), "top_logprobs", "invalid_value"),
    (_chat(logprobs=True, top_logprobs="3"), "top_logprobs", "invalid_type"),
    (_chat(logprobs=True, top_logprobs=2.5), "top_logprobs", "invalid_type"),
    (_chat(top_logprobs=3), "top_logprobs", "invalid_value"),  # without logprobs: true
    (_chat(logprobs=False, top_logprobs=3), "top_logprobs", "invalid_value"),
    (_chat(logprobs=1), "logprobs", "invalid_type"),
    (_cmpl(logprobs=6), "logprobs", "invalid_value"),
    (_cmpl(logprobs=-1), "logprobs", "invalid_value"),
    (_cmpl(logprobs=True), "logprobs", "invalid_type"),
    (_cmpl(logprobs="2"), "logprobs", "invalid_type"),
])
def test_bad_log_prob_requests_are_400s_naming_the_field(body, param, code):
    with pytest.raises(m.ApiError) as err:
        _plan(body)
    e = err.value
    assert (e.status, e.param, e.code, e.type) == (400, param, code, "invalid_request_error"), e.message
    assert "\n" not in e.message and param in e.message


def test_the_llm_api_target_refuses_any_log_probs_and_the_engine_target_alternatives():
    for body in (_chat(logprobs=True), _chat(logprobs=True, top_logprobs=2), _cmpl(logprobs=0)):
        with pytest.raises(m.ApiError) as err:
            _plan(body, triton_stream.LLMAPI)
        assert (err.value.status, err.value.param, err.value.code) == (400, "logprobs", "unsupported_parameter")
        assert "cumulative" in err.value.message
    assert _plan(_chat(), triton_stream.LLMAPI).log_probs is None  # not asked: served as before
    chat, cmpl = m.parse_chat(_chat(logprobs=True, top_logprobs=3)), m.parse_completion(_cmpl(logprobs=2))
    assert lp.refusal(chat, 3, llmapi=False, top_served=True) is None  # the reference model
    assert lp.refusal(chat, 0, llmapi=False, top_served=False) is None  # the engine: the sampled token's only
    assert lp.refusal(cmpl, 0, llmapi=False, top_served=False) is None
    for req, k, param in ((chat, 3, "top_logprobs"), (cmpl, 2, "logprobs")):
        e = lp.refusal(req, k, llmapi=False, top_served=False)
        assert (e.status, e.param, e.code) == (400, param, "unsupported_value") and "output_log_probs" in e.message


# ---------------------------------------------------------------- Triton


def _inputs(r: service_pb2.ModelInferRequest) -> dict:
    kinds = {"INT32": "<i4", "FP32": "<f4", "UINT64": "<u8", "BOOL": "?"}
    return {t.name: (list(t.shape), np.frombuffer(raw, kinds[t.datatype]).tolist())
            for t, raw in zip(r.inputs, r.raw_input_contents)}


def test_the_triton_request_asks_for_what_the_client_asked():
    plain = triton_stream.triton_request(_plan(_chat()), "a")
    assert "return_log_probs" not in _inputs(plain) and [o.name for o in plain.outputs] == ["output_ids"]
    sampled = triton_stream.triton_request(_plan(_chat(logprobs=True)), "b")
    assert _inputs(sampled)["return_log_probs"] == ([1, 1], [True]) and "return_top_log_probs" not in _inputs(sampled)
    assert [o.name for o in sampled.outputs] == ["output_ids", "output_log_probs"]
    top = triton_stream.triton_request(_plan(_chat(logprobs=True, top_logprobs=4)), "c")
    assert _inputs(top)["return_top_log_probs"] == ([1, 1], [4])
    assert [o.name for o in top.outputs] == ["output_ids", "output_log_probs", "top_log_prob_ids", "top_log_probs"]


def _response(ids: list[int], scores: list[float] | None = None, top: list[list[tuple[int, float]]] | None = None,
              final: bool = False) -> service_pb2.ModelStreamInferResponse:
    resp = service_pb2.ModelStreamInferResponse()
    r = resp.infer_response

    def add(name: str, datatype: str, shape: list[int], raw: bytes) -> None:
        out = r.outputs.add()
        out.name, out.datatype = name, datatype
        out.shape.extend(shape)
        r.raw_output_contents.append(raw)

    if ids:
        add("output_ids", "INT32", [1, 1, len(ids)], np.asarray(ids, "<i4").tobytes())
    if scores is not None:
        add("output_log_probs", "FP32", [1, 1, len(scores)], np.asarray(scores, "<f4").tobytes())
    if top:
        k = len(top[0])
        ids_raw = np.asarray([[t for t, _ in p] for p in top], "<i4").tobytes()
        add("top_log_prob_ids", "INT32", [1, len(top), k], ids_raw)
        add("top_log_probs", "FP32", [1, len(top), k], np.asarray([[v for _, v in p] for p in top], "<f4").tobytes())
    r.parameters["triton_final_response"].bool_param = final
    return resp


def test_parse_response_reads_log_probs_and_alternatives():
    step = triton_stream.parse_response(_response([7], [-0.5], [[(7, -0.5), (8, -1.25)]]))
    assert step.token_ids == (7,) and step.log_probs == (-0.5,) and step.top == (((7, -0.5), (8, -1.25)),)
    assert triton_stream.parse_response(_response([7])).log_probs is None
    assert triton_stream.parse_response(_response([], [], final=True)).log_probs == ()


# ---------------------------------------------------------------- the app, over a scripted Triton

TOKENS = [7, 8, 9, 10]  # red green blue sky


def _scripted(request: service_pb2.ModelInferRequest) -> list[service_pb2.ModelStreamInferResponse]:
    """One response per token, as the reference model streams: its log prob, and k alternatives when asked."""
    inputs = _inputs(request)
    k = inputs.get("return_top_log_probs", (None, [0]))[1][0]
    scored = "return_log_probs" in inputs
    out = []
    for i, t in enumerate(TOKENS):
        value = -0.25 * (i + 1)
        alternatives = [(t, value)] + [(j, value - j - 1) for j in range(k - 1)]
        out.append(_response([t], [value] if scored else None, [alternatives] if k else None))
    return out + [_response([], final=True)]


# What the app asks of Triton: streams, and the model's declared outputs.
_Triton = scripted_triton(_scripted, frozenset({"output_ids", "output_log_probs", "top_log_prob_ids", "top_log_probs"}))


@pytest.fixture
def client(tmp_path, monkeypatch):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": len(WORDS), "max_position_embeddings": 64}))
    monkeypatch.setattr(app_module, "Triton", _Triton)
    monkeypatch.setattr(_Triton, "requests", [])
    app = app_module.create_app(app_module.Settings("tiny", "unused:0"), LiveModel(folder=tmp_path))
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://test/v1"))


def _run(coro):
    return asyncio.run(coro)


def test_chat_log_probs_parse_in_the_openai_client_streamed_and_not(client):
    async def go():
        whole = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                                      stream=True)
        return whole, [c async for c in stream]

    whole, chunks = _run(go())
    content = whole.choices[0].logprobs.content
    assert [c.token for c in content] == ["red", "green", "blue", "sky"] == whole.choices[0].message.content.split()
    assert [c.logprob for c in content] == [-0.25, -0.5, -0.75, -1.0]
    assert content[0].bytes == list(b"red")
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("green", -0.5), ("<unk>", -1.5)]
    assert len(content) == whole.usage.completion_tokens
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs and choice.logprobs.content
                for c in choice.logprobs.content]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    assert chunks[0].choices[0].logprobs is None  # the role chunk carries no token


def test_completion_log_probs_in_openais_legacy_shape(client):
    async def go():
        whole = await client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0, logprobs=2)
        stream = await client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0, logprobs=2,
                                                 stream=True)
        return whole, [c async for c in stream]

    whole, chunks = _run(go())
    got = whole.choices[0].logprobs
    assert got.tokens == ["red", "green", "blue", "sky"] and got.token_logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert got.top_logprobs[0] == {"red": -0.25, "<unk>": -1.25}
    assert got.text_offset == [0, 3, 8, 12]
    tokens, offsets = [], []
    for chunk in chunks:
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == got.tokens and offsets == got.text_offset


def test_completions_logprobs_0_is_the_sampled_token_alone(client):
    got = _run(client.completions.create(model="tiny", prompt="hi", max_tokens=4, logprobs=0)).choices[0].logprobs
    assert got.top_logprobs[1] == {"green": -0.5}
    assert "return_top_log_probs" not in _inputs(_Triton.requests[-1])


def test_without_log_probs_nothing_changes(client):
    out = _run(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4))
    assert out.choices[0].logprobs is None and out.choices[0].message.content == "red green blue sky"
    assert "return_log_probs" not in _inputs(_Triton.requests[-1])


def test_a_backend_without_alternatives_refuses_top_logprobs_before_generating(client, monkeypatch):
    monkeypatch.setattr(_Triton, "outputs_declared", frozenset({"output_ids", "output_log_probs"}))  # the engine's
    with pytest.raises(openai.BadRequestError) as err:
        _run(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            logprobs=True, top_logprobs=1))
    assert err.value.body["param"] == "top_logprobs" and not _Triton.requests
    out = _run(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, logprobs=True))
    assert [c.logprob for c in out.choices[0].logprobs.content] == [-0.25, -0.5, -0.75, -1.0]
    assert all(c.top_logprobs == [] for c in out.choices[0].logprobs.content)


# ---------------------------------------------------------------- a token's bytes


def test_a_characters_tokens_join_to_its_bytes_in_a_byte_level_vocabulary():
    from tokenizers import trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["plain words and more words"] * 3, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    names = TokenBytes(tok)
    ids = tok.encode("日本 words").ids
    assert len(ids) > 3  # each character split into its bytes: a token alone is no text
    assert b"".join(names(t, tok.decode([t])) for t in ids) == "日本 words".encode("utf-8")
    assert "\ufffd" in tok.decode([ids[0]])
    assert names(tok.token_to_id("<s>"), "<s>") == b"<s>"  # an added token is its text
    assert len(byte_level_alphabet()) == 256 and sorted(byte_level_alphabet().values()) == list(range(256))


def test_byte_fallback_pieces_are_their_byte():
    vocab = {"<unk>": 0, "<0xE6>": 1, "▁a": 2, "a": 3}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    names = TokenBytes(tok)
    assert names(1, tok.decode([1])) == b"\xe6"
    assert names(3, "a") == b"a"


def test_a_token_a_constraint_masks_is_reported_at_vllms_floor_not_as_infinity():
    """Under a constraint the alternatives it forbids have log prob -inf; JSON cannot carry that (a 500 before)."""

    class Vocab:
        def token_text(self, token: int) -> str:
            return f"t{token}"

        def token_bytes(self, token: int) -> bytes:
            return f"t{token}".encode()

    scored = [lp.Scored(5, 0.0, ((5, 0.0), (6, float("-inf")))), lp.Scored(7, float("-inf"), ())]
    chat = lp.chat_logprobs(scored, Vocab())
    legacy = lp.completion_logprobs(scored, Vocab())
    json.dumps([chat, legacy], allow_nan=False)  # raises on any inf or nan left
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [0.0, lp.LOGPROB_FLOOR]
    assert chat["content"][1]["logprob"] == lp.LOGPROB_FLOOR
    assert legacy["token_logprobs"] == [0.0, lp.LOGPROB_FLOOR]
    assert legacy["top_logprobs"] == [{"t5": 0.0, "t6": lp.LOGPROB_FLOOR}, {"t7": lp.LOGPROB_FLOOR}]
