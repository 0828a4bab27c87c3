"""The Docker engine module against the real daemon: refused starts leave nothing, missing images, the
CPU image's recipe, and dockerd lifecycle. Promotion itself: test_promotion.py.

Needs a Docker daemon (infra/dockerd.sh) and builds the image on first use (~2-4 min).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import docker.errors
import pytest

from stoker.containers.engine import (
    BackendSpec,
    DockerUnavailable,
    ImageMissing,
    NotReady,
    connect,
    containers,
    remove_deployment,
    require_image,
    start_backend,
)
from stoker.containers.ports import Ports
from stoker.stack.dockerd import DOCKERD_SH, ensure_daemon, stop_daemon
from stoker.stack.image import (
    DEFAULT_IMAGE,
    RECIPE_LABEL,
    ImageBuildFailed,
    ensure_image,
    recipe_digest,
)

pytestmark = [pytest.mark.docker]

IMAGE = os.environ.get("STOKER_TRITON_IMAGE", DEFAULT_IMAGE)


@pytest.fixture(scope="session")
def client():
    return connect(None)


@pytest.fixture(scope="session")
def image(client) -> str:
    ensure_image(IMAGE, None, log=lambda line: print(f"[image] {line}", flush=True))
    return IMAGE


@pytest.fixture
def deployment(client):
    """A unique deployment name whose containers are removed after the test."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    remove_deployment(client, name, log=lambda line: None)


def process_ended(pid: int, within_s: float = 5.0) -> bool:
    """Gone, or a zombie waiting for its (re)parent to reap it."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


class Lines(list):
    """A log sink that keeps every line."""

    def __call__(self, line: str) -> None:
        self.append(line)
        print(line, flush=True)


# ------------------------------------------------------------------ tests


def test_refused_ulimit_fails_start_and_leaves_nothing(client, image, deployment):
    # dockerd here caps memlock at 8 MiB; -1 (what GPU guides use) is refused at start.
    spec = BackendSpec(name=deployment, image=image, repository_uri="s3://127.0.0.1:1/b/p", repo_digest="d",
                       ulimits={"memlock": (-1, -1)})
    with pytest.raises(NotReady, match=f"^stoker-{deployment}-blue failed to start: .*rlimit"):
        start_backend(client, spec, "blue", Ports(20001, 20002, 20003))
    assert containers(client, deployment) == []


def test_missing_image_is_reported(client):
    with pytest.raises(ImageMissing, match="^image stoker/no-such-image:0 is not in the Docker"):
        require_image(client, "stoker/no-such-image:0")


def test_image_is_current_and_not_rebuilt(client, image):
    lines = Lines()
    image_id = ensure_image(image, None, lines)
    assert image_id == client.images.get(image).id
    assert client.images.get(image).labels[RECIPE_LABEL] == recipe_digest()
    assert lines == [f"image {image} is up to date (recipe {recipe_digest()[:12]})"]
    assert client.images.get(image).attrs["Config"]["Entrypoint"] == [
        "/opt/tritonserver/bin/tritonserver"
    ]


def test_failed_build_raises_with_build_output(client, tmp_path, monkeypatch):
    monkeypatch.setenv("STOKER_WHEELS_DIR", str(tmp_path / "no-wheels"))
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))
    lines = Lines()
    with pytest.raises(ImageBuildFailed) as err:
        ensure_image("stoker/triton-cpu:never-built", None, lines)
    first = str(err.value).splitlines()[0]
    assert first.startswith(
        "image build of stoker/triton-cpu:never-built failed (exit status 1): "
        "build.sh: torch CPU wheel missing:"
    )
    assert any("torch CPU wheel missing" in line for line in lines)
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get("stoker/triton-cpu:never-built")


def test_ensure_daemon_leaves_a_running_daemon_alone(client, tmp_path):
    assert ensure_daemon(None, tmp_path) is False
    assert not (tmp_path / "dockerd.pid").exists()
    assert stop_daemon(tmp_path) is False
    assert (
        subprocess.run([str(DOCKERD_SH)], capture_output=True, check=False).returncode
        == 0
    )  # idempotent
    with pytest.raises(
        DockerUnavailable, match="^no Docker daemon answers at unix:///nonexistent"
    ):
        ensure_daemon("unix:///nonexistent/docker.sock", tmp_path, start=False)
    with pytest.raises(DockerUnavailable, match="is not started by stoker"):
        ensure_daemon("tcp://127.0.0.1:1", tmp_path, start=True)


def _shared_containerd(namespace: str) -> list[str]:
    """The main daemon's containerd, under a namespace of the private daemon's own: a second containerd starting
    beside the first can outlast dockerd's fixed wait for it on a loaded machine (tests run in parallel)."""
    for sock in ("/run/containerd/containerd.sock", "/var/run/docker/containerd/containerd.sock"):
        if Path(sock).is_socket():
            return [f"--containerd={sock}", f"--containerd-namespace={namespace}",
                    f"--containerd-plugins-namespace={namespace}-plugins"]
    return []


def test_ensure_daemon_starts_and_stops_only_its_own_daemon(
    client, tmp_path, monkeypatch
):
    """A second, private dockerd (own socket, roots and bridge) next to the main one."""
    # A missing prerequisite fails (infra/test-deps.sh installs it): a skip would pass CI without checking anything.
    assert shutil.which("ip") is not None, "needs iproute2 to give the private daemon its own bridge"
    # Its own bridge: a dockerd started with --bridge=none deletes the shared docker0.
    bridge = f"stk{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "link", "add", "name", bridge, "type", "bridge"], check=True)
    # Short: dockerd binds unix sockets under its exec root, and a path past sun_path's 108 bytes fails to bind.
    root = Path(tempfile.mkdtemp(prefix="stk-dd-"))
    monkeypatch.setenv(
        "DOCKERD_EXTRA_ARGS",
        " ".join(
            [
                f"--data-root={root}/data",
                f"--exec-root={root}/exec",
                f"--pidfile={root}/docker.pid",
                f"--bridge={bridge}",
                "--iptables=false",
                "--ip-masq=false",
                *_shared_containerd(bridge),
            ]
        ),
    )
    host = f"unix://{root}/docker.sock"
    state = tmp_path / "state"
    try:
        subprocess.run(
            ["ip", "addr", "add", "10.213.77.1/24", "dev", bridge], check=True
        )
        assert ensure_daemon(host, state) is True
        pid = int((state / "dockerd.pid").read_text())
        assert connect(host).ping()
        assert ensure_daemon(host, state) is False  # already answering: nothing started
        assert stop_daemon(state) is True
        assert process_ended(pid)
    finally:
        stop_daemon(state)
        subprocess.run(["ip", "link", "del", bridge], check=False)
    with pytest.raises(DockerUnavailable):
        ensure_daemon(host, state, start=False)
    # dockerd bind-mounts its data root onto itself; one that did not unmount it would keep the folder busy.
    if f" {root}/data " in Path("/proc/mounts").read_text():
        subprocess.run(["umount", "-l", f"{root}/data"], check=False)
    shutil.rmtree(root, ignore_errors=True)
    assert client.ping()  # the main daemon was not touched
