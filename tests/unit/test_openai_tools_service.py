"""Tool calls through the OpenAI service, in process: the stand-in `tensorrt_llm` of test_structured_outputs_unit
(the reference Batcher and xgrammar on a tiny model) behind the app, the tiny model given a short chat template in Hermes' (Qwen2's) family,
so a forced call runs the whole chain (tool_choice → guide → masked decoding → parsed call) and the official openai
client's types read the answer, whole and streamed."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

from starlette.testclient import TestClient
from test_guided_runtime import served  # noqa: F401 -- the tiny model + tokenizer fixture
from test_openai_tools import PLAIN
from test_structured_outputs_unit import _Backend, _events, _inputs, _one_string

from stoker.openai_api import app as app_module
from stoker.openai_api.app import Settings, create_app
from stoker.openai_api.layout import ASSET_FILES
from stoker.openai_api.served_model import LiveModel

ASK = [{"role": "user", "content": "time?"}]
# Short, the tools' names only: the tiny model's context is 256 tokens, and its tokenizer knows few words (the full
# rendering is test_openai_tools'). Hermes' tag, so the output is read in Qwen2's format.
TEMPLATE = ("{%- for m in messages %}{{ m.role }}: {{ m.content }}\n{%- endfor %}"
            "{%- if tools %}<tool_call>{% for t in tools %}{{ t.function.name }} {% endfor %}\n{%- endif %}a:")
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
SIZE = {"type": "function", "function": {"name": "size", "parameters": {
    "type": "object", "properties": {"big": {"type": "boolean"}}, "required": ["big"]}}}


def _assets(source, folder, template):
    folder.mkdir()
    for name in ASSET_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module")
def client(served, tmp_path_factory):  # noqa: F811
    model, tokenizer, grammars = served
    backend = _Backend(model, grammars)
    root = tmp_path_factory.mktemp("tools")
    original = app_module.Triton.stream
    app_module.Triton.stream = lambda self, request, authorization=None: backend.stream(request, authorization)
    try:
        with TestClient(create_app(Settings("tiny", "127.0.0.1:1"),
                                   LiveModel(folder=_assets(grammars.tokenizer_dir, root / "qwen", TEMPLATE)))) as qwen, \
             TestClient(create_app(Settings("tiny", "127.0.0.1:1"),
                                   LiveModel(folder=_assets(grammars.tokenizer_dir, root / "plain", PLAIN)))) as plain:
            yield qwen, plain, backend, tokenizer
    finally:
        app_module.Triton.stream = original
        backend.batcher.stop()


def _post(c, **kw):
    return c.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 60,
                                                **kw})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_a_forced_call_is_guided_and_answered_as_tool_calls(client, stream, choice):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    c, _, backend, _ = client
    resp = _post(c, tools=[SIZE, TIME], tool_choice=choice, parallel_tool_calls=False, stream=stream)
    assert resp.status_code == 200, resp.text
    if stream:
        state = ChatCompletionStreamState()
        for chunk in _events(resp.text):
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
        done = state.get_final_completion()
    else:
        done = ChatCompletion.model_validate(resp.json())
    sent = _inputs(backend.requests[-1])
    assert _one_string(sent["guided_decoding_guide_type"]) == b"json_schema"
    assert "get_time" in _one_string(sent["guided_decoding_guide"]).decode()
    choice_ = done.choices[0]
    assert choice_.finish_reason == "tool_calls" and not choice_.message.content
    [call] = choice_.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_time", "size")
    if isinstance(choice, dict):
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")


def test_auto_renders_the_tools_into_the_prompt_and_free_text_stays_content(client):
    c, _, backend, tokenizer = client
    resp = _post(c, tools=[TIME], max_tokens=6)
    assert resp.status_code == 200, resp.text
    sent = _inputs(backend.requests[-1])
    prompt = tokenizer.decode(np.frombuffer(sent["input_ids"], "<i4").tolist())
    assert "<tool_call>get_time" in prompt
    assert "guided_decoding_guide" not in sent
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and isinstance(choice["message"]["content"], str)
    chunks = _events(_post(c, tools=[TIME], max_tokens=6, stream=True).text)  # greedy: the same text, streamed
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == choice["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]


def test_tools_for_a_template_that_never_reads_them_are_a_400_before_the_backend(client):
    _, plain, backend, _ = client
    before = len(backend.requests)
    for kw, param in (({"tools": [TIME]}, "tools"),
                      ({"tools": [TIME], "tool_choice": "required",
                        "response_format": {"type": "json_object"}}, "tool_choice")):
        resp = _post(plain, **kw)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert _post(plain, tools=[TIME], tool_choice="none").status_code == 200  # no tools reach the template
    assert len(backend.requests) == before + 1


def test_the_official_client_over_http_gets_the_call_whole_and_streamed(client):
    c, _, _, _ = client
    api = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="unused", http_client=c)
    kw = {"model": "tiny", "messages": ASK, "temperature": 0, "max_tokens": 60, "tools": [SIZE, TIME],
          "tool_choice": {"type": "function", "function": {"name": "size"}}}
    whole = api.chat.completions.create(**kw).choices[0]
    with api.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    for choice in (whole, streamed):
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "size" and isinstance(json.loads(call.function.arguments)["big"], bool)
    assert whole.message.tool_calls[0].function.arguments == streamed.message.tool_calls[0].function.arguments
