"""The shared step cache against a real S3 (moto_server on loopback): exactly-once across processes, a killed
holder's lease taken over, a silent (hung) holder's lease left to expire, a waiter's deadline, read-through into a
cold local cache, sweeps, and prune sparing what is served."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from stoker.storage import s3
from stoker.cache import lease as leases
from stoker.cache import remote, sweep
from stoker.cache.shared import CacheWaitTimeout, SharedStore
from stoker.orchestration.child import run_module
from stoker.spec.schema import Storage
from stoker.stack.s3server import TEST_CREDENTIALS
from stoker.storage.store import StepStore

pytestmark = pytest.mark.s3

WORKER = Path(__file__).with_name("shared_cache_worker.py")
BUCKET = f"shared-cache-{uuid.uuid4().hex[:8]}"
TTL_S = 2.0


@pytest.fixture(scope="module")
def moto(s3_server):
    """The session's S3, this module's own bucket."""
    storage = Storage(bucket=BUCKET, endpoint_url=s3_server)
    old = {k: os.environ.get(k) for k in TEST_CREDENTIALS}
    os.environ.update(TEST_CREDENTIALS)
    s3.ensure_bucket(s3.client(storage), storage, create=True)
    yield s3_server
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def storage(moto, monkeypatch):
    """A prefix of this test's own in the shared bucket."""
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    return Storage(bucket=BUCKET, prefix=f"t-{uuid.uuid4().hex[:8]}", endpoint_url=moto, shared_cache=True,
                   cache_lease_s=TTL_S)


class Worker:
    def __init__(self, tmp: Path, name: str, storage: Storage, key: str, work_s: float, go: Path):
        self.counter = tmp / "counter"
        args = {"home": str(tmp / name), "endpoint": storage.endpoint_url, "bucket": storage.bucket,
                "prefix": storage.prefix, "ttl_s": storage.cache_lease_s, "step": "build", "key": key,
                "counter": str(self.counter), "work_s": work_s, "go": str(go)}
        self.home = tmp / name
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, **TEST_CREDENTIALS})

    def wait_for(self, text: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip())
            if text in line:
                return
        raise AssertionError(f"no {text!r} from the worker; it said: {self.lines}")

    def result(self, timeout_s: float = 30) -> dict:
        out, _ = self.proc.communicate(timeout=timeout_s)
        self.lines += out.splitlines()
        assert self.proc.returncode == 0, self.lines
        return json.loads(next(line for line in self.lines if line.startswith("RESULT "))[7:])


def test_two_processes_on_one_key_produce_once_and_the_other_reuses_it(storage, tmp_path):
    go = tmp_path / "go"
    a, b = (Worker(tmp_path, n, storage, "k-once", 2.0, go) for n in ("host-a", "host-b"))
    a.wait_for("READY")
    b.wait_for("READY")
    go.touch()  # both reach the key together, each with its own cold local cache
    ra, rb = a.result(), b.result()
    assert len(a.counter.read_text().splitlines()) == 1  # the step ran exactly once
    assert sorted([ra["came_from"], rb["came_from"]]) == ["built", "remote"]
    assert ra["digest"] == rb["digest"] and ra["detail"] == rb["detail"]
    assert ra["empty_dir"] and rb["empty_dir"]  # the empty folder travelled through S3 too
    waiter = a if ra["came_from"] == "remote" else b
    assert any("waiting for " in line and "building build/k-once" in line for line in waiter.lines), waiter.lines
    assert remote.lookup(s3.client(storage), storage, "build", "k-once") is not None
    assert leases.read(s3.client(storage), storage, "build", "k-once") is None  # released


def test_a_killed_holders_lease_is_taken_over_after_its_ttl(storage, tmp_path):
    go = tmp_path / "go"
    go.touch()
    holder = Worker(tmp_path, "host-a", storage, "k-killed", 60.0, go)
    holder.wait_for("PRODUCING")
    waiter = Worker(tmp_path, "host-b", storage, "k-killed", 0.5, go)
    waiter.wait_for("waiting for")
    time.sleep(2 * TTL_S)  # the holder's heartbeat keeps its lease fresh while it lives
    assert len(holder.counter.read_text().splitlines()) == 1
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait()
    killed_at = time.monotonic()
    rb = waiter.result()
    assert rb["came_from"] == "built"
    # A deadline against hangs, not a speed claim: 10x the expected ~3 s (the 2 s TTL, a poll, the 0.5 s build).
    assert time.monotonic() - killed_at < 30
    assert len(holder.counter.read_text().splitlines()) == 2
    stale = [line for line in waiter.lines if "stale lease" in line]
    assert len(stale) == 1 and "stopped renewing" in stale[0] and "taking it over" in stale[0], waiter.lines
    # The killed step's temp folder stays until its owner is known dead for long enough, then goes.
    left = list((holder.home / "cache" / "build").glob(".tmp-*"))
    assert len(left) == 1 and json.loads((left[0] / sweep.OWNER).read_text())["pid"] == holder.proc.pid
    assert sweep.sweep_local(left[0].parent) == []
    assert sweep.sweep_local(left[0].parent, now=time.time() + sweep.DEAD_OWNER_S + 5) == left
    assert not left[0].exists()


def test_a_waiter_gives_up_in_one_line_at_its_deadline_while_the_holder_still_renews(storage, tmp_path):
    go = tmp_path / "go"
    go.touch()
    holder = Worker(tmp_path, "host-a", storage, "k-long", 60.0, go)
    try:
        holder.wait_for("PRODUCING")
        calls: list = []
        patient = storage.model_copy(update={"cache_wait_s": 3.0})
        with pytest.raises(CacheWaitTimeout) as exc:
            SharedStore(StepStore(tmp_path / "b"), patient).get("build", "k-long", _produce(calls), print)
        message = str(exc.value)
        assert message.startswith("build: waited ") and "building build/k-long, which still renews its lease" in message
        assert "storage.cache_wait_s 3" in message and "\n" not in message
        assert calls == [] and leases.read(s3.client(storage), storage, "build", "k-long") is not None
    finally:
        holder.proc.kill()
        holder.proc.wait()


# A step's child that says it started, then prints nothing until it is released: a hung quantize or build.
SILENT_CHILD = """
import pathlib, sys, time
print("started", flush=True)
release, deadline = pathlib.Path(sys.argv[1]), time.monotonic() + 120
while not release.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
print('{"done": true}', flush=True)
"""


def test_a_holder_whose_child_goes_silent_stops_renewing_and_a_waiter_takes_over(storage, tmp_path):
    (tmp_path / "silent_child.py").write_text(SILENT_CHILD)
    release = tmp_path / "release"
    quick = storage.model_copy(update={"cache_stall_s": 1.0})
    holder_lines: list[str] = []
    outcome: dict = {}

    def produce_silently(out: Path) -> dict:
        run_module("silent_child", [str(release)], holder_lines.append, timeout_s=150,
                   env={"PYTHONPATH": str(tmp_path)})
        (out / "model.safetensors").write_bytes(b"holder")
        return {"by": "holder"}

    def hold() -> None:
        try:
            outcome["holder"] = SharedStore(StepStore(tmp_path / "a"), quick).get("build", "k-silent",
                                                                                   produce_silently,
                                                                                   holder_lines.append)
        except Exception as err:  # noqa: BLE001 - asserted below
            outcome["error"] = err

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        deadline = time.monotonic() + 60  # against hangs
        while leases.read(s3.client(storage), storage, "build", "k-silent") is None:
            assert time.monotonic() < deadline and thread.is_alive(), (holder_lines, outcome)
            time.sleep(0.1)
        calls: list = []
        lines: list[str] = []
        entry, how = SharedStore(StepStore(tmp_path / "b"), quick).get("build", "k-silent", _produce(calls),
                                                                        lines.append)
        # Taken over while the holder's child still sleeps: its silence, not its end, freed the key.
        assert how == "built" and len(calls) == 1 and not release.exists()
        assert any("stale lease" in line and "taking it over" in line for line in lines), lines
        assert any("printed nothing for" in line and "no longer renewed" in line for line in holder_lines), \
            holder_lines
    finally:
        release.touch()
        thread.join(60)
    assert "error" not in outcome, outcome  # the holder finishes too; the entry is content-addressed
    assert remote.lookup(s3.client(storage), storage, "build", "k-silent") is not None


def _produce(calls: list):
    def produce(out: Path) -> dict:
        calls.append(out)
        (out / "model.safetensors").write_bytes(os.urandom(2048))
        (out / "ensemble" / "1").mkdir(parents=True)
        return {"format": "fp8"}
    return produce


def test_a_cold_local_cache_reads_through_from_s3(storage, tmp_path):
    calls: list = []
    lines: list[str] = []
    first, how = SharedStore(StepStore(tmp_path / "a"), storage).get("quantize", "k-rt", _produce(calls), lines.append)
    assert how == "built" and len(calls) == 1
    cold = SharedStore(StepStore(tmp_path / "b"), storage)
    second, how = cold.get("quantize", "k-rt", _produce(calls), lines.append)
    assert how == "remote" and len(calls) == 1
    assert second.digest == first.digest and second.detail == {"format": "fp8"}
    assert (second.output_dir / "model.safetensors").read_bytes() == (first.output_dir / "model.safetensors").read_bytes()
    assert (second.output_dir / "ensemble" / "1").is_dir()
    assert any("in the shared cache" in line for line in lines)
    _, how = cold.get("quantize", "k-rt", _produce(calls), lines.append)
    assert how == "local"  # published locally: no S3 round trip the next time


def test_cached_step_reads_through_when_the_run_context_names_the_shared_cache(storage, tmp_path):
    from stoker.run import RunContext, cached_step

    calls: list = []
    a = RunContext(run_id="r1", home=tmp_path / "a", shared_cache=storage)
    b = RunContext(run_id="r2", home=tmp_path / "b", shared_cache=storage)
    built = cached_step(a, "package", "k-ctx", _produce(calls), lambda _l: None)
    reused = cached_step(b, "package", "k-ctx", _produce(calls), lambda _l: None)
    assert (built.cache_hit, reused.cache_hit, len(calls)) == (False, True, 1)
    assert reused.digest == built.digest and reused.path == tmp_path / "b" / "cache" / "package" / "k-ctx" / "out"
    # Without it (the default) the same call never touches S3.
    off = cached_step(RunContext(run_id="r3", home=tmp_path / "c"), "package", "k-ctx", _produce(calls),
                      lambda _l: None)
    assert (off.cache_hit, len(calls)) == (False, 2)


def test_a_marker_whose_blobs_are_gone_is_not_trusted(storage, tmp_path):
    client = s3.client(storage)
    SharedStore(StepStore(tmp_path / "a"), storage).get("build", "k-gone", _produce([]), print)
    blobs = [k for k in remote.listing(client, storage)[0].objects if "/blobs/" in k]
    client.delete_object(Bucket=storage.bucket, Key=blobs[0])
    assert remote.lookup(client, storage, "build", "k-gone") is None
    calls: list = []
    _, how = SharedStore(StepStore(tmp_path / "b"), storage).get("build", "k-gone", _produce(calls), print)
    assert how == "built" and len(calls) == 1  # built again; the marker that exists stays (If-None-Match)


@pytest.mark.parametrize("planted", ["../../../escaped.txt", "/tmp/stoker-escaped-{tag}.txt"])
def test_a_planted_record_cannot_write_outside_its_entry(storage, tmp_path, planted):
    """A record.json put in S3 by anyone with write access names a path outside the entry: refused in one line
    naming the key, nothing written anywhere, and the step built here instead."""
    import hashlib

    client = s3.client(storage)
    planted = planted.format(tag=uuid.uuid4().hex[:8])
    payload = b"owned\n"
    sha = hashlib.sha256(payload).hexdigest()
    files = [{"path": planted, "sha256": sha, "bytes": len(payload)}]
    digest = remote.records_digest(remote.records_from_json(files))
    base = remote.entry_prefix(storage, "build", "k-evil")
    client.put_object(Bucket=storage.bucket, Key=f"{base}/{remote.BLOBS}/{sha}", Body=payload)
    client.put_object(Bucket=storage.bucket, Key=f"{base}/{remote.RECORD}", Body=json.dumps(
        {"step": "build", "key": "k-evil", "digest": digest, "files": files, "empty_dirs": [], "detail": {}}).encode())
    assert remote.lookup(client, storage, "build", "k-evil") is not None  # complete, as far as S3 can tell

    calls: list = []
    lines: list[str] = []
    home = tmp_path / "home"
    entry, how = SharedStore(StepStore(home / "cache"), storage).get("build", "k-evil", _produce(calls), lines.append)
    assert how == "built" and len(calls) == 1 and (entry.output_dir / "model.safetensors").exists()
    refused = [line for line in lines if "record.json refused" in line]
    assert refused == [f"build: cache entry {remote.where(storage, 'build', 'k-evil')}: record.json refused: "
                       f"unsafe path {planted!r}; building it here"]
    target = Path(planted) if planted.startswith("/") else (home / "cache" / "build" / "x" / "out" / planted)
    assert not target.exists() and not (tmp_path / "escaped.txt").exists()
    assert [p for p in tmp_path.rglob("escaped*")] == []


def test_the_remote_sweep_removes_markerless_litter_and_stale_multipart_uploads(storage, tmp_path):
    client = s3.client(storage)
    base = remote.entry_prefix(storage, "build", "k-litter")
    # A builder (its lease fresh) with one blob sent and a big one under way; and a complete entry.
    assert leases.try_acquire(client, storage, "build", "k-litter", leases.Holder.me(), TTL_S) is not None
    client.put_object(Bucket=storage.bucket, Key=f"{base}/blobs/abc", Body=b"half")
    upload_id = client.create_multipart_upload(Bucket=storage.bucket, Key=f"{base}/blobs/big")["UploadId"]
    live = time.time()  # the builder's lease is fresh now; on a loaded host the next step can outlast its 2 s ttl
    SharedStore(StepStore(tmp_path / "a"), storage).get("build", "k-done", _produce([]), print)
    lines: list[str] = []
    # A sweep while the builder is live (ci45 swept at the wall clock, 2 s later, and found the lease stale).
    assert remote.sweep_remote(client, storage, TTL_S, lines.append, now=live) == (0, 0)  # left alone
    later = time.time() + TTL_S + 5
    assert remote.sweep_remote(client, storage, TTL_S, lines.append, dry_run=True, now=later) == (1, 1)
    assert remote.sweep_remote(client, storage, TTL_S, lines.append, now=later) == (1, 1)
    assert [f.key for f in remote.listing(client, storage)] == ["k-done"]
    uploads = client.list_multipart_uploads(Bucket=storage.bucket, Prefix=base).get("Uploads", [])
    assert upload_id not in [u["UploadId"] for u in uploads]


def _run_manifest(home: Path, storage: Storage, digest: str, keys: dict[str, str]) -> None:
    run_id = "20261123T120000-abcdef"
    steps = {name: {"status": "completed", "key": key} for name, key in keys.items()}
    steps["upload"] = {"status": "completed", "key": digest[:24], "digest": digest}
    steps["deploy"] = {"status": "completed", "key": None}
    m = {"run_id": run_id, "spec": {"deploy": {"name": "chat"}, "storage": storage.model_dump(mode="json")},
         "steps": steps}
    (home / "runs" / run_id).mkdir(parents=True)
    (home / "runs" / run_id / "manifest.json").write_text(json.dumps(m))


def test_prune_never_removes_what_a_live_deployment_serves(storage, tmp_path, monkeypatch, capsys):
    from stoker.cli import main

    home = tmp_path / "stoker-home"
    monkeypatch.setenv("STOKER_HOME", str(home))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")  # Docker not asked: noted, not fatal
    shared = SharedStore(StepStore(home / "cache"), storage)
    made = {}
    for step, key in (("fetch", "f-live"), ("build", "b-live"), ("package", "p-live"),
                      ("build", "b-old"), ("package", "p-old")):
        made[key] = shared.get(step, key, _produce([]), lambda _l: None)[0]
    _run_manifest(home, storage, made["p-live"].digest, {"fetch": "f-live", "build": "b-live", "package": "p-live"})
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"model": {"repo_id": "org/model"}, "deploy": {"name": "chat"},
                                "storage": storage.model_dump(mode="json")}))

    assert main(["cache", "ls", "--spec", str(spec)]) == 0
    listed = capsys.readouterr().out
    assert "note: chat: Docker not asked" in listed
    rows = {line.split()[1]: line.split() for line in listed.splitlines() if line.startswith(("fetch", "build", "pack"))}
    assert rows["p-live"][-2:] == ["local+remote", "yes"] and rows["b-old"][-2:] == ["local+remote", "-"]

    assert main(["cache", "prune", "--spec", str(spec), "--keep-last", "0", "--dry-run"]) == 0
    assert "would remove local build/b-old" in capsys.readouterr().out
    assert all((home / "cache" / e.step / e.key).is_dir() for e in made.values())

    assert main(["cache", "prune", "--spec", str(spec), "--keep-last", "0", "--older-than", "0s"]) == 0
    out = capsys.readouterr().out
    assert "4 entries removed, 6 served kept" in out, out
    client = s3.client(storage)
    left = {(f.step, f.key) for f in remote.listing(client, storage)}
    assert left == {("fetch", "f-live"), ("build", "b-live"), ("package", "p-live")}
    assert {p.parent.name + "/" + p.name for p in (home / "cache").glob("*/*") if not p.name.startswith(".")} == {
        "fetch/f-live", "build/b-live", "package/p-live"}
    assert remote.lookup(client, storage, "package", "p-live") is not None


def test_prune_refuses_without_a_rule(storage, tmp_path, monkeypatch, capsys):
    from stoker.cli import main

    monkeypatch.setenv("STOKER_HOME", str(tmp_path / "home"))
    assert main(["cache", "prune"]) == 1
    assert capsys.readouterr().err.strip() == "stoker: error: give --older-than and/or --keep-last"


def test_preflight_fails_in_one_line_without_credentials(storage, monkeypatch, tmp_path):
    from stoker.plan.preflight import check_shared_cache, check_storage
    from stoker.spec.load import parse_spec

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    spec = parse_spec({"model": {"repo_id": "org/model"}, "storage": storage.model_dump(mode="json")})
    with pytest.raises(s3.S3Error) as exc:
        check_shared_cache(spec)
    assert f"bucket {storage.bucket!r} at {storage.endpoint_url}: no S3 credentials here" in str(exc.value)
    assert "\n" not in str(exc.value)
    # create_bucket forgives a missing bucket, never missing keys (issue 22: the preflight logged "ok" and the
    # upload failed after the heavy steps with "Unable to locate credentials").
    creating = spec.model_copy(update={"storage": spec.storage.model_copy(update={"create_bucket": True})})
    with pytest.raises(s3.S3Error, match="no S3 credentials here"):
        check_storage(creating)
    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    check_shared_cache(spec)  # with keys: the cache prefix is listed, written and cleaned


def test_plan_counts_an_entry_only_in_s3_as_a_hit(storage, tmp_path):
    """`stoker plan` with the shared cache on: what another worker published is a hit (to download), not a miss."""
    from stoker.plan.rows import cached_row
    from stoker.run import RunContext
    from stoker.spec.load import parse_spec

    calls: list = []
    published, _ = SharedStore(StepStore(tmp_path / "a" / "cache"), storage).get("quantize", "k-plan", _produce(calls),
                                                                                   lambda _l: None)
    spec = parse_spec({"model": {"repo_id": "stoker/tiny-llama"}, "storage": storage.model_dump()}, "test")
    cold = RunContext(run_id="p", home=tmp_path / "b")
    row, digest = cached_row(spec, cold, "quantize", "k-plan")
    assert (row.status, digest) == ("hit", published.digest) and "in the shared cache" in row.note, row
    row, digest = cached_row(spec, cold, "quantize", "k-other")
    assert (row.status, digest) == ("miss", None)
    off = parse_spec({"model": {"repo_id": "stoker/tiny-llama"},
                      "storage": {**storage.model_dump(), "shared_cache": False}}, "test")
    assert cached_row(off, cold, "quantize", "k-plan")[0].status == "miss"  # off: S3 is never asked
