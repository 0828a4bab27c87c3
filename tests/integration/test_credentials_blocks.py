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
    """moto_server enforcing signatures; returns (url, access key id, secret) of a user allowed s3:* (and iam:*, to
    make the users whose keys a test revokes)."""
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
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:*", "iam:*"], "Resource": "*"}]}))
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
import json, pathlib, sys
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
folder = pathlib.Path(ckpt).parent / "backend-credentials"

def written():
    return credentials.AwsKeys.parse_shared_file((folder / "credentials").read_text())

good = spec(f"good-{suffix}")
client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", **credentials.client_kwargs(good.storage))
out = {
    "good_check": outcome(lambda: credentials.check(good.storage)),
    "good_bucket": outcome(lambda: s3.ensure_bucket(client, good.storage, create=False)),
    "good_container_env": sorted(credentials.container_env(good.storage, folder)),
    "good_container_key": written().access_key_id == key_id,
    "good_storage_check": outcome(lambda: check_storage(good)),
}
for name in ("missing", "bad-key", "bad-secret"):
    out[name] = outcome(lambda: preflight(spec(f"{name}-{suffix}"), log.append))
out["log"] = log
from stoker.stack.s3server import TEST_CREDENTIALS, save_local_block  # what `make stack` saves
save_local_block(url)
credentials.container_env(spec("stoker-local-s3").storage, folder)
out["local_block"] = written().access_key_id == TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results(prefect_api, s3_auth, tmp_path_factory):  # noqa: F811
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
    # The container's environment names the credentials file only; the block's keys are in that file.
    assert out["good_container_env"] == ["AWS_CONFIG_FILE", "AWS_DEFAULT_REGION", "AWS_SHARED_CREDENTIALS_FILE"]
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


# ---------------------------------------------------------------- credentials that last: a real backend restarts

ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
ECHO_MODEL = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                                 .as_numpy())]) for r in requests]
"""

RESTART_SCRIPT = r"""
import json, os, stat, sys, time, urllib.request
import boto3, docker
from stoker.containers import engine
from stoker.containers.ports import Ports
from stoker.deploy import rollout
from stoker.spec.load import parse_spec
from stoker.stack.services import free_port
from stoker.storage import credentials

url, admin_key, admin_secret, ckpt, suffix, profile_file, models = sys.argv[1:]
admin = {"endpoint_url": url, "region_name": "us-east-1", "aws_access_key_id": admin_key,
         "aws_secret_access_key": admin_secret}
iam = boto3.client("iam", **admin)
s3c = boto3.client("s3", **admin)
user = f"rotating-{suffix}"  # a user of its own: the module's other tests keep using the admin's keys
user_arn = iam.create_user(UserName=user)["User"]["Arn"]
iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps({
    "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:*", "sts:AssumeRole"], "Resource": "*"}]}))
first = iam.create_access_key(UserName=user)["AccessKey"]
key_a, secret_a = first["AccessKeyId"], first["SecretAccessKey"]
prefix = f"restart-{suffix}/model_repository"
for rel in ("echo/config.pbtxt", "echo/1/model.py"):
    s3c.put_object(Bucket="creds-it", Key=f"{prefix}/{rel}", Body=open(f"{models}/{rel}", "rb").read())
block = f"rotating-{suffix}"
credentials.save_block(block, key_a, secret_a, endpoint_url=url)
client = docker.from_env()
out, started = {}, []

def spec(name, block):
    storage = {"bucket": "creds-it", "endpoint_url": url} | ({"credentials_block": block} if block else {})
    return parse_spec({"model": {"local_path": ckpt}, "storage": storage, "deploy": {"name": name}}, "it")

def start(sp):
    env = rollout.container_env(sp)  # refreshes the deployment's credentials file
    uri = f"s3://{url.split('://', 1)[1]}/creds-it/{prefix}"
    b = rollout.backend_spec(sp, uri, "d" * 64, env, run_id="it", reload=False)
    ports = Ports(free_port(), free_port(), free_port())
    c = engine.start_backend(client, b, "blue", ports)
    started.append(c)
    return c, f"http://127.0.0.1:{ports.http}"

def ready(c, http, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{http}/v2/models/echo/ready", timeout=2) as r:
                if r.status == 200:
                    return "ready"
        except OSError:
            pass
        c.reload()
        if c.status == "exited":
            return f"exited {c.attrs['State']['ExitCode']}"
        time.sleep(0.5)
    return "timeout"

try:
    sp = spec(f"cred{suffix}", block)
    c, http = start(sp)
    out["first"] = ready(c, http)
    folder = credentials.folder_of(sp.deploy.name)
    out["file_mode"] = oct(stat.S_IMODE((folder / "credentials").stat().st_mode))
    c.reload()
    out["env"] = sorted(e.split("=", 1)[0] for e in c.attrs["Config"]["Env"] if e.startswith("AWS_"))
    out["mounts"] = [(m["Source"] == str(folder), m["Destination"], m["RW"]) for m in c.attrs["Mounts"]]
    inspect = json.dumps(c.attrs)
    out["secret_in_inspect"] = secret_a in inspect
    # Revoke A at the source (moto then refuses it), rotate the block to B, but do not refresh: the restart,
    # as after a reboot, presents A and fails.
    iam.delete_access_key(UserName=user, AccessKeyId=key_a)
    new = iam.create_access_key(UserName=user)["AccessKey"]
    key_b, secret_b = new["AccessKeyId"], new["SecretAccessKey"]
    credentials.save_block(block, key_b, secret_b, endpoint_url=url)
    c.restart(timeout=10)
    out["stale"] = ready(c, http, timeout_s=60)
    logs = c.logs().decode(errors="replace")
    out["stale_line"] = credentials.refused_line(c.name, logs)
    # The refresh stoker does at every deploy and reconcile, then the same restart: the models load again.
    credentials.refresh(sp)
    c.restart(timeout=10)
    out["refreshed"] = ready(c, http)
    out["file_is_b"] = credentials.AwsKeys.parse_shared_file((folder / "credentials").read_text()).access_key_id == key_b
    # No block, no AWS_* keys: AWS_PROFILE names an assumed role whose source profile is in a shared-credentials
    # file; boto3's chain calls STS here, and the backend gets the role's temporary keys and session token.
    role = iam.create_role(RoleName=f"reader-{suffix}", AssumeRolePolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                "Principal": {"AWS": user_arn}}]}))["Role"]  # moto checks the trust policy
    iam.put_role_policy(RoleName=role["RoleName"], PolicyName="s3", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    with open(profile_file, "w") as f:
        f.write(f"[ci-source]\naws_access_key_id = {key_b}\naws_secret_access_key = {secret_b}\n")
    with open(profile_file + ".config", "w") as f:
        f.write(f"[profile ci-role]\nrole_arn = {role['Arn']}\nsource_profile = ci-source\n")
    os.environ.update(AWS_SHARED_CREDENTIALS_FILE=profile_file, AWS_CONFIG_FILE=profile_file + ".config",
                      AWS_PROFILE="ci-role", AWS_ENDPOINT_URL_STS=url, AWS_DEFAULT_REGION="us-east-1")
    c2, http2 = start(spec(f"prof{suffix}", None))
    role_keys = credentials.AwsKeys.parse_shared_file(
        (credentials.folder_of(f"prof{suffix}") / "credentials").read_text())
    out["profile_keys"] = [role_keys.access_key_id not in (key_a, key_b), bool(role_keys.session_token)]
    out["profile"] = ready(c2, http2)
    c2.reload()
    out["profile_secret_in_inspect"] = secret_b in json.dumps(c2.attrs)
    out["logs_hold_secret"] = any(s in (x.logs().decode(errors="replace")) for x in (c, c2) for s in (secret_a, secret_b))
    out["secrets"] = [secret_a, secret_b]  # for the test to look for in this process's output
finally:
    for c in started:
        c.remove(force=True)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def restarts(prefect_api, s3_auth, tmp_path_factory):  # noqa: F811
    """A real Triton backend (the CPU image) reading a one-model repository from the signature-checking S3."""
    api, _state = prefect_api
    url, key_id, secret = s3_auth
    tmp = tmp_path_factory.mktemp("restart")
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    env = _env(api, tmp) | {"STOKER_HOME": str(tmp / "home")}
    (tmp / "models" / "echo" / "1").mkdir(parents=True)
    (tmp / "models" / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (tmp / "models" / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    r = subprocess.run([sys.executable, "-c", RESTART_SCRIPT, url, key_id, secret, str(ckpt), uuid.uuid4().hex[:6],
                        str(tmp / "profile-credentials"), str(tmp / "models")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    return out, (r.stdout.split("RESULT ", 1)[0] + r.stderr), out.pop("secrets")


@pytest.mark.docker
def test_a_backend_restarted_after_rotation_and_refresh_loads_its_models(restarts):
    out, text, secrets = restarts
    assert out["first"] == "ready"
    assert out["env"] == ["AWS_CONFIG_FILE", "AWS_DEFAULT_REGION", "AWS_SHARED_CREDENTIALS_FILE"]
    assert out["mounts"] == [[True, "/run/stoker/aws", False]]  # the folder, read-only
    assert out["file_mode"] == "0o600"
    assert out["refreshed"] == "ready" and out["file_is_b"] is True
    assert out["secret_in_inspect"] is False and out["logs_hold_secret"] is False
    assert not any(s in text for s in secrets)


@pytest.mark.docker
def test_without_refresh_the_restart_fails_and_says_so_in_one_line(restarts):
    out = restarts[0]
    assert out["stale"].startswith("exited"), out["stale"]
    assert out["stale_line"] is not None and out["stale_line"].endswith(
        "S3 refused the backend's credentials (a refused HEAD, which carries no error code); rotate or renew them at their source, then "
        "`stoker reconcile` rewrites its credentials file, which its next start reads"), out["stale_line"]


@pytest.mark.docker
def test_an_assumed_role_profile_without_aws_keys_still_reaches_the_backend(restarts):
    out = restarts[0]
    assert out["profile_keys"] == [True, True]  # the role's temporary keys, with a session token, not B's
    assert out["profile"] == "ready" and out["profile_secret_in_inspect"] is False


# The signing key from a Prefect Secret block (signing.key_secret), on the module's Prefect server: saved with
# Prefect's own Secret block, resolved by stoker/storage/signing_keys.py in a process whose environment names no key
# file, a build signed with it verifies with the public key derived from it; a missing block and an empty one are
# refused in one line naming the block; the key never reaches the output.
SIGNING_SCRIPT = r"""
import json, sys, tempfile
from pathlib import Path
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prefect.blocks.system import Secret
from stoker.errors import SpecError
from stoker.spec.schema import Signing
from stoker.storage import signature, signing_keys
from stoker.storage.digest import tree_records

suffix = sys.argv[1]
key = ec.generate_private_key(ec.SECP256R1())
pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                        serialization.NoEncryption()).decode()
Secret(value=pem).save(f"sign-{suffix}")
Secret(value="").save(f"empty-{suffix}")
out = {}
loaded = signing_keys.private_key(Signing(key_secret=f"sign-{suffix}"))
out["same_key"] = loaded.private_numbers().private_value == key.private_numbers().private_value
folder = Path(tempfile.mkdtemp())
(folder / "model.plan").write_bytes(b"weights")
blob = signature.sign(tree_records(folder), loaded, "build", "d1")
signed = signature.verify(blob, signing_keys.public_key(Signing(key_secret=f"sign-{suffix}")), "model.sig")
out["verified_digest"] = signed.digest
out["describe"] = signing_keys.describe(Signing(key_secret=f"sign-{suffix}"))
for name in (f"missing-{suffix}", f"empty-{suffix}"):
    try:
        signing_keys.private_key(Signing(key_secret=name))
        out[name.split("-")[0]] = "loaded"
    except SpecError as err:
        out[name.split("-")[0]] = str(err)
print("PEM " + json.dumps(pem.splitlines()[1]))
print("RESULT " + json.dumps(out))
"""


def test_the_signing_key_from_a_prefect_secret_block_signs_and_verifies(prefect_api, tmp_path):  # noqa: F811
    api, _state = prefect_api
    suffix = uuid.uuid4().hex[:6]
    env = {k: v for k, v in prefect_env(api).items() if not k.startswith("STOKER_SIGNING")}
    r = subprocess.run([sys.executable, "-c", SIGNING_SCRIPT, suffix], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert out["same_key"] is True
    assert out["verified_digest"] == "d1"
    assert out["describe"] == (f"builds signed (key: Prefect Secret block 'sign-{suffix}'); verified before a backend "
                               "starts (the signing key's public key)")
    assert out["missing"] == f"signing.key_secret: no Prefect Secret block named 'missing-{suffix}'"
    assert out["empty"] == f"signing.key_secret: Prefect Secret 'empty-{suffix}' is empty"
    # A line of the key's body was printed on purpose, apart: nothing else of the output holds it.
    body = json.loads(r.stdout.split("PEM ", 1)[1].splitlines()[0])
    rest = r.stdout.replace("PEM " + json.dumps(body), "") + r.stderr
    assert body not in rest
