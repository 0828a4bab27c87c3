"""Day-2 commands without a pipeline run (issue 49 item 6), run as a user runs them (`.venv/bin/stoker ...`) against
a real deployment: the session's Docker daemon, HAProxy and a Triton backend serving a test build from S3 (moto).

`stoker keys SPEC` lists, adds and revokes API keys and the running proxy follows within seconds, no restart;
`stoker reconcile SPEC` repairs the deployment from what runs; and at deploy a run older than the one whose build
serves is refused unless forced (tasks/ordering.py, the check the flow makes under the deploy lock).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from stoker.containers import engine
from stoker.serving import api_keys

from promotion_kit import deploy, generate
from promotion_kit import build, client, images, s3, target  # noqa: F401 -- fixtures the tests request

pytestmark = [pytest.mark.docker, pytest.mark.s3]

STOKER = str(Path(sys.executable).with_name("stoker"))
NEWER, OLDER, NEWEST = "20261128T060000-aaaaaa", "20261128T055900-bbbbbb", "20261128T060100-cccccc"


def _stoker(home: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "STOKER_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)  # no run of this deployment to wait for: no deploy lock to take
    return subprocess.run([STOKER, *args], capture_output=True, text=True, timeout=120, env=env, input=stdin)


def _code(http: str, key: str) -> int:
    req = urllib.request.Request(f"{http}/v2/models/ensemble/ready", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_keys_change_at_once_reconcile_repairs_and_an_older_run_is_refused(client, target, build, s3, tmp_path,
                                                                           monkeypatch):
    home = tmp_path / "home"
    key_a, key_b = f"key-a-{uuid.uuid4().hex}", f"key-b-{uuid.uuid4().hex}"
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"# the clients' keys\n{key_a}\n{key_b}\n")
    keys_file.chmod(0o600)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "model": {"repo_id": "org/model"}, "storage": {"bucket": s3[1]},
        "deploy": {"name": target.name, "openai": False, "api_keys": {"file": str(keys_file)},
                   "ports": {"http": target.listen.http, "grpc": target.listen.grpc,
                             "metrics": target.listen.metrics}}}))
    # The deployment as a run leaves it: keyed, its proxy state under STOKER_HOME, a backend of run NEWER.
    keyed = dataclasses.replace(target, state_dir=home / "proxy" / target.name,
                                keys=api_keys.parse(keys_file.read_text(), f"file {keys_file}"))
    serving_build = dataclasses.replace(build("a"), run_id=NEWER)
    _, done = deploy(client, keyed, serving_build)
    http = keyed.endpoint["http"]
    assert _code(http, key_a) == 200 and _code(http, key_b) == 200
    proxy_id = client.containers.get(engine.proxy_name(target.name)).id
    backend_id = client.containers.get(done["live"]["container"]).id
    outputs: list[str] = []

    listed = _stoker(home, "keys", str(spec_file), "list")
    outputs.append(listed.stdout + listed.stderr)
    assert listed.returncode == 0, listed.stderr
    assert "2 key(s) in file" in listed.stdout and api_keys.digest(key_a)[:12] in listed.stdout
    assert "accepts the same set" in listed.stdout, listed.stdout

    added = _stoker(home, "keys", str(spec_file), "add")
    assert added.returncode == 0, added.stderr
    key_c = added.stdout.splitlines()[0]
    outputs.append(added.stdout.replace(key_c, "") + added.stderr)  # shown once, on purpose: the rest must not hold it
    assert "accepts 3 key(s)" in added.stdout and "shown once" in added.stdout, added.stdout
    assert key_c in keys_file.read_text() and keys_file.stat().st_mode & 0o777 == 0o600
    assert generate(http, headers={"Authorization": f"Bearer {key_c}"}).startswith("a")

    key_d = f"key-d-{uuid.uuid4().hex}"
    given = _stoker(home, "keys", str(spec_file), "add", "-", stdin=f"{key_d}\n")  # not in argv nor the output
    assert given.returncode == 0 and "accepts 4 key(s)" in given.stdout, given.stdout + given.stderr
    outputs.append(given.stdout + given.stderr)
    assert _code(http, key_d) == 200

    t0 = time.monotonic()
    revoked = _stoker(home, "keys", str(spec_file), "revoke", api_keys.digest(key_a)[:12])
    # The push is synchronous: once the command has returned, the revoked key is refused, with no wait. (How many
    # seconds that takes on a loaded machine is a figure, benchmarks/day_two.py's, not a timed assertion here.)
    refused = _code(http, key_a)
    print(f"revoked key refused {time.monotonic() - t0:.2f} s after `stoker keys revoke` started; it said: "
          f"{revoked.stdout.strip()}", flush=True)
    outputs.append(revoked.stdout + revoked.stderr)
    assert revoked.returncode == 0, revoked.stderr
    assert refused == 401
    assert _code(http, key_b) == 200 and _code(http, key_c) == 200
    assert key_a not in keys_file.read_text() and "# the clients' keys" in keys_file.read_text()
    # Nothing restarted: the same proxy and backend containers serve.
    assert client.containers.get(engine.proxy_name(target.name)).id == proxy_id
    assert client.containers.get(done["live"]["container"]).id == backend_id
    # A restarted proxy would read the same list: the state folder holds the new digests.
    assert api_keys.digest(key_a) not in (keyed.state_dir / api_keys.DIGESTS_NAME).read_text()

    # Bad input: one line each, nothing changed.
    unknown = _stoker(home, "keys", str(spec_file), "revoke", "deadbeefdeadbeef")
    assert _stoker(home, "keys", str(spec_file), "revoke", key_c).returncode == 0
    assert _stoker(home, "keys", str(spec_file), "revoke", api_keys.digest(key_d)[:8]).returncode == 0
    last = _stoker(home, "keys", str(spec_file), "revoke", key_b)
    for bad, says in ((unknown, "no key whose digest starts with deadbeefdeadbeef"), (last, "the last key")):
        outputs.append(bad.stdout + bad.stderr)
        assert bad.returncode == 1 and says in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert _code(http, key_b) == 200 and key_b in keys_file.read_text()

    # reconcile: a consistent deployment needs nothing; a stopped proxy is started again, keys and all.
    fine = _stoker(home, "reconcile", str(spec_file))
    assert fine.returncode == 0 and "nothing to repair" in fine.stdout and done["live"]["container"] in fine.stdout, \
        fine.stdout + fine.stderr
    client.containers.get(engine.proxy_name(target.name)).stop(timeout=2)
    no_proxy = _stoker(home, "keys", str(spec_file), "add")
    assert no_proxy.returncode == 1 and "no running proxy" in no_proxy.stderr, no_proxy.stderr
    assert keys_file.read_text().count("key-") == 1  # refused before the source changed
    # Keys from boto3's chain (here the environment; the shared S3 accepts any): reconcile writes them for the backends.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "reconcile-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "reconcile-secret")
    repaired = _stoker(home, "reconcile", str(spec_file))
    outputs += [fine.stdout + fine.stderr, no_proxy.stdout + no_proxy.stderr, repaired.stdout + repaired.stderr]
    assert repaired.returncode == 0 and "repaired" in repaired.stdout, repaired.stdout + repaired.stderr
    assert _code(http, key_b) == 200 and _code(http, key_a) == 401
    # ... and the backends' S3 credentials were written afresh for their next start (stoker.storage.credentials)
    creds = home / "credentials" / target.name / "credentials"
    assert creds.stat().st_mode & 0o777 == 0o600 and "reconcile-key-id" in creds.read_text()
    assert "reconcile-secret" not in repaired.stdout + repaired.stderr
    for key in (key_a, key_b, key_c, key_d):
        assert not any(key in out for out in outputs), key[:6]

    # Runs in order: a run started before NEWER (whose build serves) is refused at deploy unless forced.
    from stoker.spec.load import load_spec
    from tasks.ordering import OlderRun, check

    monkeypatch.setenv("STOKER_HOME", str(home))
    spec = load_spec(spec_file)
    with pytest.raises(OlderRun) as exc:
        check(spec, OLDER, False, print)
    assert f"run {OLDER} started before run {NEWER}" in str(exc.value) and "--force" in str(exc.value)
    warned: list[str] = []
    check(spec, OLDER, True, warned.append)
    assert len(warned) == 1 and warned[0].startswith("force: deploying it although")
    check(spec, NEWEST, False, print)  # a newer run deploys
    check(spec, OLDER, False, print, serving_build.repo_digest)  # so does an older run of the build that serves


@pytest.mark.prefect
def test_keys_in_a_prefect_secret_block_are_added_and_revoked_in_place():
    """The block's side of `stoker keys` (the proxy's side is the same as for a file, above)."""
    from prefect.blocks.system import Secret

    from stoker.spec.schema import ApiKeys

    key_a, key_b = f"key-a-{uuid.uuid4().hex}", f"key-b-{uuid.uuid4().hex}"
    for name, first in ((f"keys-{uuid.uuid4().hex[:8]}", key_a), (f"keys-{uuid.uuid4().hex[:8]}", [key_a])):
        source = ApiKeys(secret_block=name)
        assert api_keys.read_source(source) == ""  # no block yet: `add` makes it
        Secret(value=first).save(name)
        api_keys.write_source(source, api_keys.with_key(api_keys.read_source(source), key_b))
        assert api_keys.load(source).digests == tuple(sorted(map(api_keys.digest, (key_a, key_b))))
        assert isinstance(Secret.load(name).get(), type(first))  # a list stays a list, text stays text
        api_keys.write_source(source, api_keys.without(api_keys.read_source(source), {key_a}))
        assert api_keys.load(source).digests == (api_keys.digest(key_b),)
