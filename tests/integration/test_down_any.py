"""`stoker down NAME` removes one deployment stoker started — its proxy, backends, OpenAI service and proxy state
folder — and nothing else: not another deployment, not a container stoker did not label, not a folder a label
points at that is not shaped like a proxy state folder. An unknown name is one line naming the known ones, and
`stoker status` without a name lists what is left."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from operate_helpers import stoker

from stoker.containers.engine import (
    LABEL_DEPLOYMENT,
    LABEL_DIGEST,
    LABEL_MANAGED,
    LABEL_PORTS,
    LABEL_ROLE,
    LABEL_RUN,
    LABEL_SLOT,
    ROLE_BACKEND,
    ROLE_OPENAI,
    ROLE_PROXY,
)
from stoker.serving.haproxy import MOUNT

pytestmark = [pytest.mark.docker]
ROLES = (ROLE_PROXY, ROLE_BACKEND, ROLE_OPENAI)
# sh, not plain `sleep` as PID 1: PID 1 ignores SIGTERM, so each `docker stop` would wait out its 10 s deadline.
SLEEP = ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 600 & wait"]


def _folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "haproxy.cfg").write_text("# stand-in for the proxy's state\n")
    return path


def test_down_removes_only_the_named_deployment(triton_image, tmp_path):
    import docker

    client = docker.from_env()
    tag = uuid.uuid4().hex[:6]
    one, two = f"down-a-{tag}", f"down-b-{tag}"
    home = Path(os.environ["STOKER_HOME"])
    # The state folders stoker keeps: this home's for each deployment, and one's as a worker with its own home.
    own = {dep: _folder(home / "proxy" / dep) for dep in (one, two)}
    worker = _folder(tmp_path / "worker-home" / "proxy" / one)
    decoy = _folder(tmp_path / "decoy")  # mounted into one's backend: a label/mount is not licence to delete
    started = []

    def sleeper(name: str, labels: dict, mount: Path | None = None) -> None:
        volumes = {str(mount): {"bind": MOUNT, "mode": "rw"}} if mount else None
        started.append(client.containers.run(triton_image, SLEEP[1:], entrypoint=SLEEP[:1], detach=True, name=name,
                                             labels=labels, volumes=volumes))

    try:
        for dep in (one, two):
            for role in ROLES:
                # The labels stoker's own containers carry (docker_engine), on a container that only sleeps.
                mount = {ROLE_PROXY: worker, ROLE_BACKEND: decoy}.get(role) if dep == one else None
                sleeper(f"stoker-{dep}-{role}", {LABEL_MANAGED: "true", LABEL_DEPLOYMENT: dep, LABEL_ROLE: role,
                                                 LABEL_PORTS: "29001,29002,29003", LABEL_SLOT: "blue",
                                                 LABEL_DIGEST: "0" * 64, LABEL_RUN: "run-x"}, mount)
        sleeper(f"not-stoker-{tag}", {LABEL_DEPLOYMENT: one})  # names the deployment, but stoker did not start it

        r = stoker(["down", one], timeout=180)
        assert r.returncode == 0, r.stderr
        *lines, last = r.stdout.splitlines()
        assert sorted(lines) == sorted(f"removed container stoker-{one}-{role}" for role in ROLES)
        assert last.startswith(f"deployment {one}: removed 3 container(s) and its state folders ")
        left = {c.name for c in client.containers.list(all=True, ignore_removed=True)}
        assert not any(n.startswith(f"stoker-{one}-") for n in left)
        assert {f"stoker-{two}-{role}" for role in ROLES} | {f"not-stoker-{tag}"} <= left
        assert not own[one].exists() and not worker.exists()
        assert own[two].is_dir() and (decoy / "haproxy.cfg").exists()

        r = stoker(["down", f"nope-{tag}"], timeout=180)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""
        assert r.stderr.startswith(f"stoker: error: unknown deployment 'nope-{tag}' (deployments here: ")
        assert two in r.stderr and one not in r.stderr

        listing = stoker(["status"], timeout=180)
        assert listing.returncode == 0, listing.stderr
        assert f"{two}:" in listing.stdout and f"{one}:" not in listing.stdout
        assert "no stoker deployments" not in listing.stdout
    finally:
        for c in started:
            try:
                c.remove(force=True)
            except docker.errors.NotFound:
                pass
