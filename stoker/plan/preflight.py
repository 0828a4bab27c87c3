"""Cheap checks before any heavy work: a bad endpoint should cost seconds, not a quantization.

Each check raises the same typed, one-line error the step itself would raise later.
"""

from __future__ import annotations

from typing import Callable

from ..storage import credentials
from ..containers import engine as docker_engine
from ..storage import s3
from ..spec.schema import Spec


def check_credentials(spec: Spec) -> None:
    """The Prefect blocks the spec names exist and hold something: the S3 block's keys open the bucket, the
    Hub token's Secret is there and not empty."""
    credentials.check(spec.storage)
    if spec.model.token_secret:
        from ..storage.source import hub_token

        hub_token(spec.model)


def check_storage(spec: Spec) -> None:
    """S3 answers with the keys the run will use (the spec's block, else boto3's chain where this runs) and the
    bucket exists, or may be created. Only a missing bucket is forgiven by `create_bucket`: missing or refused
    keys fail here, in one line, not at the upload after the heavy steps."""
    st = spec.storage
    require_keys(st)
    client = s3.client(st, attempts=2)  # a refused or stalled endpoint is reported in seconds, not after 5 backoffs
    try:
        s3.ensure_bucket(client, st, create=False)
    except s3.NoSuchBucket:
        if not st.create_bucket:
            raise


def require_keys(st) -> None:
    """Some S3 keys exist for this bucket: the named block's, or boto3's own chain (environment, profile, role)."""
    if credentials.aws_keys(st) is None:
        import boto3

        if boto3.Session().get_credentials() is None:
            raise s3.S3Error(f"bucket {st.bucket!r} at {st.endpoint_url or 'AWS S3'}: no S3 credentials here "
                             "(name an AwsCredentials block in storage.credentials_block, or set "
                             "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY where the run runs)")


def check_shared_cache(spec: Spec) -> None:
    """With `storage.shared_cache` on: keys exist (a block's, or boto3's chain), and the cache prefix can be
    listed and written. Every step depends on it, so a missing key fails here, not after the first step."""
    from botocore.exceptions import BotoCoreError, ClientError

    st = spec.storage
    require_keys(st)
    client = s3.client(st, attempts=2)  # a refused or stalled endpoint is reported in seconds, not after 5 backoffs
    if st.create_bucket:  # the first step reads the cache before the upload step would create the bucket
        s3.ensure_bucket(client, st, create=True)
    probe = f"{st.prefix}/cache/.preflight"
    try:
        client.list_objects_v2(Bucket=st.bucket, Prefix=f"{st.prefix}/cache/", MaxKeys=1)
        client.put_object(Bucket=st.bucket, Key=probe, Body=b"")
        client.delete_object(Bucket=st.bucket, Key=probe)
    except (BotoCoreError, ClientError) as err:
        raise s3.failure(err, f"storage.shared_cache: s3://{st.bucket}/{st.prefix}/cache/", st) from None


def check_docker(spec: Spec, log: Callable[[str], None] = print, standin_ran: bool = False) -> str:
    """The daemon answers, the serving image (the one the target's backends run) and the proxy's are there, and
    the endpoint's ports are free or already ours; returns the serving image."""
    from .. import targets
    from ..gpu import standin
    from ..deploy.rollout import target_for
    from ..serving import promote

    d = spec.deploy
    client = docker_engine.connect(d.docker_host, timeout_s=30)
    image = targets.get(spec.target).backend(spec, "", (), standin_ran)["image"]
    if standin.applies(spec, standin_ran):  # one layer on the CPU image: built here when its recipe changed (seconds)
        from ..stack.standin_image import ensure_standin_image

        ensure_standin_image(image, d.docker_host, log)
    docker_engine.require_image(client, image)
    docker_engine.require_image(client, d.proxy_image)
    if d.openai:  # stoker's OpenAI service, in stoker's CPU image for GPU targets
        docker_engine.require_image(client, targets.get(spec.target).openai_image(spec))
    promote.check_listen_ports(client, target_for(spec))
    return image


def check_endpoint(spec: Spec, log: Callable[[str], None]) -> None:
    """The API keys and the TLS files are there and usable (read here, never logged)."""
    from ..deploy.rollout import target_for

    d = spec.deploy
    if not (d.api_keys or d.tls):
        return
    target = target_for(spec)  # reads the keys: ApiKeysError, one line naming the file or block, never a key
    parts = [f"{len(target.keys)} API key(s) from {target.keys.source}"] if target.keys else []
    if target.tls_pem() is not None:  # TlsError, one line naming the file
        parts.append(f"TLS with {d.tls.cert_file}")
    log(f"preflight: the endpoint on {d.listen} asks for {' and '.join(parts)}")


def preflight(spec: Spec, log: Callable[[str], None], standin_ran: bool = False) -> None:
    check_credentials(spec)
    check_storage(spec)
    keys = f", keys from Prefect block {spec.storage.credentials_block!r}" if spec.storage.credentials_block else ""
    log(f"preflight: S3 {spec.storage.endpoint_url or 'AWS'} bucket {spec.storage.bucket!r} ok{keys}")
    if spec.storage.shared_cache:
        check_shared_cache(spec)
        log(f"preflight: shared step cache s3://{spec.storage.bucket}/{spec.storage.prefix}/cache/ "
            "readable and writable")
    if spec.routing.heavy:
        from ..orchestration.routing import check_route

        route = check_route(spec.routing.heavy)
        log(f"preflight: heavy steps routed to {route.deployment} on pool {route.pool!r} "
            f"(online: {', '.join(route.workers)})")
    check_endpoint(spec, log)
    image = check_docker(spec, log, standin_ran)
    log(f"preflight: Docker daemon, images {image} and {spec.deploy.proxy_image}, ports ok")
