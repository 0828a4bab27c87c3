"""Which S3 failures are retried (a stall, a dropped connection, a busy server) and which fail at once."""

from __future__ import annotations

import pytest
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import (ClientError, ConnectionClosedError, ConnectTimeoutError, EndpointConnectionError,
                                 NoCredentialsError, ReadTimeoutError, SSLError)

from stoker.storage import s3
from stoker.errors import is_transient
from stoker.spec.schema import Storage

STORAGE = Storage(bucket="bkt", endpoint_url="http://127.0.0.1:9")
URL = "http://127.0.0.1:9/bkt/k"


def _client_error(code: str, status: int = 400) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def _wrapped(err: ClientError) -> S3UploadFailedError:
    try:
        try:
            raise err
        except ClientError as e:
            raise S3UploadFailedError(f"Failed to upload f to bkt/k: {e}")  # as boto3's upload_file does
    except S3UploadFailedError as outer:
        return outer


@pytest.mark.parametrize("err", [
    ConnectionClosedError(endpoint_url=URL), ReadTimeoutError(endpoint_url=URL),
    ConnectTimeoutError(endpoint_url=URL), EndpointConnectionError(endpoint_url=URL),
    _client_error("SlowDown", 503), _client_error("InternalError", 500), _client_error("RequestTimeout"),
    _wrapped(_client_error("ServiceUnavailable", 503)),
], ids=lambda e: type(e).__name__)
def test_stalls_drops_and_busy_servers_are_transient(err):
    out = s3.failure(err, "upload to s3://bkt/p failed", STORAGE)
    assert isinstance(out, s3.S3Unreachable) and is_transient(out)
    assert "\n" not in str(out) and str(out).startswith("upload to s3://bkt/p failed: ")


@pytest.mark.parametrize("err, needle", [
    (_client_error("AccessDenied", 403), "AccessDenied"), (_client_error("NoSuchBucket", 404), "NoSuchBucket"),
    (_client_error("InvalidAccessKeyId", 403), "InvalidAccessKeyId"),
    (_wrapped(_client_error("SignatureDoesNotMatch", 403)), "SignatureDoesNotMatch"),
    (NoCredentialsError(), "Unable to locate credentials"), (SSLError(endpoint_url=URL, error="bad cert"), "SSL"),
], ids=lambda e: getattr(e, "__name__", type(e).__name__))
def test_auth_permission_and_missing_buckets_fail_at_once(err, needle):
    out = s3.failure(err, "upload to s3://bkt/p failed", STORAGE)
    assert isinstance(out, s3.S3Error) and not is_transient(out)
    assert "\n" not in str(out) and needle in str(out)


def test_timeouts_and_attempts_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.setenv("STOKER_S3_CONNECT_TIMEOUT_S", "2.5")
    monkeypatch.setenv("STOKER_S3_READ_TIMEOUT_S", "7")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    cfg = s3.client(STORAGE).meta.config
    assert (cfg.connect_timeout, cfg.read_timeout) == (2.5, 7.0)
    assert cfg.retries == {"mode": "standard", "total_max_attempts": 3}
    monkeypatch.delenv("STOKER_S3_CONNECT_TIMEOUT_S")
    monkeypatch.delenv("STOKER_S3_READ_TIMEOUT_S")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    cfg = s3.client(STORAGE).meta.config
    assert (cfg.connect_timeout, cfg.read_timeout) == (s3.CONNECT_TIMEOUT_S, s3.READ_TIMEOUT_S)
    assert cfg.retries["total_max_attempts"] == s3.MAX_ATTEMPTS
    monkeypatch.setenv("STOKER_S3_READ_TIMEOUT_S", "soon")
    with pytest.raises(s3.S3Error, match="STOKER_S3_READ_TIMEOUT_S='soon': not a positive number"):
        s3.client(STORAGE)
