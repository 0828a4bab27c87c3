"""`stoker down NAME` removes one deployment stoker started — its proxy, backends and OpenAI service — and nothing
else: not another deployment, not a container stoker did not label. An unknown name is one line naming the known."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from stoker.docker_engine import (
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

pytestmark = [pytest.mark.docker]
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _stoker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoker.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)


def test_down_removes_only_the_named_deployment(triton_image):
    import docker

    client = docker.from_env()
    tag = uuid.uuid4().hex[:6]
    one, two = f"down-a-{tag}", f"down-b-{tag}"
    started = []

    def sleeper(name: str, labels: dict) -> None:
        started.append(client.containers.run(triton_image, ["600"], entrypoint=["sleep"], detach=True, name=name,
                                             labels=labels))

    try:
        for dep in (one, two):
            for role in (ROLE_PROXY, ROLE_BACKEND, ROLE_OPENAI):
                # The labels stoker's own containers carry (docker_engine), on a container that only sleeps.
                sleeper(f"stoker-{dep}-{role}", {LABEL_MANAGED: "true", LABEL_DEPLOYMENT: dep, LABEL_ROLE: role,
                                                 LABEL_PORTS: "29001,29002,29003", LABEL_SLOT: "blue",
                                                 LABEL_DIGEST: "0" * 64, LABEL_RUN: "run-x"})
        sleeper(f"not-stoker-{tag}", {LABEL_DEPLOYMENT: one})  # names the deployment, but stoker did not start it

        r = _stoker("down", one)
        assert r.returncode == 0, r.stderr
        assert sorted(r.stdout.splitlines()[:-1]) == sorted(f"removed container stoker-{one}-{role}"
                                                            for role in (ROLE_PROXY, ROLE_BACKEND, ROLE_OPENAI))
        left = {c.name for c in client.containers.list(all=True)}
        assert not any(n.startswith(f"stoker-{one}-") for n in left)
        assert {f"stoker-{two}-{role}" for role in (ROLE_PROXY, ROLE_BACKEND, ROLE_OPENAI)} | {f"not-stoker-{tag}"} <= left

        r = _stoker("down", f"nope-{tag}")
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
        assert r.stderr.startswith(f"stoker: error: unknown deployment 'nope-{tag}' (deployments here: ")
        assert two in r.stderr and one not in r.stderr

        listing = _stoker("status")
        assert listing.returncode == 0 and f"{two}:" in listing.stdout and f"{one}:" not in listing.stdout
    finally:
        for c in started:
            try:
                c.remove(force=True)
            except docker.errors.NotFound:
                pass
