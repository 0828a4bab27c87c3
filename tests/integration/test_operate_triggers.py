"""Triggers on real servers: a Prefect server (SQLite, basic auth) + a process worker, the webhook receiver
as a `stoker webhook serve` process, the olah Hub mirror, moto S3, Docker + the Triton image.

1. Bad signatures, replays, oversized bodies and floods are refused.
2. Two watchers racing on a new commit in the mirror start exactly one run; a new commit starts one more.

A signed webhook that starts build_and_deploy on a worker, is answered with the same run when CI re-sends it, and
serves, is test_operate_walkthrough's: it runs docs/triggers.md's example CI job verbatim on `make stack`.
"""

from __future__ import annotations

import functools
import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from operate_helpers import (  # noqa: F401
    ROOT,
    apply_deployments,
    deployment_id,
    flow_runs,
    make_spec,
    prefect_api,
    prefect_env,
    run_py,
    set_pool_limit,
    wait_online,
)

from stoker.stack.services import free_port, port_open
from stoker.webhook.signing import SIGNATURE_HEADER, sign, signed_body

pytestmark = [pytest.mark.prefect, pytest.mark.hub, pytest.mark.s3, pytest.mark.slow]

SECRET = f"it-webhook-{uuid.uuid4().hex}"


def _https_post(url: str, body: bytes, headers: dict[str, str], ca: Path | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.fixture(scope="module")
def receiver(prefect_api, local_stack, tmp_path_factory):
    """`stoker webhook serve` with a specs folder holding one spec for the local stack. Every request here is refused
    before a run would start, so the deployment it names needs no worker."""
    api, state = prefect_api
    specs = tmp_path_factory.mktemp("specs")
    (specs / "tiny.yaml").write_text(yaml.safe_dump(make_spec(local_stack, f"wh-{uuid.uuid4().hex[:6]}")))
    port = free_port()
    # Served over TLS, as a receiver any CI reaches should be: a certificate for 127.0.0.1, trusted by the client.
    cert, key = specs.parent / "receiver.pem", specs.parent / "receiver.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    log = open(state / "webhook.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "stoker.cli", "webhook", "serve", "--specs", str(specs),
                             "--deployment", "build_and_deploy/refused-before-start", "--port", str(port),
                             "--max-body", "4096", "--rate", "0.2", "--burst", "8", "--window", "60",
                             "--tls-cert", str(cert), "--tls-key", str(key)],
                            cwd=ROOT, env={**prefect_env(api), "STOKER_WEBHOOK_SECRET": SECRET},
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_open(port):
        assert proc.poll() is None and time.monotonic() < deadline, (state / "webhook.log").read_text()[-2000:]
        time.sleep(0.2)
    yield f"https://127.0.0.1:{port}/hooks/build", state / "webhook.log", cert
    proc.terminate()
    proc.wait(timeout=15)


def test_bad_signatures_replays_and_oversized_bodies_are_refused(receiver):
    url, log, ca = receiver
    _post = functools.partial(_https_post, ca=ca)
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _https_post(url, b"{}", {})  # HTTPS, with the receiver's own certificate: untrusted without its CA
    payload = {"spec": "tiny", "revision": "main"}
    body, headers = signed_body(payload, SECRET.encode())
    assert _post(url, body, {**headers, SIGNATURE_HEADER: sign(b"wrong-secret", body)})[0] == 401
    assert _post(url, body, {"Content-Type": "application/json"})[0] == 401
    tampered = body.replace(b'"main"', b'"evil"')
    assert _post(url, tampered, headers)[0] == 401
    # A captured request replayed after the window (60 s here): refused although its signature is valid.
    old, old_headers = signed_body(payload, SECRET.encode(), now=time.time() - 120)
    code, answer = _post(url, old, old_headers)
    assert code == 401 and "window" in answer["error"]
    big, big_headers = signed_body({**payload, "idempotency_key": "x" * 100, "pad": "y" * 5000}, SECRET.encode())
    assert _post(url, big, big_headers)[0] == 413
    unknown, unknown_headers = signed_body({"spec": "nope", "revision": "main"}, SECRET.encode())
    assert _post(url, unknown, unknown_headers)[0] == 400
    extra, extra_headers = signed_body({**payload, "command": "rm -rf /"}, SECRET.encode())
    assert _post(url, extra, extra_headers)[0] == 400
    # A flood: the bucket (burst 8, 0.2/s) runs dry and the receiver answers 429.
    codes = [_post(url, b"{}", {SIGNATURE_HEADER: "sha256=00"})[0] for _ in range(10)]
    assert 429 in codes and set(codes) <= {401, 429}
    assert SECRET not in log.read_text()


def _watch_code(watches: list[dict]) -> str:
    return ("import json\nfrom flows.watch_revisions import watch_revisions\n"
            f"print('ROWS', json.dumps(watch_revisions(watches=json.loads({json.dumps(json.dumps(watches))}))))")


def test_watcher_starts_exactly_one_run_per_new_commit(prefect_api, local_stack, tmp_path):
    from stoker.stack.hub_mirror import publish_model
    from stoker.stack.prefect_stack import ensure_worker

    api, state = prefect_api
    pool = f"held-{uuid.uuid4().hex[:6]}"
    done = apply_deployments(tmp_path, api, pool)
    assert done.returncode == 0, done.stderr[-3000:]
    dep = deployment_id(api, "build_and_deploy", pool)

    # A repo of its own in the mirror, so other tests' commits do not move it.
    repo_id = f"stoker/watch-{uuid.uuid4().hex[:6]}"
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"v": 1}')
    sha1 = publish_model(local_stack["repos"], repo_id, src, "first")
    spec = make_spec(local_stack, "watched")
    spec["model"]["repo_id"] = repo_id
    watches = [{"spec": spec, "deployment": f"build_and_deploy/{pool}"}]
    env = prefect_env(api)

    # No worker on the pool: the tick refuses in one line instead of leaving a run Scheduled forever.
    r = run_py(_watch_code(watches), env)
    assert r.returncode != 0
    assert (f"watch watched: work pool {pool!r} of 'build_and_deploy/{pool}' has no online worker; start one "
            f"(prefect worker start --pool {pool} --type process)") in r.stdout + r.stderr
    assert flow_runs(api, dep) == []

    # A worker that takes nothing (the pool's concurrency limit is 0): the started runs stay Scheduled, so they
    # can be counted exactly.
    ensure_worker(state, api, pool, cwd=ROOT)
    set_pool_limit(api, pool, 0)
    wait_online(api, pool)

    # Two watchers race on the same sha.
    procs = [subprocess.Popen([sys.executable, "-c", _watch_code(watches)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    rows = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        rows += json.loads(out.split("ROWS ", 1)[1].splitlines()[0])
    assert {r["sha"] for r in rows} == {sha1}
    assert sorted(r["action"] for r in rows) == ["already started", "started"]
    runs = flow_runs(api, dep)
    assert len(runs) == 1 and runs[0]["parameters"]["spec"]["model"]["revision"] == sha1

    # A new commit: the next check starts exactly one more run, pinned to the new sha; a re-check starts none.
    (src / "config.json").write_text('{"v": 2}')
    sha2 = publish_model(local_stack["repos"], repo_id, src, "second")
    for expected in ("started", "already started"):
        r = run_py(_watch_code(watches), env)
        assert r.returncode == 0, r.stderr[-3000:]
        row = json.loads(r.stdout.split("ROWS ", 1)[1].splitlines()[0])[0]
        assert (row["sha"], row["action"]) == (sha2, expected)
    runs = flow_runs(api, dep)
    assert sorted(r["parameters"]["spec"]["model"]["revision"] for r in runs) == sorted([sha1, sha2])
