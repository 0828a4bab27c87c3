"""What the fuzzer of the OpenAI service found (benchmarks/fuzz_surfaces/openai.py, issue 51), one test each.

An authorization header holding a byte outside printable ASCII was forwarded to Triton as gRPC metadata, which
gRPC refuses for the whole call: a 500 (``backend_error``, or ``internal error: ExecuteBatchError``). It is no API
key any deployment issues (api_keys.py: RFC 6750's b64token), so the service answers 401 in OpenAI's shape. So
is one of 8,000 characters: over Triton's 8 KiB limit on a call's metadata, gRPC refused it (RESOURCE_EXHAUSTED,
a 500); no key is longer than 512 characters.
"""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from stoker.openai_api import mapping as m
from stoker.openai_api.app import Settings, create_app
from stoker.openai_api.served_model import LiveModel

ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.mark.parametrize("value", ["Bearer cl\u00e9", "Bearer a\tb", "Bearer \x7f", "Bearer " + "k" * 8000],
                         ids=["latin-1", "tab", "DEL", "8 KiB"])
def test_an_authorization_that_grpc_cannot_carry_is_refused_401(value):
    with pytest.raises(m.ApiError) as err:
        m.authorization(value)
    assert (err.value.status, err.value.code) == (401, "invalid_api_key")


def test_printable_ascii_authorization_goes_on():
    assert m.authorization("Bearer sk-abc_DEF.123~+/=") == "Bearer sk-abc_DEF.123~+/="
    assert m.authorization(None) is None
    longest = "Bearer " + "k" * 512  # the longest key a deployment takes (api_keys.MAX_LENGTH)
    assert m.authorization(longest) == longest


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_the_service_answers_401_in_openai_shape_before_any_work(tmp_path, path):
    app = create_app(Settings("tiny", "127.0.0.1:1"), LiveModel(folder=tmp_path))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post(path, content=b'{"model": "tiny", "prompt": "hi"}',
                        headers={"authorization": "Bearer cl\u00e9".encode("latin-1")})
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_FIELDS and error["code"] == "invalid_api_key"
