"""The model repository a running backend container serves: in S3, read with that container's own credentials, or
a folder of the Docker host mounted into it (GPU targets mount the package step's folder).

Both the OpenAI service (tokenizer files of the live build) and `stoker bench` (the deployment's
tokenizer) need it; the container's `--model-repository` and `AWS_*` environment are the truth.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple


class Repository(NamedTuple):
    endpoint_url: str | None
    bucket: str
    key: str


def parse_triton_s3(uri: str) -> Repository:
    """Triton's ``s3://[https://]host:port/bucket/key`` or ``s3://bucket/key`` (stoker.storage.s3.triton_uri). Pure."""
    rest = uri.removeprefix("s3://")
    scheme = "http"
    if rest.startswith("https://"):
        scheme, rest = "https", rest.removeprefix("https://")
    first, _, rest = rest.partition("/")
    if ":" in first:  # a host:port comes first only for a custom endpoint
        bucket, _, key = rest.partition("/")
        return Repository(f"{scheme}://{first}", bucket, key.rstrip("/"))
    return Repository(None, first, rest.rstrip("/"))


def repository_of(container) -> Repository | None:
    """Where the container's Triton loads its models from, when that is S3."""
    args = (container.attrs or {}).get("Args") or []
    uri = next((a.split("=", 1)[1] for a in args if a.startswith("--model-repository=s3://")), None)
    return parse_triton_s3(uri) if uri else None


def mounted_repository(container) -> Path | None:
    """The host folder mounted where the container's Triton loads its models (``--model-repository=/models``)."""
    args = (container.attrs or {}).get("Args") or []
    inside = next((a.split("=", 1)[1] for a in args if a.startswith("--model-repository=")
                   and not a.startswith("--model-repository=s3://")), None)
    for m in (container.attrs or {}).get("Mounts") or []:
        if inside is not None and m.get("Destination") == inside and m.get("Source"):
            return Path(m["Source"])
    return None


def container_env(container) -> dict[str, str]:
    return dict(e.split("=", 1) for e in ((container.attrs or {}).get("Config") or {}).get("Env") or [] if "=" in e)


def s3_client(container, repo: Repository):
    """A boto3 S3 client with the container's own keys (its mounted credentials file; never logged)."""
    import boto3

    from ..storage.credentials import container_keys

    env = container_env(container)
    keys = container_keys(container.attrs)
    return boto3.client("s3", endpoint_url=repo.endpoint_url,
                        region_name=env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION"),
                        **(keys.client_kwargs() if keys else {}))
