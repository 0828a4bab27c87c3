"""Not collected on its own (no test_ prefix): test_s3_faults.py runs it as a script, with a fresh PREFECT_HOME.

`python s3_upload_flow.py JOB.json` runs the real upload task (`tasks.s3.upload_repository`, with its
Prefect retries) in a flow on Prefect's temporary API, for the repository JSON describes; it prints the
step's result as `RESULT {json}` and exits 0, or exits 1 when the flow failed.

With ``freeze_pgid`` in the job, the S3 server's process group (moto, started by the test) is stopped (SIGSTOP)
the moment the first object's PUT has been answered, and `FROZEN` is printed: the fault lands while the upload is
under way, with one object already in S3, however fast or slow the host (a watcher polling the server from outside
could see the first object only after the whole upload had finished).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(job_path: str) -> int:
    from stoker.stack.prefect_ephemeral import prepare_temporary_api, stop_ephemeral_api

    prepare_temporary_api()
    from prefect import flow

    from stoker.run import Output, RunContext, StepResult
    from stoker.spec.schema import Spec
    from tasks.s3 import upload_repository

    job = json.loads(Path(job_path).read_text())
    if job.get("freeze_pgid"):
        _freeze_after_first_put(int(job["freeze_pgid"]))
    root = Path(job["root"])
    spec = Spec.model_validate({"model": {"repo_id": "stoker/unused"}, "storage": job["storage"]})
    packaged = StepResult(name="package", digest=job["digest"], path=root, detail={"empty_dirs": job["empty_dirs"]},
                          outputs=[Output(uri=(root / f["path"]).as_uri(), sha256=f["sha256"], bytes=f["bytes"])
                                   for f in job["files"]])

    @flow(name="upload-under-faults")
    def upload_only() -> StepResult:
        return upload_repository(spec, packaged, RunContext.new(Path(job["home"])))

    try:
        result = upload_only()
    except Exception as exc:  # noqa: BLE001 - the test reads the log and the exit status
        print(f"FAILED {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        stop_ephemeral_api()
    print("RESULT " + result.model_dump_json(), flush=True)
    return 0


def _freeze_after_first_put(pgid: int) -> None:
    """Every S3 client stoker makes stops the server's process group once, after the first PutObject answered 200."""
    from stoker.storage import s3

    made, once = s3.client, threading.Lock()

    def frozen_after_first_put(*args, **kwargs):
        c = made(*args, **kwargs)

        def after_put(http_response=None, **_kw) -> None:
            if http_response is not None and http_response.status_code == 200 and once.acquire(blocking=False):
                os.killpg(pgid, signal.SIGSTOP)
                print("FROZEN", flush=True)

        c.meta.events.register("after-call.s3.PutObject", after_put)
        return c

    s3.client = frozen_after_first_put


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
