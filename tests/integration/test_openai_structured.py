"""Structured outputs at a deployment's stable address: the official `openai` client, `response_format` json_schema
(strict) and json_object, streamed and not, against the real Triton container serving the reference build of a tiny
Llama (its `tensorrt_llm` model compiling the guide with xgrammar in the image), behind the proxy and the OpenAI
service container, as tests/integration/test_openai_deployment.py deploys them.

UNRUN so far: written with the feature (issue 50 item 1) on a machine whose Docker was busy with CI; the unit tests
(tests/unit/test_guided_runtime.py, tests/unit/test_structured_outputs_unit.py) cover the same chain in process.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest

from stoker.containers import engine
from stoker.containers.ports import Ports
from stoker.serving import promote
from stoker.stack.services import free_port

from serving_models import publish
from test_openai_deployment import _repos, _wait_models

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.slow]
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("torch")

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "bright": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 8},
    },
    "required": ["colour", "bright", "name"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Name a colour, as JSON."}]


@pytest.fixture
def api(local_stack, triton_image, tmp_path):
    """The reference build deployed with its OpenAI service; the client and the deployment's name."""
    client = engine.connect(None)
    env = {**local_stack["aws_env"], "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=local_stack["s3"], region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    bucket = f"st-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    repo, _, _ = _repos(tmp_path)
    http = free_port()
    grpc = free_port(exclude=(http,))
    target = promote.Target(name=f"st{uuid.uuid4().hex[:6]}", listen=Ports(http, grpc, free_port(exclude=(http, grpc))),
                            proxy_image="stoker/haproxy:2.6", state_dir=tmp_path / "proxy", openai_image=triton_image)
    try:
        uri, digest = publish(s3, bucket, local_stack["s3"], repo)
        spec = engine.BackendSpec(name=target.name, image=triton_image, repository_uri=uri, repo_digest=digest,
                                  env=env, ready_timeout_s=120)
        staged = promote.prepare(client, target, spec, 0.5, print)
        promote.go_live(client, target, staged, watch_s=0.5, max_error_rate_pct=100, drain_timeout_s=5, log=print)
        base = target.endpoint["openai"]
        _wait_models(base, None)
        yield openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120), target.name
    finally:
        engine.remove_deployment(client, target.name, lambda _l: None)


def test_json_schema_strict_streamed_and_not_parses_and_validates(api) -> None:
    client, model = api
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, temperature=0,
                                         response_format=FORMAT)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)

    chunks = list(client.completions.create(model=model, prompt="A colour as JSON:", max_tokens=120, temperature=0.9,
                                            seed=7, stream=True, extra_body={"response_format": FORMAT}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)

    streamed = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, temperature=0,
                                              response_format=FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == out.choices[0].message.content


def test_json_object_answers_an_object(api) -> None:
    client, model = api
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=200, temperature=0,
                                         response_format={"type": "json_object"})
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # ran out of tokens inside the object: still its beginning
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


def test_free_requests_beside_constrained_ones_answer_as_alone(api) -> None:
    client, model = api

    def free():
        return client.completions.create(model=model, prompt="Hello", max_tokens=12, temperature=0).choices[0].text

    def guided():
        return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, temperature=0,
                                              response_format=FORMAT).choices[0].message.content

    alone = free()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(guided if i % 2 else free) for i in range(6)]
        results = [f.result() for f in futures]
    assert results[0::2] == [alone] * 3
    for text in results[1::2]:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("schema, words", [
    ({"type": "nonsense"}, "nonsense"),  # refused by xgrammar in the Triton model, turned into a 400 by the service
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"$ref": "#/$defs/x"}}}, "loops"),
])
def test_a_schema_that_cannot_be_used_is_a_400_naming_the_field(api, schema, words) -> None:
    client, model = api
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": schema}})
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert words in err.value.body["message"]
    # Nothing else is affected.
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0).choices
