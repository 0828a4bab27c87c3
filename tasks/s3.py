"""upload: the repository to S3 (its signature, then the completion marker, last); the run manifest too."""

from __future__ import annotations

import time

from prefect import get_run_logger
from prefect.context import TaskRunContext

from stoker.storage import s3, signature, signing_keys
from stoker.storage.digest import FileRecord
from stoker.errors import TransientError
from stoker.run import Output, RunContext, StepResult
from stoker.spec.schema import Spec, Storage

from . import step_task


def _outputs(storage: Storage, objects: list[dict]) -> list[Output]:
    return [Output(uri=f"s3://{storage.bucket}/{o['key']}", sha256=o["sha256"], bytes=o["bytes"]) for o in objects]


@step_task("upload")
def upload_repository(spec: Spec, packaged: StepResult, ctx: RunContext) -> StepResult:
    """Parallel upload keyed by the repository digest; identical objects are skipped.

    A transient failure is retried by Prefect, and what arrived stays for the retry to skip; when the last
    attempt fails, nothing of this repository is left under its prefix.
    """
    log = get_run_logger().info
    t0 = time.perf_counter()
    st = spec.storage
    prefix = s3.repo_prefix(st, packaged.digest)
    files = [FileRecord(_rel(packaged, o.uri), o.sha256, o.bytes) for o in packaged.outputs]
    # Signed over the package step's own records, never over what S3 holds: a bucket rewritten before this upload
    # reuses it is then refused when a backend is about to start from it (stoker/serving/signed_build.py).
    key = signing_keys.private_key(spec.signing)  # a bad key fails here, before a byte is sent
    sig = signature.sign(files, key, f"stoker-{packaged.digest[:24]}", packaged.digest) if key is not None else None
    try:
        client = s3.client(st)
        s3.ensure_bucket(client, st, create=st.create_bucket)
        marker = s3.read_marker(client, st, packaged.digest)
        if marker is not None:
            log(f"upload: s3://{st.bucket}/{prefix} already complete, nothing to send")
            objects = marker["objects"]
            if sig is not None:  # one PUT, atomic: any valid signature of this digest vouches for the same files
                s3.put_object_bytes(client, st, s3.signature_key(st, packaged.digest), sig)
        else:
            empty = packaged.detail.get("empty_dirs", [])
            objects = [o.__dict__ for o in s3.upload_tree(client, st, packaged.path, files, empty,
                                                          packaged.digest, log, keep_sent=True, signature=sig)]
    except TransientError:
        if _retries_left():
            log(f"upload: will be retried; what arrived under s3://{st.bucket}/{prefix} stays for it to skip")
        else:
            s3.discard_upload(st, packaged.digest, log)
        raise
    uri = s3.triton_uri(st, f"{prefix}/model_repository")
    signed = {"signature": f"s3://{st.bucket}/{s3.signature_key(st, packaged.digest)}",
              "public_key_sha256": signature.key_hint(key.public_key())} if key is not None else {}
    log(f"upload: signed, {signed['signature']}" if signed else "upload: unsigned (no signing key)")
    return StepResult(name="upload", cache_hit=marker is not None, duration_s=time.perf_counter() - t0,
                      key=packaged.digest[:24], digest=packaged.digest, outputs=_outputs(st, objects),
                      detail={"repository_uri": uri, "prefix": f"s3://{st.bucket}/{prefix}", **signed})


def _retries_left() -> int:
    """How many more times Prefect runs this task after a transient failure (0 outside a task run)."""
    ctx = TaskRunContext.get()
    return 0 if ctx is None else max(0, ctx.task.retries - ctx.task_run.run_count + 1)


def _rel(packaged: StepResult, uri: str) -> str:
    root = packaged.path.as_uri() + "/"
    return uri.removeprefix(root)


@step_task("store-manifest")
def store_manifest(spec: Spec, manifest: dict) -> str:
    """The run manifest next to the repository in S3; returns its s3:// URI."""
    st = spec.storage
    return s3.put_json(s3.client(st), st, s3.run_manifest_key(st, manifest["run_id"]), manifest)
