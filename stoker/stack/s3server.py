"""A local S3 endpoint: moto's standalone server, a real HTTP S3 API (no MinIO is installable here).

In memory by default (the tests: one per process, thrown away). With ``data_dir`` (the demo and `make stack`) it is
moto behind stoker/stack/s3_persistent.py, which keeps every acknowledged object on disk: a reboot or a restart of
the service loses no repository, manifest or baseline.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request
from pathlib import Path

from stoker.stack.services import ServiceError, reuse_or_port, start_service

SERVICE_NAME = "s3"

# Dummy credentials for the local moto server only: moto accepts any key pair, but boto3 and
# Triton refuse to sign requests without one. They grant nothing anywhere else.
TEST_CREDENTIALS: dict[str, str] = {
    "AWS_ACCESS_KEY_ID": "stoker-local-test",
    "AWS_SECRET_ACCESS_KEY": "stoker-local-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def moto_server_bin() -> Path:
    """The moto_server console script of the running interpreter's environment."""
    path = Path(sys.executable).parent / "moto_server"
    if not path.exists():
        raise ServiceError(f"moto_server not found next to {sys.executable}; install moto[server]")
    return path


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP status means the server is handling requests
    except OSError:
        return False


def ensure_s3(state_dir: Path, port: int | None = None, timeout_s: float = 60, data_dir: Path | None = None) -> str:
    """Start moto_server on 127.0.0.1:port (a free port if None), or reuse ours; returns its URL. ``data_dir``: keep
    the objects there and load them back at start (stoker.stack.s3_persistent) instead of in memory only.

    Raises:
        ServiceError: ours already runs on a different port, or it failed to start
            (PortInUse if the port is held by something else).
    """
    running, port = reuse_or_port(SERVICE_NAME, state_dir, port)
    if running is not None:
        return running.url
    url = f"http://127.0.0.1:{port}"
    argv = ([sys.executable, "-m", "stoker.stack.s3_persistent", "--host", "127.0.0.1", "--port", str(port),
             "--data", str(Path(data_dir).resolve())] if data_dir is not None
            else [str(moto_server_bin()), "-H", "127.0.0.1", "-p", str(port)])
    start_service(
        SERVICE_NAME,
        argv,
        port,
        state_dir,
        ready=lambda: _answers_http(url + "/"),
        timeout_s=timeout_s,
    )
    return url


def s3_env(url: str) -> dict[str, str]:
    """Environment for a client (boto3, Triton) of the local S3 server at url."""
    return {**TEST_CREDENTIALS, "AWS_ENDPOINT_URL": url}


LOCAL_BLOCK = "stoker-local-s3"


def save_local_block(url: str, name: str = LOCAL_BLOCK) -> None:
    """A Prefect AwsCredentials block with this server's dummy keys and endpoint (`make stack` saves it), so a
    spec naming it (`storage.credentials_block`) runs on any worker, with no AWS_* in the worker's environment."""
    from stoker.storage.credentials import save_block

    save_block(name, TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"], TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
               TEST_CREDENTIALS["AWS_DEFAULT_REGION"], endpoint_url=url)
