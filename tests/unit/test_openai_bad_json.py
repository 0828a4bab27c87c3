"""Bodies that are JSON's syntax at its edges: each a 400 in OpenAI's error shape, none a 500.

Found by the volume test (tests/integration/test_openai_abuse.py): nesting deeper than the parser's stack
raised RecursionError, and an unpaired surrogate escape failed the tokenizer, or the service's own
encoding of an error body that quoted it.
"""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from stoker.openai_api import mapping as m
from stoker.openai_api.app import Settings, create_app
from stoker.openai_api.served_model import LiveModel

DEEP = b"[" * 100_000 + b"]" * 100_000
LONE = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'
LONE_MODEL = b'{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}'
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw", [DEEP, b'{"model": "tiny", "messages": ' + DEEP + b"}", LONE, LONE_MODEL,
                                 b'{"a": "\\uD83D"}'])
def test_refused_as_invalid_json(raw):
    with pytest.raises(m.ApiError) as err:
        m.parse_json(raw)
    assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_json", None)


def test_paired_surrogates_and_escaped_backslashes_are_text():
    assert m.parse_json(b'{"s": "\\ud83d\\ude00"}') == {"s": "\U0001F600"}
    assert m.parse_json(b'{"s": "\\\\ud800"}') == {"s": "\\ud800"}  # a backslash, then the letters
    assert m.parse_json('{"s": "日本語 🎉"}'.encode()) == {"s": "日本語 🎉"}


@pytest.mark.parametrize("raw", [DEEP, LONE, LONE_MODEL])
def test_the_service_answers_400_in_openai_shape(tmp_path, raw):
    # No build is loaded on these paths: the body is refused before the model is looked up.
    app = create_app(Settings("tiny", "127.0.0.1:1"), LiveModel(folder=tmp_path))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = json.loads(r.content)["error"]
    assert set(error) == ERROR_FIELDS and error["code"] == "invalid_json"
