"""S3 credentials from a Prefect block: the prefect-aws `AwsCredentials` named by `storage.credentials_block`.

With a block, any worker in any pool reaches the bucket with the same keys, and the same keys reach the Triton
container; without one, boto3's own chain applies (AWS_* in the environment, ~/.aws, an instance role). The block
is read as boto3 reads it (explicit keys, a profile, or an assumed role), once per process.

Three consumers, one resolution: boto3 clients (`client_kwargs`), the Triton container (`container_env`) and
preflight (`check`: a missing block, or keys the bucket refuses, fail in one line naming the block and the
bucket, before any heavy step). Secrets stay in memory: specs, manifests and logs hold the block's name only,
and error messages carry S3's error code, never its message (which may quote the key id).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from ..errors import StepError
from ..spec.schema import Storage

ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
# What S3 (and S3-compatible servers) answer for keys they do not accept. A HEAD has no body: a bare 403.
_REFUSED = frozenset({"403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                      "ExpiredToken", "TokenRefreshRequired", "InvalidClientTokenId", "AuthorizationHeaderMalformed"})


class CredentialsError(StepError):
    """The named credentials block is missing, holds no keys, or the bucket refuses its keys."""


@dataclass(frozen=True)
class AwsKeys:
    """A resolved key pair (and session token); repr=False keeps the secrets out of logs and tracebacks."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    def client_kwargs(self) -> dict[str, str]:
        kw = {"aws_access_key_id": self.access_key_id, "aws_secret_access_key": self.secret_access_key}
        return kw | ({"aws_session_token": self.session_token} if self.session_token else {})

    def env(self) -> dict[str, str]:
        env = {"AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key}
        return env | ({"AWS_SESSION_TOKEN": self.session_token} if self.session_token else {})


class BlockNotFound(LookupError):
    pass


def load_block(name: str):
    """The prefect-aws AwsCredentials block saved under `name` on the Prefect API."""
    from prefect_aws import AwsCredentials

    try:
        return AwsCredentials.load(name)
    except ValueError as err:  # Prefect's "Unable to find block document named …"
        if "Unable to find block document" in str(err):
            raise BlockNotFound(name) from None
        raise


def keys_from_block(block) -> AwsKeys | None:
    """The keys boto3 resolves from the block (None when neither it nor boto3's chain has any)."""
    creds = block.get_boto3_session().get_credentials()
    frozen = creds.get_frozen_credentials() if creds is not None else None
    if frozen is None or not frozen.access_key or not frozen.secret_key:
        return None
    return AwsKeys(frozen.access_key, frozen.secret_key, frozen.token or None)


@functools.lru_cache(maxsize=16)
def _block_keys(name: str) -> AwsKeys | None:
    return keys_from_block(load_block(name))


def aws_keys(storage: Storage) -> AwsKeys | None:
    """The named block's keys; None when the spec names no block (boto3's chain applies).

    Raises:
        CredentialsError: no such block, a block without keys, or the Prefect API cannot be read.
    """
    name = storage.credentials_block
    if not name:
        return None
    where = f"storage.credentials_block {name!r} (bucket {storage.bucket!r})"
    try:
        keys = _block_keys(name)
    except BlockNotFound:
        raise CredentialsError(f"{where}: no Prefect AwsCredentials block of that name") from None
    except Exception as err:  # noqa: BLE001 - the API down, a block of another shape: one line, no secrets
        raise CredentialsError(f"{where}: cannot load the block ({type(err).__name__})") from None
    if keys is None:
        raise CredentialsError(f"{where}: the block holds no AWS keys, and boto3 found none either")
    return keys


def client_kwargs(storage: Storage) -> dict[str, str]:
    """Credential arguments for `boto3.client("s3", …)`: the block's keys, or {} for boto3's own chain."""
    keys = aws_keys(storage)
    return keys.client_kwargs() if keys else {}


def container_env(storage: Storage) -> dict[str, str]:
    """AWS_* for a Triton container reading the repository: the block's keys, else the environment's, and the
    region (secrets: pass to the container only, never log)."""
    keys = aws_keys(storage)
    env = keys.env() if keys else {k: os.environ[k] for k in ENV_KEYS if os.environ.get(k)}
    return env | {"AWS_DEFAULT_REGION": storage.region}


def check(storage: Storage) -> None:
    """Preflight for a named block: it exists, holds keys, and the bucket does not refuse them (one HEAD).

    An unreachable endpoint or a missing bucket is not this check's to report: preflight's S3 check says it.
    Raises:
        CredentialsError: one line naming the block and the bucket.
    """
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    keys = aws_keys(storage)
    if keys is None:
        return
    s3 = boto3.client("s3", endpoint_url=storage.endpoint_url, region_name=storage.region,
                      config=Config(connect_timeout=5, read_timeout=10, retries={"total_max_attempts": 2}),
                      **keys.client_kwargs())
    try:
        s3.head_bucket(Bucket=storage.bucket)
    except ClientError as err:
        code = str(err.response.get("Error", {}).get("Code", ""))
        if code in _REFUSED:
            raise CredentialsError(f"storage.credentials_block {storage.credentials_block!r}: bucket "
                                   f"{storage.bucket!r} at {storage.endpoint_url or 'AWS S3'} refused its keys "
                                   f"({code})") from None
    except BotoCoreError:
        pass


def save_block(name: str, access_key_id: str, secret_access_key: str, region: str = "us-east-1",
               endpoint_url: str | None = None) -> None:
    """Save (or overwrite) an AwsCredentials block; `make stack` makes one for the local S3 server."""
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    AwsCredentials(aws_access_key_id=access_key_id, aws_secret_access_key=secret_access_key, region_name=region,
                   aws_client_parameters=AwsClientParameters(endpoint_url=endpoint_url)).save(name, overwrite=True)
    _block_keys.cache_clear()
