"""`stoker rollback` of a GPU build (`target: tensorrt` on the STAND-IN) after this host lost what it had: the first
run's package folder pruned from the step cache and `$STOKER_HOME/runs` wiped. The run history comes from the
manifests in S3 and the repository from the run's upload, verified and renamed into place; real Hub mirror, S3,
Docker, Triton, Prefect. Bad input on the way (no run to go back to, no bucket known, S3 unreachable, a tampered
upload) is one line each, and the build that serves stays."""

from __future__ import annotations

import json
import shutil
import socket
import urllib.request
from pathlib import Path

import boto3
import pytest
import yaml
from operate_helpers import manifest_of, stoker, stoker_env
from standin_kit import gpu_spec_data

from stoker.containers import engine
from stoker.protocol import ENSEMBLE

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.prefect, pytest.mark.slow]


@pytest.fixture
def spec_data(local_stack, standin_image):
    data = gpu_spec_data(local_stack, "tensorrt", "rbs", openai=False)
    data["evaluation"] = {"enabled": False}
    yield data
    engine.remove_deployment(engine.connect(), data["deploy"]["name"], lambda _m: None)


def _one_line_error(r, expected: str) -> None:
    assert r.returncode == 1 and expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, \
        r.stdout[-2000:] + r.stderr[-2000:]


def _serving(name: str) -> str:
    [backend] = engine.containers(engine.connect(), name, role=engine.ROLE_BACKEND)
    return backend.labels[engine.LABEL_DIGEST]


def test_rollback_serves_a_gpu_build_from_s3_once_its_package_folder_and_the_local_runs_are_gone(
        tmp_path, local_stack, spec_data, worker_prefect_api):
    name = spec_data["deploy"]["name"]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_data))
    env = stoker_env(tmp_path, worker_prefect_api, local_stack, standin=True)
    home = Path(env["STOKER_HOME"]).resolve()

    first = stoker(["run", str(path)], env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    m1 = manifest_of(first)
    d1 = m1["steps"]["upload"]["digest"]
    _one_line_error(stoker(["rollback", name], env, timeout=300), "nothing to roll back to")

    # A second build of the same engine (another Triton batch size: another repository, the build a cache hit).
    spec_data["triton"] = {"max_batch_size": 4}
    path.write_text(yaml.safe_dump(spec_data))
    second = stoker(["run", str(path)], env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    m2 = manifest_of(second)
    d2 = m2["steps"]["upload"]["digest"]
    assert d2 != d1 and m2["steps"]["build"]["cache_hit"] and _serving(name) == d2

    # What this host loses: the first package's cache entry, as `stoker cache prune` removes it, and every manifest.
    packaged = Path(m1["steps"]["deploy"]["detail"]["repository_uri"])
    assert packaged.parent.parent.name == "package" and packaged.is_relative_to(home / "cache")
    shutil.rmtree(packaged.parent)
    shutil.rmtree(home / "runs")

    # Bad input, one line each, and the second build still serves.
    _one_line_error(stoker(["rollback", name], env, timeout=300), "pass --spec SPEC")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    unreachable = tmp_path / "unreachable.yaml"
    unreachable.write_text(yaml.safe_dump({**spec_data, "storage": {**spec_data["storage"], "endpoint_url": closed}}))
    _one_line_error(stoker(["rollback", name, "--spec", str(unreachable)], {**env, "AWS_MAX_ATTEMPTS": "1"},
                           timeout=300), f"{closed} is unreachable")
    # The first upload tampered with: a file of the same size with other bytes, which the marker's sizes let pass.
    st = spec_data["storage"]
    s3c = boto3.client("s3", endpoint_url=st["endpoint_url"], region_name="us-east-1", **{
        k.lower(): v for k, v in local_stack["aws_env"].items() if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    key = f"{st['prefix']}/repos/{d1[:24]}/model_repository/tensorrt_llm/config.pbtxt"
    original = s3c.get_object(Bucket=st["bucket"], Key=key)["Body"].read()
    s3c.put_object(Bucket=st["bucket"], Key=key, Body=original.replace(b"tensorrtllm", b"TENSORRTLLM"))
    _one_line_error(stoker(["rollback", name, "--spec", str(path)], env, timeout=300), "digest mismatch")
    s3c.put_object(Bucket=st["bucket"], Key=key, Body=original)
    assert _serving(name) == d2
    assert not list((home / "repos").glob("*"))  # no half copy left behind

    # The rollback: the history from S3, the repository from the first run's upload.
    back = stoker(["rollback", name, "--spec", str(path)], env, timeout=600)
    assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
    fetched = home / "repos" / d1[:24]
    assert f"downloaded from s3://{st['bucket']}/{st['prefix']}/repos/{d1[:24]}/model_repository into {fetched}" \
        in back.stdout, back.stdout
    assert f"serving run {m1['run_id']}" in back.stdout
    [backend] = engine.containers(engine.connect(), name, role=engine.ROLE_BACKEND)
    assert backend.labels[engine.LABEL_DIGEST] == d1 and backend.labels["ai.stoker.gpus"] == "0"
    assert {m["Source"] for m in backend.attrs["Mounts"] if m["Destination"] == "/models"} == {str(fetched)}
    assert backend.exec_run(["cat", "/models/tensorrt_llm/config.pbtxt"]).output == original
    # It answers through the stable address.
    req = urllib.request.Request(f"http://127.0.0.1:{spec_data['deploy']['ports']['http']}/v2/models/ensemble/generate",
                                 data=json.dumps(ENSEMBLE.request("Hello", 4, streaming=False)).encode(),
                                 headers={"Content-Type": "application/json"})
    assert json.loads(urllib.request.urlopen(req, timeout=60).read())["text_output"]
