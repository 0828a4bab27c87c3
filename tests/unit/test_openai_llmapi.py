"""The OpenAI service's LLM-API mapping, without a server: the request sent to TensorRT-LLM's LLM-API model (names
and types as stoker.protocol and the llmapi config say), its cumulative responses turned into new text cut at stop
sequences, finish reasons, completion tokens counted from the text, min_tokens refused, the chat prompt as text,
and the interface read from live.json."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from tritonclient.grpc import service_pb2

from stoker import protocol
from stoker.gpu import llmapi
from stoker.openai_api import mapping as m
from stoker.openai_api import triton_stream as ts
from stoker.openai_api.generation import LlmApiGenerating
from stoker.openai_api.mapping import ApiError
from stoker.openai_api.served_model import LIVE_FILE, LiveModel, ServedModel

KINDS = {"INT32": "<i4", "FP32": "<f4", "UINT64": "<u8", "BOOL": "?"}
TRITON_TYPES = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32", "FP32": "TYPE_FP32",
                "UINT64": "TYPE_UINT64"}


def _inputs(r: service_pb2.ModelInferRequest) -> dict:
    out = {}
    for t, raw in zip(r.inputs, r.raw_input_contents):
        if t.datatype == "BYTES":
            n = int.from_bytes(raw[:4], "little")
            value = [raw[4:4 + n].decode()]
        else:
            value = np.frombuffer(raw, KINDS[t.datatype]).tolist()
        out[t.name] = (t.datatype, list(t.shape), value)
    return out


def _gen(greedy=True, text="hi there", max_tokens=8, stop=()):
    return ts.Generation((1, 5, 6), max_tokens, greedy, 0.7, 0.9, 42, tuple(stop), prompt_text=text)


def test_the_names_are_stoker_protocols_and_the_types_the_llmapi_configs():
    # the service reads stoker/protocol.py itself, through a link beside it (it runs where stoker is not installed)
    assert Path(ts.protocol.__file__).resolve() == Path(protocol.__file__).resolve()
    assert (ts.ENSEMBLE, ts.LLMAPI) == (protocol.ENSEMBLE.layout, protocol.LLMAPI.layout)
    assert ts.LLMAPI_MODEL == protocol.LLMAPI.model == llmapi.MODEL_NAME
    declared = {name: dtype for name, dtype, _optional in llmapi.LLMAPI_IN}
    for greedy in (True, False):
        r = ts.llmapi_request(_gen(greedy), "r")
        for t in r.inputs:
            assert TRITON_TYPES[t.datatype] == declared[t.name], t.name
            assert list(t.shape) == [1]  # dims [1], max_batch_size 0
        assert {o.name for o in r.outputs} <= {name for name, _ in llmapi.LLMAPI_OUT}
        # what stoker.protocol says every LLM-API request carries
        got = _inputs(r)
        values = protocol.LLMAPI.request("hi there", 8)
        for name, value in values.items():
            assert got[name][2] == [value], name
        assert protocol.LLMAPI.finish_reason in {o.name for o in r.outputs}
    sampled = {t.name for t in ts.llmapi_request(_gen(False), "r").inputs}
    greedy = {t.name for t in ts.llmapi_request(_gen(True), "r").inputs}
    i = protocol.LLMAPI
    assert {i.temperature, i.top_p, i.seed} <= sampled and i.top_k in greedy


def test_the_services_copy_carries_protocol_as_a_file_and_imports_without_stoker(tmp_path):
    """The container gets the package as openai_service installs it: the link copied as the file it names, imported
    as the top-level package stoker_openai with no stoker to fall back on."""
    from stoker.serving import openai_service

    openai_service._install_code(tmp_path, openai_service.code_digest())
    (package,) = tmp_path.glob(f"app/*/{openai_service.PACKAGE}")
    copy = package / "_protocol.py"
    assert not copy.is_symlink() and copy.read_bytes() == Path(protocol.__file__).read_bytes()
    probe = ("import sys; sys.modules['stoker'] = None\n"  # any import of stoker fails
             "from stoker_openai import triton_stream as ts\n"
             "c = ts.CumulativeText(); print(ts.LLMAPI_MODEL, repr(''.join(c.push(t) for t in ('ab', 'abc')) + c.flush()))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=package.parent, capture_output=True, text=True,
                          env={"PYTHONPATH": str(package.parent)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["tensorrt_llm", "'abc'"]


def test_llmapi_request_greedy_and_sampled():
    r = ts.llmapi_request(_gen(True, stop=("x",)), "req-1")
    assert (r.model_name, r.id) == ("tensorrt_llm", "req-1")
    got = _inputs(r)
    assert got["text_input"] == ("BYTES", [1], ["hi there"])
    assert got["streaming"][2] == [True] and got["sampling_param_exclude_input_from_output"][2] == [True]
    assert got["return_finish_reason"][2] == [True] and got["sampling_param_max_tokens"][2] == [8]
    assert got["sampling_param_top_k"][2] == [1]
    # no temperature (greedy by top_k), no stop strings (cut here: the shim's stop ids stay), no min_tokens
    assert not {"sampling_param_temperature", "sampling_param_top_p", "sampling_param_seed", "sampling_param_stop",
                "input_ids", "min_tokens"} & set(got)
    assert r.parameters["triton_enable_empty_final_response"].bool_param
    sampled = _inputs(ts.llmapi_request(_gen(False), "s"))
    assert sampled["sampling_param_temperature"][2] == pytest.approx([0.7])
    assert sampled["sampling_param_top_p"][2] == pytest.approx([0.9])
    assert sampled["sampling_param_seed"][2] == [42] and "sampling_param_top_k" not in sampled
    with pytest.raises(ValueError, match="as text"):
        ts.llmapi_request(_gen(text=None), "n")


def _response(text: str | None, finish: str | None, final: bool = False, error: str = ""):
    resp = service_pb2.ModelStreamInferResponse(error_message=error)
    r = resp.infer_response
    for name, value in (("text_output", text), ("finish_reason", finish)):
        if value is not None:
            out = r.outputs.add(name=name, datatype="BYTES", shape=[1])
            b = value.encode()
            r.raw_output_contents.append(len(b).to_bytes(4, "little") + b)
            del out
    if final:
        r.parameters["triton_final_response"].bool_param = True
    return resp


def test_parse_llmapi_response():
    assert ts.parse_llmapi_response(_response("ab", "None")) == ts.Step((), False, text="ab", finish=None)
    assert ts.parse_llmapi_response(_response("ab c", "length", final=True)) == ts.Step((), True, text="ab c",
                                                                                      finish="length")
    # a finish reason ends the output even without Triton's final flag in that response
    assert ts.parse_llmapi_response(_response("ab c", "stop")).final
    assert ts.parse_llmapi_response(_response(None, None, final=True)) == ts.Step((), True)
    assert ts.parse_llmapi_response(_response(None, None, error="boom")).error == "boom"
    assert ts.parse_llmapi_response(_response("é", "None")).text == "é"


def test_cumulative_text_takes_the_new_part_and_cuts_at_stop_sequences():
    c = ts.CumulativeText()
    assert [c.push(t) for t in ("al", "alpha", "alpha be", "alpha beta")] == ["al", "pha", " be", "ta"]
    assert c.flush() == "" and c.sent == "alpha beta"
    s = ts.CumulativeText(stop=("gam",))
    # as many characters as a stop sequence could still need are held back (len("gam") - 1)
    assert s.push("alpha ") == "alph" and s.push("alpha g") == "a" and s.push("alpha ga") == " "
    assert s.push("alpha gamma") == "" and s.stopped and s.sent == "alpha "
    assert s.push("alpha gamma delta") == ""
    # a possible start let out when it is not one, and at the end
    h = ts.CumulativeText(stop=("delta x",))
    out = [h.push(t) for t in ("a delta", "a delta y")]
    assert "".join(out) + h.flush() == "a delta y" and not h.stopped
    # an incomplete character (U+FFFD) waits for the response that completes it
    u = ts.CumulativeText()
    assert u.push("caf\ufffd") == "caf" and u.push("café") == "é"
    assert ts.CumulativeText().push("x\ufffd", final=True) == "x\ufffd"
    # a revised earlier part cannot be taken back: only what goes beyond is new, and the revision is kept
    r = ts.CumulativeText()
    assert r.push("abc") == "abc" and r.push("abX") == "" and r.push("abXd") == "d"
    assert r.sent == "abcd" and r.revisions == ["c"]


def test_text_stream_still_cuts_as_before():
    decode = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    t = ts.TextStream(decode, stop=("cd",))
    assert [t.push(i) for i in (0, 1, 2)] == ["", "a", "b"] and t.push(3) == "" and t.stopped
    assert t.flush() == ""


def test_llmapi_finish():
    assert ts.llmapi_finish("length", False, 3, 3) == "length"
    assert ts.llmapi_finish("stop", False, 1, 3) == "stop"
    assert ts.llmapi_finish("length", True, 3, 3) == "stop"  # a stop sequence cut here
    assert ts.llmapi_finish(None, False, 3, 3) == "length" and ts.llmapi_finish("cancelled", False, 1, 3) == "stop"


def _comp(**kw):
    return m.parse_completion({"model": "tiny", "prompt": "x", **kw})


def test_min_tokens_and_ignore_eos_are_refused_on_the_llm_api():
    for kw in ({"min_tokens": 2}, {"ignore_eos": True}):
        with pytest.raises(ApiError) as err:
            ts.plan(_comp(max_tokens=4, **kw), [1, 2], 100, seed=0, interface=ts.LLMAPI)
        assert err.value.status == 400 and err.value.code == "unsupported_parameter"
        assert err.value.param == next(iter(kw))
        assert ts.plan(_comp(max_tokens=4, **kw), [1, 2], 100, seed=0).min_tokens  # the ensemble takes them
    # their "off" values are no request for anything
    g = ts.plan(_comp(max_tokens=4, min_tokens=0, ignore_eos=False), [1], 100, seed=0, interface=ts.LLMAPI,
                prompt_text="x")
    assert g.min_tokens == 0 and g.prompt_text == "x"


def _tokenizer() -> Tokenizer:
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "alpha", "beta", "gamma", "<|user|>", "hi"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _model(template: str | None, tok: Tokenizer | None = None) -> ServedModel:
    return ServedModel(key="k" * 12, tokenizer=tok or _tokenizer(), chat_template=template,
                       template_source="test", special={"bos_token": "<s>", "eos_token": "</s>"}, context_len=64,
                       vocab_size=8)


def test_chat_prompt_is_the_rendered_template_without_a_bos_the_tokenizer_adds():
    msgs = [{"role": "user", "content": "hi"}]
    model = _model("{{ bos_token }}{% for m in messages %}<|user|> {{ m['content'] }}{% endfor %}")
    text = model.chat_prompt(msgs)
    assert text == "<|user|> hi"
    assert model.encode(text) == model.chat_ids(msgs)  # what the LLM API tokenizes is what the ensemble is sent
    no_bos = _tokenizer()
    no_bos.post_processor = None
    kept = _model("{{ bos_token }}<|user|>", no_bos)
    assert kept.chat_prompt(msgs) == "<s><|user|>"  # a tokenizer that adds none: the template's own BOS stays
    assert _model(None).chat_prompt(msgs) == "user: hi\nassistant:"  # the fallback template


def test_generating_counts_completion_tokens_from_the_text_and_maps_finish():
    model = _model(None)

    def run(steps, stop=(), max_tokens=8):
        g = LlmApiGenerating(None, _gen(stop=stop, max_tokens=max_tokens), model, "r")
        out = []
        for step in steps:
            g._step = step
            out += g.ready()
            if g.finish:
                break
        return "".join(out), g.finish, g.completion_tokens

    steps = [ts.Step((), False, text=t) for t in ("alpha", "alpha beta")]
    assert run([*steps, ts.Step((), True, text="alpha beta gamma", finish="length")], max_tokens=3) == (
        "alpha beta gamma", "length", 3)
    assert run([*steps, ts.Step((), True, text="alpha beta", finish="stop")]) == ("alpha beta", "stop", 2)
    assert run([*steps, ts.Step((), True, text="alpha beta gamma", finish="stop")], stop=("gam",)) == (
        "alpha beta ", "stop", 2)
    assert run([*steps, ts.Step((), True)]) == ("alpha beta", "stop", 2)  # an empty final response


def _stream(steps):
    """Each OpenAI chunk's text as the service sends it, from the llmapi model's responses."""
    g = LlmApiGenerating(None, _gen(max_tokens=8), _model(None), "r")
    pieces = []
    for step in steps:
        g._step = step
        pieces += g.ready()
        if g.finish:
            break
    return pieces, g


def test_the_openai_streams_assembled_text_is_the_final_text():
    # the cumulative responses: a character completed by the next token, then more text, then the end
    texts = ["alpha caf\ufffd", "alpha café", "alpha café beta", "alpha café beta gamma"]
    steps = [ts.Step((), False, text=t) for t in texts[:-1]] + [ts.Step((), True, text=texts[-1], finish="length")]
    pieces, g = _stream(steps)
    assert "".join(pieces) == texts[-1] and g.text.revisions == []
    assert pieces == ["alpha caf", "é", " beta", " gamma"]  # each chunk only what is new
    assert (g.finish, g.completion_tokens) == ("length", 4)  # counted from that text: café is one <unk>


def test_the_openai_stream_never_repeats_text_a_revision_changed():
    # a stop string streamed in part ("ga" of "gam"), then cut from the final output
    steps = [ts.Step((), False, text=t) for t in ("alpha", "alpha g", "alpha ga")]
    pieces, g = _stream([*steps, ts.Step((), True, text="alpha ", finish="stop")])
    assert "".join(pieces) == "alpha ga"  # sent text cannot be taken back, and is not sent again
    assert g.text.revisions == ["ga"] and g.finish == "stop"


def test_live_model_reads_the_backends_interface(tmp_path):
    assets = tmp_path / "assets" / "a"
    assets.mkdir(parents=True)
    _tokenizer().save(str(assets / "tokenizer.json"))
    live = LiveModel(state=tmp_path)

    def publish(**extra):
        (tmp_path / LIVE_FILE).write_text(json.dumps({"assets": "assets/a", "digest": "d1", **extra}))

    publish()
    assert asyncio.run(live.get()).interface is None  # the service's --interface then
    publish(interface="llmapi", backend="b2")
    assert asyncio.run(live.get()).interface == "llmapi"
    publish(interface="grpc-magic")
    with pytest.raises(ApiError) as err:
        asyncio.run(live.get())
    assert err.value.status == 503 and "grpc-magic" in err.value.message


def test_the_service_takes_the_interface_at_start():
    from stoker.openai_api import __main__ as main

    with pytest.raises(SystemExit):
        main.main(["--model", "x", "--grpc", "h:1", "--assets", "/nope", "--interface", "grpc-magic"])


def test_follow_names_the_live_backends_interface(tmp_path):
    """live.json carries the interface of the backend the proxy routes to (its ai.stoker.interface label), so the
    service speaks to each build as it must, across a switch between layouts."""
    from types import SimpleNamespace

    from stoker.containers import engine
    from stoker.serving import openai_service

    state = tmp_path / openai_service.FOLDER
    (state / "backends").mkdir(parents=True)
    backends = {"blue": SimpleNamespace(id="a" * 64, labels={engine.LABEL_INTERFACE: "llmapi"}),
                "green": SimpleNamespace(id="b" * 64, labels={})}  # started before the label: the ensemble
    for c in backends.values():
        (state / "backends" / f"{c.id[:24]}.json").write_text(json.dumps({"assets": "assets/x", "digest": "d"}))
    client = SimpleNamespace(containers=SimpleNamespace(get=backends.__getitem__))
    for name, want in (("blue", "llmapi"), ("green", "ensemble")):
        openai_service.follow(client, tmp_path, name, lambda _m: None)
        live = json.loads((state / LIVE_FILE).read_text())
        assert live == {"assets": "assets/x", "digest": "d", "interface": want, "backend": name}
