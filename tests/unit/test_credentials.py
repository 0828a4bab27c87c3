"""S3 credentials from a Prefect AwsCredentials block, resolved without a Prefect API: the block objects are
prefect-aws's own, built in memory; the loader is replaced only where the API would answer. The backends'
credentials file: written from keys resolved now, 0600, atomically, and the environment holds only its path."""

from __future__ import annotations

import stat

import pytest
from prefect_aws import AwsCredentials

from stoker.storage import credentials
from stoker.storage.credentials import (AwsKeys, CredentialsError, aws_keys, client_kwargs, container_env,
                                       container_keys, keys_from_block, mounts, refused_line)
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
    credentials._cache.clear()
    yield
    credentials._cache.clear()


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


FILE_ENV = {"AWS_SHARED_CREDENTIALS_FILE": "/run/stoker/aws/credentials", "AWS_CONFIG_FILE": "/run/stoker/aws/config"}


def written(folder) -> AwsKeys | None:
    return AwsKeys.parse_shared_file((folder / "credentials").read_text())


def test_no_block_named_means_boto3s_own_chain(blocks, monkeypatch, tmp_path):
    st = Storage(bucket="bkt")
    assert aws_keys(st) is None and client_kwargs(st) == {}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    folder = tmp_path / "creds"
    assert container_env(st, folder) == {"AWS_DEFAULT_REGION": "us-east-1", **FILE_ENV}
    assert written(folder) == AwsKeys("env-id", "env-secret")
    assert blocks[1] == []  # no Prefect call without a block


def test_a_profile_in_the_environment_reaches_the_backend_as_frozen_keys(monkeypatch, tmp_path):
    """AWS_PROFILE and a shared-credentials file, no AWS_* keys: boto3's chain resolves them here, and the
    backend gets them in its own file (its AWS_PROFILE would name a profile it has no file for)."""
    src = tmp_path / "home-creds"
    src.write_text(f"[dev]\naws_access_key_id = AKIDDEV\naws_secret_access_key = {SECRET}\naws_session_token = t1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(src))
    monkeypatch.setenv("AWS_PROFILE", "dev")
    folder = tmp_path / "creds"
    env = container_env(Storage(bucket="bkt", region="eu-west-1"), folder)
    assert env == {"AWS_DEFAULT_REGION": "eu-west-1", **FILE_ENV}
    assert written(folder) == AwsKeys("AKIDDEV", SECRET, "t1")
    assert (folder / "config").read_text() == "[default]\nregion = eu-west-1\n"
    for f in (folder / "credentials", folder / "config"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    # Rotated at the source: the next refresh writes the new keys over the old, and nothing else is left there.
    src.write_text(f"[dev]\naws_access_key_id = AKIDDEV2\naws_secret_access_key = {SECRET}2\n")
    container_env(Storage(bucket="bkt", region="eu-west-1"), folder)
    assert written(folder) == AwsKeys("AKIDDEV2", SECRET + "2")
    assert sorted(p.name for p in folder.iterdir()) == ["config", "credentials"]


def test_no_keys_anywhere_removes_the_file_and_mounts_nothing(tmp_path):
    folder = tmp_path / "creds"
    folder.mkdir()
    (folder / "credentials").write_text("[default]\naws_access_key_id = OLD\naws_secret_access_key = OLD\n")
    env = container_env(Storage(bucket="bkt"), folder)
    assert env == {"AWS_DEFAULT_REGION": "us-east-1"} and not (folder / "credentials").exists()
    assert mounts(env, folder) == {}
    assert mounts({**env, **FILE_ENV}, folder) == {str(folder): "/run/stoker/aws"}


def test_a_backends_keys_are_read_back_from_its_mounted_file(tmp_path):
    """What `docker inspect` shows of a backend: the file's path in Env, the folder in Mounts."""
    (tmp_path / "credentials").write_text(AwsKeys("AKIDM", SECRET).shared_file())
    attrs = {"Config": {"Env": ["PATH=/bin", "AWS_SHARED_CREDENTIALS_FILE=/run/stoker/aws/credentials"]},
             "Mounts": [{"Source": str(tmp_path), "Destination": "/run/stoker/aws"}]}
    assert container_keys(attrs) == AwsKeys("AKIDM", SECRET)
    old = {"Config": {"Env": ["AWS_ACCESS_KEY_ID=AKIDE", f"AWS_SECRET_ACCESS_KEY={SECRET}"]}}
    assert container_keys(old) == AwsKeys("AKIDE", SECRET)
    assert container_keys({"Config": {"Env": []}}) is None


def test_tritons_refusal_becomes_one_line_without_s3s_message():
    log = ("E1128 06:10:00.1 server.cc:250] failed to load: Could not get MetaData for bucket with name b due to "
           "exception: InvalidAccessKeyId, error message: The AWS Access Key Id AKIDLEAK you provided does not exist")
    line = refused_line("stoker-d-blue", log)
    assert line == ("stoker-d-blue: S3 refused the backend's credentials (InvalidAccessKeyId); rotate or renew them "
                    "at their source, then `stoker reconcile` rewrites its credentials file, which its next "
                    "start reads")
    assert "AKIDLEAK" not in line and refused_line("c", "I1128 server started") is None
    # What tritonserver 2.51 printed in tests/integration/test_credentials_blocks.py after its key was deleted.
    start = ("error: creating server: Internal - Unable to create S3 filesystem client. Check account credentials. "
             "Exception: '' Message: 'No response body.'")
    assert refused_line("b", start).startswith("b: S3 refused the backend's credentials (a refused HEAD, which "
                                               "carries no error code); ")
    unreachable = "Exception: '' Message: 'curlCode: 7, Couldn't connect to server'"
    assert refused_line("b", unreachable) is None  # not the credentials' fault


def test_a_named_block_supplies_the_keys_to_clients_and_the_container_over_the_environment(blocks, monkeypatch,
                                                                                            tmp_path):
    saved, loads = blocks
    saved["s3-prod"] = AwsCredentials(aws_access_key_id="AKIDBLOCK", aws_secret_access_key=SECRET,
                                      aws_session_token="tok")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-id")  # the fallback only: the block wins
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    st = Storage(bucket="bkt", region="eu-west-1", credentials_block="s3-prod")
    assert client_kwargs(st) == {"aws_access_key_id": "AKIDBLOCK", "aws_secret_access_key": SECRET,
                                 "aws_session_token": "tok"}
    assert loads == ["s3-prod"]
    assert client_kwargs(st)["aws_access_key_id"] == "AKIDBLOCK" and loads == ["s3-prod"]  # clients: BLOCK_TTL_S
    env = container_env(st, tmp_path)
    assert env == {"AWS_DEFAULT_REGION": "eu-west-1", **FILE_ENV} and SECRET not in str(env)
    assert written(tmp_path) == AwsKeys("AKIDBLOCK", SECRET, "tok")
    assert loads == ["s3-prod", "s3-prod"]  # a backend's file: the block read again, never a cached copy
    # The block rotated: the next refresh writes the new keys, whatever this process read before.
    saved["s3-prod"] = AwsCredentials(aws_access_key_id="AKIDNEW", aws_secret_access_key=SECRET + "2")
    container_env(st, tmp_path)
    assert written(tmp_path) == AwsKeys("AKIDNEW", SECRET + "2")


def test_a_profile_block_resolves_as_boto3_does(tmp_path, monkeypatch):
    (tmp_path / "creds").write_text(f"[ci]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = {SECRET}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "creds"))
    keys = keys_from_block(AwsCredentials(profile_name="ci"))
    assert (keys.access_key_id, keys.secret_access_key, keys.session_token) == ("AKIDPROFILE", SECRET, None)


def test_missing_or_empty_blocks_fail_in_one_line_naming_block_and_bucket(blocks, tmp_path):
    saved, _ = blocks
    with pytest.raises(CredentialsError) as missing:
        aws_keys(Storage(bucket="bkt", credentials_block="nope"))
    assert str(missing.value) == ("storage.credentials_block 'nope' (bucket 'bkt'): "
                                  "no Prefect AwsCredentials block of that name")
    saved["empty"] = AwsCredentials()  # no keys, and boto3's chain has none here either
    with pytest.raises(CredentialsError) as empty:
        container_env(Storage(bucket="bkt", credentials_block="empty"), tmp_path)
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
