"""S3 credentials from Prefect blocks, on real servers: `prefect server start` (SQLite, basic auth) holds the
prefect-aws AwsCredentials blocks, and a moto_server that checks signatures (its IAM: one user with S3 rights;
the session's local S3 accepts any key pair, so it cannot tell wrong keys) holds the bucket.

In processes without AWS keys in their environment: a saved block passes preflight's credential check and its
keys open the bucket; a missing block and wrong keys fail preflight in one line naming the block and the
bucket, and `stoker run` stops there, before any heavy step; no secret appears in any output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid

import pytest
import yaml
from operate_helpers import ROOT, prefect_api, prefect_env, stoker  # noqa: F401

pytestmark = [pytest.mark.prefect, pytest.mark.s3, pytest.mark.slow]

BUCKET = "creds-it"
WRONG_SECRET = f"wrong-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def s3_auth(tmp_path_factory):
    """moto_server enforcing signatures; returns (url, access key id, secret) of a user allowed s3:*."""
    import boto3

    from stoker.stack.s3server import moto_server_bin
    from stoker.stack.services import free_port, start_service, stop_all

    state = tmp_path_factory.mktemp("s3-auth")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    start_service("s3-auth", [str(moto_server_bin()), "-H", "127.0.0.1", "-p", str(port)], port, state)
    # From here on moto checks every request against its IAM, except the next three (which create the user).
    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset-auth", data=b"3", method="POST",
                                                  headers={"Content-Type": "text/plain"}), timeout=10)
    boot = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": "boot",
            "aws_secret_access_key": "boot"}
    iam = boto3.client("iam", **boot)
    iam.create_user(UserName="stoker")
    key = iam.create_access_key(UserName="stoker")["AccessKey"]
    iam.put_user_policy(UserName="stoker", PolicyName="s3", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    keys = (key["AccessKeyId"], key["SecretAccessKey"])
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id=keys[0],
                      aws_secret_access_key=keys[1])
    s3.create_bucket(Bucket=BUCKET)
    with pytest.raises(Exception, match="InvalidAccessKeyId"):  # the server really refuses unknown keys
        boto3.client("s3", **boot).list_objects_v2(Bucket=BUCKET)
    yield url, *keys
    stop_all(state)


def _env(api, tmp_path) -> dict[str, str]:
    """The Prefect API, and no AWS keys or config of this machine: only a block can supply them."""
    env = {k: v for k, v in prefect_env(api).items() if not k.startswith("AWS_")}
    return env | {"AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                  "AWS_EC2_METADATA_DISABLED": "true"}


SCRIPT = r"""
import json, sys
import boto3
from stoker.storage import credentials
from stoker.storage import s3
from stoker.plan.preflight import check_storage, preflight
from stoker.spec.load import parse_spec

url, key_id, secret, wrong, ckpt, suffix = sys.argv[1:]
credentials.save_block(f"good-{suffix}", key_id, secret, endpoint_url=url)
credentials.save_block(f"bad-key-{suffix}", "AKIDNOSUCHKEY0000000", secret)
credentials.save_block(f"bad-secret-{suffix}", key_id, wrong)

def spec(block):
    return parse_spec({"model": {"local_path": ckpt},
                       "storage": {"bucket": "creds-it", "endpoint_url": url, "credentials_block": block}}, "it")

def outcome(fn):
    try:
        fn()
        return "ok"
    except Exception as err:
        return f"{type(err).__name__}: {err}"

log = []
good = spec(f"good-{suffix}")
client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", **credentials.client_kwargs(good.storage))
out = {
    "good_check": outcome(lambda: credentials.check(good.storage)),
    "good_bucket": outcome(lambda: s3.ensure_bucket(client, good.storage, create=False)),
    "good_container_env": sorted(credentials.container_env(good.storage)),
    "good_container_key": credentials.container_env(good.storage)["AWS_ACCESS_KEY_ID"] == key_id,
    "good_storage_check": outcome(lambda: check_storage(good)),
}
for name in ("missing", "bad-key", "bad-secret"):
    out[name] = outcome(lambda: preflight(spec(f"{name}-{suffix}"), log.append))
out["log"] = log
from stoker.stack.s3server import TEST_CREDENTIALS, save_local_block  # what `make stack` saves
save_local_block(url)
local = credentials.container_env(spec("stoker-local-s3").storage)
out["local_block"] = local["AWS_ACCESS_KEY_ID"] == TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(prefect_api, s3_auth, tmp_path_factory):
    api, _state = prefect_api
    url, key_id, secret = s3_auth
    tmp = tmp_path_factory.mktemp("creds")
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 4, "vocab_size": 2048,
        "max_position_embeddings": 512, "torch_dtype": "float32"}))
    suffix = uuid.uuid4().hex[:6]
    r = subprocess.run([sys.executable, "-c", SCRIPT, url, key_id, secret, WRONG_SECRET, str(ckpt), suffix],
                       cwd=ROOT, env=_env(api, tmp), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    return out, r.stdout + r.stderr, suffix, (url, key_id, secret, ckpt, api, tmp)


def test_a_saved_block_opens_the_bucket_and_reaches_the_container(results):
    out, _text, _suffix, (_url, _key_id, _secret, *_rest) = results
    assert out["good_check"] == "ok"
    assert out["good_bucket"] == "ok"
    assert out["good_container_env"] == ["AWS_ACCESS_KEY_ID", "AWS_DEFAULT_REGION", "AWS_SECRET_ACCESS_KEY"]
    assert out["good_container_key"] is True
    assert out["local_block"] is True  # make stack's block for the local S3 server loads


def test_missing_block_and_wrong_keys_fail_preflight_in_one_line(results):
    out, text, suffix, (url, key_id, secret, *_rest) = results
    assert out["missing"] == (f"CredentialsError: storage.credentials_block 'missing-{suffix}' (bucket 'creds-it'): "
                              "no Prefect AwsCredentials block of that name")
    for name in ("bad-key", "bad-secret"):
        assert out[name] == (f"CredentialsError: storage.credentials_block '{name}-{suffix}': bucket 'creds-it' at "
                             f"{url} refused its keys (403)")
    assert out["log"] == []  # nothing passed preflight
    for s in (secret, WRONG_SECRET):
        assert s not in text


def test_preflight_storage_check_uses_the_blocks_keys(results):
    out = results[0]
    assert out["good_storage_check"] == "ok", out["good_storage_check"]


def test_stoker_run_stops_at_preflight_naming_the_block(results):
    _out, _text, suffix, (url, _key_id, secret, ckpt, api, tmp) = results
    spec = {"model": {"local_path": str(ckpt)}, "storage": {"bucket": BUCKET, "endpoint_url": url,
                                                             "credentials_block": f"bad-secret-{suffix}"}}
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = stoker(["run", str(path)], env=_env(api, tmp), timeout=300)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == (
        f"stoker: error: storage.credentials_block 'bad-secret-{suffix}': bucket '{BUCKET}' at {url} refused its "
        "keys (403)")
    assert WRONG_SECRET not in r.stdout + r.stderr and secret not in r.stdout + r.stderr
