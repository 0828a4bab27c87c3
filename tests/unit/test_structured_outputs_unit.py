"""Structured outputs through the OpenAI service (stoker/openai_api/structured.py), in process: the app's requests go
to a stand-in for Triton's `tensorrt_llm` that reads the guide inputs with the runtime's own parser and decodes with
the reference Batcher and xgrammar on a tiny model, so the whole chain (response_format → BYTES tensors → guide →
masked decoding → streamed ids → text) runs without a container. The real Triton model is the integration test's
(tests/integration/test_openai_structured.py)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from starlette.testclient import TestClient
from test_guided_runtime import END, SCHEMA, served  # noqa: F401 -- the tiny model + tokenizer fixture
from tritonclient.grpc import service_pb2

from stoker.openai_api import app as app_module
from stoker.openai_api import structured
from stoker.openai_api.app import Settings, create_app
from stoker.openai_api.served_model import LiveModel
from stoker.runtime.batch import Batcher
from stoker.runtime.guided import GuideError, parse_guide

FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}


def _inputs(request: service_pb2.ModelInferRequest) -> dict[str, bytes]:
    return {t.name: raw for t, raw in zip(request.inputs, request.raw_input_contents)}


def _one_string(raw: bytes | None) -> bytes | None:
    return None if raw is None else raw[4:4 + int.from_bytes(raw[:4], "little")]


def _response(ids: list[int], final: bool = False) -> service_pb2.ModelStreamInferResponse:
    r = service_pb2.ModelInferResponse()
    if ids:
        r.outputs.add().name = "output_ids"
        r.raw_output_contents.append(np.asarray(ids, "<i4").tobytes())
    if final:
        r.parameters["triton_final_response"].bool_param = True
    return service_pb2.ModelStreamInferResponse(infer_response=r)


class _Call:
    """A started stream: each token as one response, then an empty final one (as tensorrt_llm.py streams)."""

    def __init__(self, tokens=None, error: str | None = None) -> None:
        self._tokens, self._error, self._done = tokens, error, False

    async def read(self):
        if self._error is not None:
            self._done = True
            return service_pb2.ModelStreamInferResponse(error_message=self._error)
        token = await asyncio.to_thread(next, self._tokens, None)
        if token is None:
            self._done = True
            return _response([], final=True)
        return _response([token])

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        self._done = True


class _Backend:
    """What the reference `tensorrt_llm` does with a request, minus Triton: parse, compile, submit, stream."""

    def __init__(self, model, grammars) -> None:
        self.grammars, self.batcher, self.requests = grammars, Batcher(model, max_batch=4).start(), []

    def stream(self, request, authorization=None) -> _Call:
        self.requests.append(request)
        inputs = _inputs(request)
        ids = np.frombuffer(inputs["input_ids"], "<i4").tolist()
        budget = int(np.frombuffer(inputs["request_output_len"], "<i4")[0])
        try:
            guide = parse_guide(_one_string(inputs.get("guided_decoding_guide_type")),
                                _one_string(inputs.get("guided_decoding_guide")))
            constraint = None if guide is None else self.grammars.constraint(*guide, stop_ids=[END])
            stream = self.batcher.submit(ids, budget, END, constraint=constraint)
        except (GuideError, ValueError) as exc:
            return _Call(error=str(exc))
        return _Call(iter(stream))


@pytest.fixture(scope="module")
def client(served):  # noqa: F811
    model, tokenizer, grammars = served
    backend = _Backend(model, grammars)
    folder = grammars.tokenizer_dir  # the artifact: tokenizer.json and config.json, as a build's assets
    original = app_module.Triton.stream
    app_module.Triton.stream = lambda self, request, authorization=None: backend.stream(request, authorization)
    try:
        with TestClient(create_app(Settings("tiny", "127.0.0.1:1"), LiveModel(folder=folder))) as c:
            yield c, backend
    finally:
        app_module.Triton.stream = original
        backend.batcher.stop()


def _events(text: str) -> list[dict]:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_parses_and_validates(client, route, stream) -> None:
    c, _ = client
    body = {"model": "tiny", "max_tokens": 80, "temperature": 0, "response_format": FORMAT, "stream": stream}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Describe a thing as JSON."}]
    else:
        body["prompt"] = "Describe a thing as JSON:"
    resp = c.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
    assert resp.status_code == 200, resp.text
    if stream:
        chunks = _events(resp.text)
        pieces = [ch["choices"][0]["delta"].get("content") or "" if route == "chat" else ch["choices"][0]["text"]
                  for ch in chunks]
        text, finish = "".join(pieces), chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = resp.json()["choices"][0]
        text = choice["message"]["content"] if route == "chat" else choice["text"]
        finish = choice["finish_reason"]
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_gives_an_object(client) -> None:
    c, backend = client
    resp = c.post("/v1/completions", json={"model": "tiny", "prompt": "[1, 2", "max_tokens": 60, "temperature": 0,
                                           "response_format": {"type": "json_object"}})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # a free object may run past the budget; if it ended, it is whole
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["text"].startswith("{")
    sent = _inputs(backend.requests[-1])
    assert _one_string(sent["guided_decoding_guide_type"]) == b"json_schema"
    assert json.loads(_one_string(sent["guided_decoding_guide"])) == {"type": "object"}


LOOP = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}},
        "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}}


@pytest.mark.parametrize("response_format, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": LOOP}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"$ref": "#/$defs/none"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"$ref": "https://example.com/s.json"}}},
     "response_format.json_schema.schema"),
])
def test_bad_response_format_is_a_400_naming_the_field_before_the_backend(client, response_format, param) -> None:
    c, backend = client
    before = len(backend.requests)
    resp = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                "response_format": response_format})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    assert len(backend.requests) == before, "the backend was asked"


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_grammar_library_refuses_is_a_400_before_any_token(client, stream) -> None:
    c, backend = client
    bad = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nonsense"}}}
    resp = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                "response_format": bad, "stream": stream})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and "nonsense" in error["message"]


def test_text_and_unconstrained_requests_send_no_guide(client) -> None:
    c, backend = client
    for fmt in (None, {"type": "text"}):
        body = {"model": "tiny", "prompt": "quick fox", "max_tokens": 4}
        if fmt:
            body["response_format"] = fmt
        assert c.post("/v1/completions", json=body).status_code == 200
        assert not {"guided_decoding_guide_type", "guided_decoding_guide"} & set(_inputs(backend.requests[-1]))


def test_the_llmapi_target_refuses_response_format_in_one_line() -> None:
    with pytest.raises(structured.ApiError) as err:
        structured.guide_for({"response_format": FORMAT}, llmapi=True)
    assert (err.value.status, err.value.param, err.value.code) == (400, "response_format", "unsupported_parameter")
    assert "\n" not in err.value.message
    assert structured.guide_for({"response_format": {"type": "text"}}, llmapi=True) is None


def test_same_schema_same_guide_text_so_the_backend_compiles_it_once() -> None:
    one = structured.guide_for({"response_format": FORMAT})
    two = structured.guide_for({"response_format": json.loads(json.dumps(FORMAT))})
    assert one == two and list(json.loads(one.text)["properties"]) == list(SCHEMA["properties"])
