"""Cheap checks before any heavy work: a bad endpoint should cost seconds, not a quantization.

Each check raises the same typed, one-line error the step itself would raise later.
"""

from __future__ import annotations

from typing import Callable

from . import credentials, docker_engine, s3
from .spec import Spec


def check_credentials(spec: Spec) -> None:
    """The Prefect blocks the spec names exist and hold something: the S3 block's keys open the bucket, the
    Hub token's Secret is there and not empty."""
    credentials.check(spec.storage)
    if spec.model.token_secret:
        from .source import hub_token

        hub_token(spec.model)


def check_storage(spec: Spec) -> None:
    """S3 answers and the bucket exists (or may be created)."""
    st = spec.storage
    client = s3.client(st)
    try:
        s3.ensure_bucket(client, st, create=False)
    except s3.S3Error:
        if not st.create_bucket:
            raise


def check_docker(spec: Spec) -> None:
    """The daemon answers, both images are there, and the endpoint's ports are free or already ours."""
    from .rollout import target_for
    from .serving import promote

    d = spec.deploy
    client = docker_engine.connect(d.docker_host, timeout_s=30)
    docker_engine.require_image(client, d.image)
    docker_engine.require_image(client, d.proxy_image)
    promote.check_listen_ports(client, target_for(spec))


def preflight(spec: Spec, log: Callable[[str], None]) -> None:
    check_credentials(spec)
    check_storage(spec)
    keys = f", keys from Prefect block {spec.storage.credentials_block!r}" if spec.storage.credentials_block else ""
    log(f"preflight: S3 {spec.storage.endpoint_url or 'AWS'} bucket {spec.storage.bucket!r} ok{keys}")
    check_docker(spec)
    log(f"preflight: Docker daemon, images {spec.deploy.image} and {spec.deploy.proxy_image}, ports ok")
