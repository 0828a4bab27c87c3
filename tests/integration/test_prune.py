"""`stoker prune` against the session's real S3 (moto) and Docker daemon (issue 49 item 8: bounded growth).

Ten builds of one deployment, eight recorded on this host and two only in S3 (another host's runs), plus what serves
without the history saying so (a container labelled with an old build, the S3 live repository naming another) and
what a run in flight leaves (an upload no manifest names yet). `--dry-run` lists exactly what would go and removes
nothing; the real run removes it, manifests before the builds they name and each build's marker first, and keeps
what serves, the rollback targets and the newest runs. state_size() measures the state before and after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest

from stoker.containers import engine
from stoker.record import retention
from stoker.spec.schema import Storage
from stoker.stack.s3server import s3_env

pytestmark = [pytest.mark.s3, pytest.mark.docker]

NAME = "prunedep"
DONE = {"status": "completed"}


def _digest(i: int) -> str:
    return f"{i:02d}".ljust(64, "a")


def _manifest(i: int, storage: dict) -> dict:
    steps = {"upload": {**DONE, "digest": _digest(i)}, "deploy": DONE, "gate": DONE, "switch": DONE}
    return {"run_id": f"20250101T0000{i:02d}-{NAME}", "status": "completed", "steps": steps, "spec_digest": f"s{i}",
            "model": {"sha": f"sha{i}"}, "spec": {"deploy": {"name": NAME}, "storage": storage}}


def _keys(s3, bucket: str, prefix: str) -> set[str]:
    return {o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])}


def _put_repo(s3, bucket: str, digest: str, marker: bool = True) -> None:
    base = f"p/repos/{digest[:24]}"
    s3.put_object(Bucket=bucket, Key=f"{base}/model_repository/m/config.pbtxt", Body=b"name: 'm'\n" * 50)
    s3.put_object(Bucket=bucket, Key=f"{base}/model_repository/m/1/model.bin", Body=os.urandom(4096))
    if marker:
        s3.put_object(Bucket=bucket, Key=f"{base}/stoker-repo.json", Body=json.dumps({"digest": digest}).encode())


def test_prune_keeps_what_serves_and_may_be_returned_to_and_removes_the_rest(s3_server, triton_image, tmp_path):
    env = {**os.environ, **s3_env(s3_server), "STOKER_HOME": str(tmp_path / "home")}
    bucket = f"prune-{uuid.uuid4().hex[:8]}"
    storage = {"bucket": bucket, "prefix": "p", "endpoint_url": s3_server}
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1",
                      aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    s3.create_bucket(Bucket=bucket)
    home = Path(env["STOKER_HOME"])
    runs = [_manifest(i, storage) for i in range(1, 11)]
    for i, m in enumerate(runs, start=1):
        s3.put_object(Bucket=bucket, Key=f"p/runs/{m['run_id']}/manifest.json", Body=json.dumps(m).encode())
        s3.put_object(Bucket=bucket, Key=f"p/runs/{m['run_id']}/report.md", Body=b"# report\n")
        _put_repo(s3, bucket, _digest(i))
        if i <= 8:  # the two newest are another host's: in S3 only
            (home / "runs" / m["run_id"]).mkdir(parents=True)
            (home / "runs" / m["run_id"] / "manifest.json").write_text(json.dumps(m))
    _put_repo(s3, bucket, _digest(42), marker=False)  # a run in flight: uploading, no manifest names it yet
    s3.put_object(Bucket=bucket, Key=f"p/live/{NAME}/stoker-live.json",
                  Body=json.dumps({"version": 3, "digest": _digest(2), "versions": {"3": _digest(2)}}).encode())
    openai = home / "proxy" / NAME / "openai"
    for folder in ("live-assets", "old-assets"):
        (openai / "assets" / folder).mkdir(parents=True)
        (openai / "assets" / folder / "tokenizer.json").write_text("{}")
    os.utime(openai / "assets" / "old-assets" / "tokenizer.json", (time.time() - 3 * 86400,) * 2)
    (openai / "backends").mkdir()
    (openai / "backends" / "0123456789abcdef01234567.json").write_text(json.dumps({"assets": "assets/old-assets"}))
    (openai / "live.json").write_text(json.dumps({"assets": "assets/live-assets"}))

    client = engine.connect(None)
    holder = client.containers.run(triton_image, ["sleep", "300"], detach=True, network_mode="none",
                                   labels={engine.LABEL_MANAGED: "true", engine.LABEL_DEPLOYMENT: f"{NAME}-{bucket}",
                                           engine.LABEL_ROLE: "probe", engine.LABEL_DIGEST: _digest(1)})
    try:
        before = retention.state_size(home, [(s3, Storage(**storage))])
        all_keys = _keys(s3, bucket, "p/")
        dry = subprocess.run([sys.executable, "-m", "stoker.cli", "prune", "--dry-run", "--keep", "2", "--verbose"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert dry.returncode == 0, dry.stderr
        assert _keys(s3, bucket, "p/") == all_keys and (home / "runs" / runs[0]["run_id"]).is_dir()
        # Serving: build 10 (the newest switch). Targets: 9 and 8. Newest runs: 10, 9. Labelled: 1. Live repo: 2.
        gone = {3, 4, 5, 6, 7}
        lines = [ln for ln in dry.stdout.splitlines() if ln.startswith("would remove")]
        want = ({f"s3 run s3://{bucket}/p/runs/{runs[i - 1]['run_id']}/" for i in gone | {1, 2}}
                | {f"local run {home / 'runs' / runs[i - 1]['run_id']}" for i in gone | {1, 2}}
                | {f"s3 repo s3://{bucket}/p/repos/{_digest(i)[:24]}/" for i in gone}
                | {f"local backend-index {openai / 'backends' / '0123456789abcdef01234567.json'}",
                   f"local assets {openai / 'assets' / 'old-assets'}"})
        assert {ln.removeprefix("would remove ").split(" (")[0] for ln in lines} == want, dry.stdout
        assert f"keep s3 repo {_digest(1)[:24]}: container" in dry.stdout
        assert f"keep s3 repo {_digest(42)[:24]}: named by no run yet, younger than the grace period" in dry.stdout
        assert "(dry run: nothing removed)" in dry.stdout and f"{len(want)} to remove" in dry.stdout

        real = subprocess.run([sys.executable, "-m", "stoker.cli", "prune", "--keep", "2"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert real.returncode == 0, real.stderr
        after = _keys(s3, bucket, "p/")
        repos = {k.split("/")[2] for k in after if k.startswith("p/repos/")}
        assert repos == {_digest(i)[:24] for i in (1, 2, 8, 9, 10, 42)}
        assert {k.split("/")[2] for k in after if k.startswith("p/runs/")} == {runs[i - 1]["run_id"] for i in (8, 9, 10)}
        assert sorted(p.name for p in (home / "runs").iterdir()) == [runs[7]["run_id"]]
        assert sorted(p.name for p in (openai / "assets").iterdir()) == ["live-assets"]
        assert not list((openai / "backends").iterdir()) and f"p/live/{NAME}/stoker-live.json" in after
        for d in (1, 2, 8, 9, 10):  # what stays is whole: marker and objects
            assert f"p/repos/{_digest(d)[:24]}/stoker-repo.json" in after
        size = retention.state_size(home, [(s3, Storage(**storage))])
        print(f"measured: S3 {before['s3'][0]['objects']} objects / {before['s3'][0]['bytes']} B → "
              f"{size['s3'][0]['objects']} / {size['s3'][0]['bytes']} B; home {before['home_bytes']} B → "
              f"{size['home_bytes']} B")
        assert size["s3"][0]["by_folder"]["repos"]["objects"] == 6 * 3 - 1
        assert size["s3"][0]["bytes"] < before["s3"][0]["bytes"]

        # Run again: nothing more goes (idempotent); past the grace period the orphan upload does.
        again = subprocess.run([sys.executable, "-m", "stoker.cli", "prune", "--keep", "2", "--grace", "0s",
                                "--dry-run"], env=env, capture_output=True, text=True, timeout=120)
        assert [ln.split(" (")[0] for ln in again.stdout.splitlines() if ln.startswith("would remove")] == [
            f"would remove s3 repo s3://{bucket}/p/repos/{_digest(42)[:24]}/"], again.stdout
    finally:
        holder.remove(force=True)
