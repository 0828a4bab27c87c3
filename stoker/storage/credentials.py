"""S3 credentials, resolved when used: a Prefect block (`storage.credentials_block`) or boto3's own chain.

Three consumers: boto3 clients (`client_kwargs`), preflight (`check`: a missing block, or keys the bucket
refuses, fail in one line naming the block and the bucket, before any heavy step) and the Triton backends,
which read the repository from S3 at every start, restart (Docker's restart policy, a reboot) and reload.

Backends get a credentials *file*, never keys in their environment: `refresh` resolves the keys now (the block
read again, or boto3's full chain: AWS_* variables, AWS_PROFILE with the shared config/credentials files, SSO,
assume-role, container/instance metadata) into frozen keys, and writes them in the AWS shared-credentials format
into the deployment's folder under $STOKER_HOME/credentials/ (0600, replaced atomically). That folder is mounted
read-only into every backend of the deployment, whose environment names only the path. Every deploy, rollback
and reconcile refreshes it, so a backend restarted after its keys were rotated or its session token expired
reads keys that work. Secrets stay in memory and in that file: specs, labels, manifests and logs hold the
block's name or the file's path, and error messages carry S3's error code, never its message (which may quote
the key id).
"""

from __future__ import annotations

import configparser
import io
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import write_atomic
from ..errors import StepError
from ..spec.schema import Storage

ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
# What S3 (and S3-compatible servers) answer for keys they do not accept. A HEAD has no body: a bare 403.
_REFUSED = frozenset({"403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                      "ExpiredToken", "TokenRefreshRequired", "InvalidClientTokenId", "AuthorizationHeaderMalformed"})
# Where a backend sees its deployment's credentials folder (mounted read-only), and the two files in it.
INSIDE = "/run/stoker/aws"
CREDENTIALS_NAME = "credentials"
CONFIG_NAME = "config"
# boto3 clients of one process reuse a block's keys this long (a Prefect API call per client otherwise); a
# backend's file is always written from keys read at that moment (`resolve`).
BLOCK_TTL_S = 60.0


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

    def shared_file(self) -> str:
        """The keys as an AWS shared-credentials file, profile [default]."""
        lines = ["[default]", f"aws_access_key_id = {self.access_key_id}",
                 f"aws_secret_access_key = {self.secret_access_key}"]
        if self.session_token:
            lines.append(f"aws_session_token = {self.session_token}")
        return "\n".join(lines) + "\n"

    @classmethod
    def parse_shared_file(cls, text: str) -> AwsKeys | None:
        """The [default] profile's keys of a shared-credentials file written by `shared_file`; None without keys."""
        cp = configparser.ConfigParser(interpolation=None)
        try:
            cp.read_file(io.StringIO(text))
        except configparser.Error:
            return None
        p = cp["default"] if cp.has_section("default") else {}
        key_id, secret = p.get("aws_access_key_id"), p.get("aws_secret_access_key")
        return cls(key_id, secret, p.get("aws_session_token") or None) if key_id and secret else None


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
    return _frozen(block.get_boto3_session())


def _frozen(session) -> AwsKeys | None:
    """A boto3 session's credentials as they are now: a refreshing provider (SSO, assume-role, metadata) is asked
    for its current keys, which a backend then uses until the next refresh."""
    creds = session.get_credentials()
    frozen = creds.get_frozen_credentials() if creds is not None else None
    if frozen is None or not frozen.access_key or not frozen.secret_key:
        return None
    return AwsKeys(frozen.access_key, frozen.secret_key, frozen.token or None)


_cache: dict[str, tuple[float, AwsKeys | None]] = {}
_cache_lock = threading.Lock()


def _block_keys(name: str, fresh: bool = False) -> AwsKeys | None:
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(name)
    if hit is not None and not fresh and now - hit[0] < BLOCK_TTL_S:
        return hit[1]
    keys = keys_from_block(load_block(name))
    with _cache_lock:
        _cache[name] = (now, keys)
    return keys


def aws_keys(storage: Storage, fresh: bool = False) -> AwsKeys | None:
    """The named block's keys (read again after BLOCK_TTL_S, or now with ``fresh``); None when the spec names no
    block (boto3's chain applies).

    Raises:
        CredentialsError: no such block, a block without keys, or the Prefect API cannot be read.
    """
    name = storage.credentials_block
    if not name:
        return None
    where = f"storage.credentials_block {name!r} (bucket {storage.bucket!r})"
    try:
        keys = _block_keys(name, fresh)
    except BlockNotFound:
        raise CredentialsError(f"{where}: no Prefect AwsCredentials block of that name") from None
    except Exception as err:  # noqa: BLE001 - the API down, a block of another shape: one line, no secrets
        raise CredentialsError(f"{where}: cannot load the block ({type(err).__name__})") from None
    if keys is None:
        raise CredentialsError(f"{where}: the block holds no AWS keys, and boto3 found none either")
    return keys


def resolve(storage: Storage) -> AwsKeys | None:
    """The keys valid now for ``storage``: the block's, read again; else boto3's full chain in this process
    (AWS_* variables, AWS_PROFILE and the shared files, SSO, assume-role, container/instance metadata). None
    when nothing supplies keys.

    Raises:
        CredentialsError: as `aws_keys`, or boto3's chain failed (an expired SSO login, a refused assume-role).
    """
    if storage.credentials_block:
        return aws_keys(storage, fresh=True)
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return _frozen(boto3.Session())
    except (BotoCoreError, ClientError) as err:  # the code only: a message may quote a key id or a role
        code = err.response.get("Error", {}).get("Code") if isinstance(err, ClientError) else type(err).__name__
        raise CredentialsError(f"bucket {storage.bucket!r}: boto3's credential chain (AWS_PROFILE "
                               f"{os.environ.get('AWS_PROFILE') or 'default'}) failed ({code})") from None


def client_kwargs(storage: Storage) -> dict[str, str]:
    """Credential arguments for `boto3.client("s3", …)`: the block's keys, or {} for boto3's own chain."""
    keys = aws_keys(storage)
    return keys.client_kwargs() if keys else {}


# ---------------------------------------------------------------- the backends' credentials file


def write_files(folder: Path, keys: AwsKeys | None, region: str) -> bool:
    """Write ``keys`` as ``folder``/credentials (and the region as ``folder``/config), each 0600 and replaced
    atomically; with no keys, remove them (a backend then gets none rather than stale ones). True when written.

    The folder, not the file, is what a backend mounts: a file bind mount keeps the inode it was given, so the
    container would go on seeing the replaced file; through a folder mount any later read sees the new one."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    if keys is None:
        for name in (CREDENTIALS_NAME, CONFIG_NAME):
            (folder / name).unlink(missing_ok=True)
        return False
    write_atomic(folder / CONFIG_NAME, f"[default]\nregion = {region}\n")
    write_atomic(folder / CREDENTIALS_NAME, keys.shared_file())  # mkstemp: 0600
    return True


def container_env(storage: Storage, folder: Path) -> dict[str, str]:
    """Refresh ``folder``'s credentials file for ``storage`` and return the backend's environment: the paths of
    the files as the backend sees them (``folder`` mounted at INSIDE) and the region; no secrets.

    Why a file: tritonserver's S3 filesystem (triton-inference-server/core src/filesystem/implementations/s3.h)
    uses explicit keys only when AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY are set; otherwise it builds its client
    from a ClientConfiguration for AWS_PROFILE (or "default") and the AWS SDK for C++'s default credential chain,
    whose profile provider reads AWS_SHARED_CREDENTIALS_FILE (tests/integration/test_credentials_blocks.py: a
    restarted tritonserver 2.51 loads with the refreshed file). Environment keys would be fixed at container
    creation: a restart after rotation or expiry would present dead keys.

    Raises:
        CredentialsError: see `resolve`.
    """
    written = write_files(folder, resolve(storage), storage.region)
    env = {"AWS_DEFAULT_REGION": storage.region}
    if written:
        env |= {"AWS_SHARED_CREDENTIALS_FILE": f"{INSIDE}/{CREDENTIALS_NAME}",
                "AWS_CONFIG_FILE": f"{INSIDE}/{CONFIG_NAME}"}
    return env


def mounts(env: dict[str, str], folder: Path) -> dict[str, str]:
    """The read-only mount (host -> container) a backend with ``env`` needs: ``folder`` when env names its file."""
    return {str(folder): INSIDE} if env.get("AWS_SHARED_CREDENTIALS_FILE", "").startswith(INSIDE + "/") else {}


def folder_of(deployment: str) -> Path:
    """The deployment's credentials folder on this host (mounted by its backends)."""
    from ..home import stoker_home

    return stoker_home() / "credentials" / deployment


def refresh(spec) -> dict[str, str]:
    """Write the keys valid now into ``spec``'s deployment's credentials file; returns its backends' environment.
    Deploys, rollbacks and `stoker reconcile` call it, so a backend's next start or reload reads working keys.

    Raises:
        CredentialsError: see `resolve`.
    """
    return container_env(spec.storage, folder_of(spec.deploy.name))


def container_keys(attrs: dict) -> AwsKeys | None:
    """The keys a backend container reads S3 with, from its `docker inspect` attributes: AWS_* in its environment
    (backends started before credentials files), else its mounted credentials file, read on this host."""
    env = dict(e.split("=", 1) for e in ((attrs or {}).get("Config") or {}).get("Env") or [] if "=" in e)
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return AwsKeys(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN") or None)
    path = env.get("AWS_SHARED_CREDENTIALS_FILE", "")
    inside, _, name = path.rpartition("/")
    source = next((m.get("Source") for m in (attrs or {}).get("Mounts") or [] if m.get("Destination") == inside), None)
    try:
        return AwsKeys.parse_shared_file((Path(source) / name).read_text()) if source and name else None
    except OSError:
        return None


# What tritonserver logs when S3 refuses its credentials (s3.h): at start "Unable to create S3 filesystem client.
# Check account credentials. Exception: '<code>' Message: '<text>'", at a later load "… due to exception: <code>,
# error message: <text>". A refused HEAD has no body, so its code is empty and its message "No response body."
_TRITON_S3_ERROR = re.compile(r"(?:Exception: '|due to exception: )([A-Za-z]*)'?,? (?:error message|Message): "
                              r"'?(No response body\.)?")
_REFUSED_NAMES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                            "ExpiredToken", "TokenRefreshRequired", "InvalidClientTokenId", "Forbidden"})


def refused_line(container: str, log_text: str) -> str | None:
    """One line saying that ``container``'s Triton could not read S3 with its credentials, and what to do, when its
    log says so; None otherwise. Only the error's name is quoted: S3's message may hold the key id."""
    reasons = [code or "a refused HEAD, which carries no error code" for code, bodiless
               in _TRITON_S3_ERROR.findall(log_text) if code in _REFUSED_NAMES or (not code and bodiless)]
    if not reasons:
        return None
    return (f"{container}: S3 refused the backend's credentials ({reasons[-1]}); rotate or renew them at their "
            "source, then `stoker reconcile` rewrites its credentials file, which its next start reads")


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
    with _cache_lock:
        _cache.pop(name, None)
