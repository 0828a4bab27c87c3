"""Triton's inference routes at the stable address under malformed requests (issue 51), on the real Docker engine,
HAProxy, Triton and S3 (moto): a client's mistake answers 400 in Triton's ``{"error": ...}`` shape, a model's own
failure stays 500, and a bounded run of the triton fuzz surface finds no 5xx, no other error shape, and a server that
still answers.

One deployment for the module: an ``ensemble`` with the inputs of stoker's real ensemble (stoker/triton/config.py
ENSEMBLE_IN, so ``stop_words`` is a BYTES tensor as in the demo) served by the scripted test model, beside ``broken``,
a model that fails every request.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from stoker.containers import engine
from stoker.deploy.rollout import EXPLICIT_ARGS
from stoker.serving import promote

from promotion_kit import Lines, deploy, generate, listen_ports
from promotion_kit import client, images, s3  # noqa: F401 -- fixtures the tests request
from serving_models import MODEL, publish

pytestmark = [pytest.mark.docker, pytest.mark.s3]

BROKEN = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("model raising on purpose")) for _ in requests]
"""


def _write_repo(root):
    from tritonclient.grpc import model_config_pb2 as mc

    from stoker.triton import config

    ensemble = mc.ModelConfig(name="ensemble", backend="python", max_batch_size=8)
    config._io(ensemble.input, config.ENSEMBLE_IN, True)
    ensemble.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[-1])
    ensemble.model_transaction_policy.decoupled = True  # as the real one (its tensorrt_llm step streams)
    ensemble.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    broken = mc.ModelConfig(name="broken", backend="python", max_batch_size=0)
    broken.input.add(name="IN", data_type=mc.TYPE_INT32, dims=[1])
    broken.output.add(name="OUT", data_type=mc.TYPE_INT32, dims=[1])
    broken.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    for cfg, code in ((ensemble, MODEL.format(tag="f", mode="ok", arg=0.0, interval=0.0)), (broken, BROKEN)):
        (root / cfg.name / "1").mkdir(parents=True)
        (root / cfg.name / "config.pbtxt").write_text(config.render(cfg))
        (root / cfg.name / "1" / "model.py").write_text(code)
    return root


@pytest.fixture(scope="module")
def fuzzed(client, images, s3, tmp_path_factory):  # noqa: F811 -- the imported fixtures
    """The deployment every test here talks to (deployed once; removed at the end)."""
    c, bucket, endpoint, env = s3
    tmp = tmp_path_factory.mktemp("fuzz-triton")
    target = promote.Target(name=f"f{uuid.uuid4().hex[:8]}", listen=listen_ports(), proxy_image=images[1],
                            state_dir=tmp / "proxy")
    uri, digest = publish(c, bucket, endpoint, _write_repo(tmp / "repo"))
    spec = engine.BackendSpec(name=target.name, image=images[0], repository_uri=uri, repo_digest=digest,
                              env={**env, "AWS_DEFAULT_REGION": "us-east-1"}, ready_timeout_s=60, run_id="run-f",
                              extra_args=list(EXPLICIT_ARGS))
    try:
        deploy(client, target, spec, log=Lines())
        yield target
    finally:
        engine.remove_deployment(client, target.name, lambda _l: None)


def _post(url: str, body: bytes) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers.get("content-type", ""), r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("content-type", ""), err.read()


# The outside fuzz's four examples (HTTP 500 from Triton before the fix) and what Triton says of each.
REGRESSIONS = [
    (b'{"text_input": null, "max_tokens": 1}', "Unable to parse JSON bytes array: "),
    (b'{"text_input": "hi", "max_tokens": 1, "stop_words": {}}', "Unable to parse JSON bytes array: "),
    (b'{"text_input": "hi", "max_tokens": 1, "stream": 2147483648}', "Unable to parse 'data': "),
    (b'{"text_input": "\xff\xfe\x80", "max_tokens": 1' + b"\xc3\x28}", "failed to parse the request JSON buffer: "),
]


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_a_clients_malformed_json_answers_400_in_tritons_shape(fuzzed, route):
    http = fuzzed.endpoint["http"]
    for body, says in REGRESSIONS:
        status, ctype, answer = _post(f"{http}/v2/models/ensemble/{route}", body)
        assert (status, ctype) == (400, "application/json"), (body, status, answer)
        assert json.loads(answer)["error"].startswith(says), (body, answer)


def test_infer_on_a_decoupled_model_is_the_clients_mistake_and_a_models_failure_stays_500(fuzzed):
    http = fuzzed.endpoint["http"]
    status, ctype, answer = _post(f"{http}/v2/models/ensemble/infer", b'{"inputs": []}')  # Triton: 501, text/plain
    assert (status, ctype) == (400, "application/json"), (status, ctype, answer)
    assert "decoupled transaction policy" in json.loads(answer)["error"]
    good = json.dumps({"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]}]}).encode()
    status, _, answer = _post(f"{http}/v2/models/broken/infer", good)
    assert status == 500 and json.loads(answer)["error"] == "model raising on purpose", (status, answer)
    status, _, answer = _post(f"{http}/v2/models/broken/infer", b'{"inputs": 5}')  # the client's mistake again
    assert status == 400 and json.loads(answer)["error"].startswith("Unable to parse 'inputs'"), (status, answer)
    assert generate(http, max_tokens=2) == "f:0 f:1 "  # a stream passes as before


def test_a_bounded_fuzz_run_finds_no_5xx_and_the_server_still_answers(fuzzed):
    from benchmarks.fuzz_surfaces import Target
    from benchmarks.fuzz_surfaces.triton import run

    # benchmarks/fuzz.py runs this test with a longer budget (its triton surface needs the stable address, which
    # these fixtures deploy) and takes the tally from STOKER_FUZZ_TRITON_OUT.
    examples = int(os.environ.get("STOKER_FUZZ_TRITON_EXAMPLES", "45"))
    tally = run(Target(http=fuzzed.endpoint["http"], grpc=fuzzed.endpoint["grpc"], model="ensemble"),
                max_examples=examples, seed=int(os.environ.get("STOKER_FUZZ_SEED", "51")))  # + a third as many gRPC
    result = tally.as_json()
    print(json.dumps(result))
    if os.environ.get("STOKER_FUZZ_TRITON_OUT"):
        Path(os.environ["STOKER_FUZZ_TRITON_OUT"]).write_text(json.dumps(result))
    assert result["generated_requests"] == examples + examples // 3 and result["by_status"].get("400", 0) > 0, result
    assert result["responses_5xx"] == 0 and result["failures"] == {}, result
