"""S3 credentials from a Prefect AwsCredentials block, resolved without a Prefect API: the block objects are
prefect-aws's own, built in memory; the loader is replaced only where the API would answer."""

from __future__ import annotations

import pytest
from prefect_aws import AwsCredentials

from stoker.storage import credentials
from stoker.storage.credentials import AwsKeys, CredentialsError, aws_keys, client_kwargs, container_env, keys_from_block
from stoker.spec.schema import Storage

SECRET = "s3cr3t-never-printed"


@pytest.fixture(autouse=True)
def _no_ambient_aws(monkeypatch, tmp_path):
    """No AWS keys or config of this machine leak into what boto3 resolves."""
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    credentials._block_keys.cache_clear()
    yield
    credentials._block_keys.cache_clear()


@pytest.fixture
def blocks(monkeypatch):
    """Blocks by name, as the Prefect API would hand them out (a missing name raises like Prefect's)."""
    saved: dict[str, AwsCredentials] = {}
    loads: list[str] = []

    def load(name):
        loads.append(name)
        if name not in saved:
            raise credentials.BlockNotFound(name)
        return saved[name]

    monkeypatch.setattr(credentials, "load_block", load)
    return saved, loads


def test_no_block_named_means_boto3s_own_chain(blocks, monkeypatch):
    st = Storage(bucket="bkt")
    assert aws_keys(st) is None and client_kwargs(st) == {}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    assert container_env(st) == {"AWS_ACCESS_KEY_ID": "env-id", "AWS_SECRET_ACCESS_KEY": "env-secret",
                                 "AWS_DEFAULT_REGION": "us-east-1"}
    assert blocks[1] == []  # no Prefect call without a block


def test_a_named_block_supplies_the_keys_to_clients_and_the_container_over_the_environment(blocks, monkeypatch):
    saved, loads = blocks
    saved["s3-prod"] = AwsCredentials(aws_access_key_id="AKIDBLOCK", aws_secret_access_key=SECRET,
                                      aws_session_token="tok")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-id")  # the fallback only: the block wins
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    st = Storage(bucket="bkt", region="eu-west-1", credentials_block="s3-prod")
    assert client_kwargs(st) == {"aws_access_key_id": "AKIDBLOCK", "aws_secret_access_key": SECRET,
                                 "aws_session_token": "tok"}
    assert container_env(st) == {"AWS_ACCESS_KEY_ID": "AKIDBLOCK", "AWS_SECRET_ACCESS_KEY": SECRET,
                                 "AWS_SESSION_TOKEN": "tok", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert loads == ["s3-prod"]  # read once per process


def test_a_profile_block_resolves_as_boto3_does(tmp_path, monkeypatch):
    (tmp_path / "creds").write_text(f"[ci]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = {SECRET}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "creds"))
    keys = keys_from_block(AwsCredentials(profile_name="ci"))
    assert (keys.access_key_id, keys.secret_access_key, keys.session_token) == ("AKIDPROFILE", SECRET, None)


def test_missing_or_empty_blocks_fail_in_one_line_naming_block_and_bucket(blocks):
    saved, _ = blocks
    with pytest.raises(CredentialsError) as missing:
        aws_keys(Storage(bucket="bkt", credentials_block="nope"))
    assert str(missing.value) == ("storage.credentials_block 'nope' (bucket 'bkt'): "
                                  "no Prefect AwsCredentials block of that name")
    saved["empty"] = AwsCredentials()  # no keys, and boto3's chain has none here either
    with pytest.raises(CredentialsError) as empty:
        container_env(Storage(bucket="bkt", credentials_block="empty"))
    assert str(empty.value) == ("storage.credentials_block 'empty' (bucket 'bkt'): the block holds no AWS keys, "
                                "and boto3 found none either")


def test_an_unreadable_api_is_one_line_without_the_cause_text(monkeypatch):
    def down(name):
        raise RuntimeError(f"connection refused while sending {SECRET}")

    monkeypatch.setattr(credentials, "load_block", down)
    with pytest.raises(CredentialsError) as err:
        aws_keys(Storage(bucket="bkt", credentials_block="b"))
    assert str(err.value) == "storage.credentials_block 'b' (bucket 'bkt'): cannot load the block (RuntimeError)"


def test_secrets_stay_out_of_reprs_specs_and_manifests():
    keys = AwsKeys("AKIDX", SECRET, "tok")
    assert SECRET not in repr(keys) and "AKIDX" not in repr(keys)
    st = Storage(bucket="bkt", credentials_block="s3-prod")
    assert st.model_dump()["credentials_block"] == "s3-prod" and SECRET not in st.model_dump_json()
