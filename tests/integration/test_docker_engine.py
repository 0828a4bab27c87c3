"""Deploy real Triton containers (our CPU image) serving a model repository from a real
moto S3 server: ready, reuse, blue/green replace, broken repo, busy port.

Needs a Docker daemon (infra/dockerd.sh) and builds the image on first use (~2-4 min).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import boto3
import docker.errors
import pytest

from stoker.docker_engine import (
    LABEL_DEPLOYMENT,
    LABEL_DIGEST,
    LABEL_MANAGED,
    LABEL_SLOT,
    DeployRequest,
    DockerUnavailable,
    ImageMissing,
    NotReady,
    PortInUse,
    Ports,
    connect,
    deploy,
    find_serving,
    http_status,
    is_port_free,
    remove_deployment,
)
from stoker.stack.dockerd import DOCKERD_SH, ensure_daemon, stop_daemon
from stoker.stack.image import (
    DEFAULT_IMAGE,
    RECIPE_LABEL,
    ImageBuildFailed,
    ensure_image,
    recipe_digest,
)

pytestmark = [pytest.mark.docker, pytest.mark.s3]

IMAGE = os.environ.get("STOKER_TRITON_IMAGE", DEFAULT_IMAGE)
SECRET = f"stoker-test-secret-{uuid.uuid4().hex}"


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def client():
    return connect(None)


@pytest.fixture(scope="session")
def image(client) -> str:
    ensure_image(IMAGE, None, log=lambda line: print(f"[image] {line}", flush=True))
    return IMAGE


def _free_port() -> int:
    from stoker.stack.services import free_port

    return free_port()


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """A real S3 endpoint: moto_server on a free local port."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto_server did not start: {log.read_text()[-500:]}")
            time.sleep(0.2)
    yield endpoint
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket per test; returns (boto3 client, bucket name)."""
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="stoker-test",
        aws_secret_access_key=SECRET,
    )
    bucket = f"repo-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    return s3, bucket


@pytest.fixture
def deployment(client):
    """A unique deployment name whose containers are removed after the test."""
    name = f"t{uuid.uuid4().hex[:10]}"
    yield name
    remove_deployment(client, name, log=lambda line: None)


@pytest.fixture
def ports() -> Ports:
    """Three free ports plus their standby (+10) ports."""
    for _ in range(200):
        base = random.randrange(20000, 40000, 3)
        candidate = Ports(base, base + 1, base + 2)
        wanted = [p for _, p in candidate.items()] + [
            p + 10 for _, p in candidate.items()
        ]
        if all(is_port_free(p) for p in wanted):
            return candidate
    pytest.fail("no free port block found")


# ------------------------------------------------------------------ helpers

CONFIG = """\
name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] }} ]
output [ {{ name: "TEXT", data_type: TYPE_STRING, dims: [ 1 ] }} ]
parameters {{ key: "tag" value {{ string_value: "{tag}" }} }}
instance_group [ {{ kind: KIND_CPU, count: 1 }} ]
"""

MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils

TAG = {tag!r}


class TritonPythonModel:
    def initialize(self, args):
        if {broken!r}:
            raise RuntimeError("model.py raising on purpose")

    def execute(self, requests):
        # Decoupled: two streamed responses per request, then the final flag.
        for request in requests:
            sender = request.get_response_sender()
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()[0]
            for piece in (TAG.encode(), text):
                out = pb_utils.Tensor("TEXT", np.array([piece], dtype=np.object_))
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def write_repo(root: Path, tag: str, broken: bool = False) -> Path:
    """A one-model repository (decoupled python backend) plus an empty folder."""
    model = root / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG.format(tag=tag))
    (model / "1" / "model.py").write_text(MODEL.format(tag=tag, broken=broken))
    # An empty folder, as ensembles need one; S3 needs a placeholder key for it.
    (model / "notes").mkdir()
    return root


def repo_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def upload(s3, bucket: str, root: Path, prefix: str) -> None:
    for p in sorted(root.rglob("*")):
        key = f"{prefix}/{p.relative_to(root).as_posix()}"
        if p.is_file():
            s3.upload_file(str(p), bucket, key)
        elif not any(p.iterdir()):
            s3.put_object(
                Bucket=bucket, Key=key + "/", Body=b""
            )  # zero-byte folder marker


def publish(s3_bucket, s3_endpoint: str, root: Path) -> tuple[str, str]:
    """Upload ``root`` under its digest; returns (repository_uri, digest)."""
    s3, bucket = s3_bucket
    digest = repo_digest(root)
    upload(s3, bucket, root, digest[:16])
    host = s3_endpoint.removeprefix("http://")
    return f"s3://{host}/{bucket}/{digest[:16]}", digest


def request_for(
    name: str, image: str, uri: str, digest: str, ports: Ports, **kw
) -> DeployRequest:
    env = {
        "AWS_ACCESS_KEY_ID": "stoker-test",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    return DeployRequest(
        name=name,
        image=image,
        repository_uri=uri,
        repo_digest=digest,
        env=env,
        ports=ports,
        ready_timeout_s=kw.pop("ready_timeout_s", 90),
        **kw,
    )


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def served_tag(http_url: str) -> str:
    return get_json(f"{http_url}/v2/models/echo/config")["parameters"]["tag"][
        "string_value"
    ]


def stream_generate(http_url: str, text: str) -> list[str]:
    """POST /generate_stream (server-sent events); the TEXT of each event."""
    req = urllib.request.Request(
        f"{http_url}/v2/models/echo/generate_stream",
        data=json.dumps({"TEXT": text}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read().decode()
    return [
        json.loads(line[5:])["TEXT"]
        for line in body.splitlines()
        if line.startswith("data:")
    ]


def managed(client, name: str) -> list:
    return client.containers.list(
        all=True, filters={"label": [f"{LABEL_DEPLOYMENT}={name}"]}
    )


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
    """A log sink that keeps every line (deploy logs from a background thread)."""

    def __call__(self, line: str) -> None:
        self.append(line)
        print(line, flush=True)


# ------------------------------------------------------------------ tests


def test_deploy_serves_from_s3_then_reuses_same_digest(
    client, image, s3_endpoint, s3_bucket, deployment, ports, tmp_path
):
    uri, digest = publish(s3_bucket, s3_endpoint, write_repo(tmp_path / "a", "A"))
    lines = Lines()
    t0 = time.monotonic()
    first = deploy(client, request_for(deployment, image, uri, digest, ports), lines)
    print(
        f"deploy (container start -> ready, incl. S3 load): {time.monotonic() - t0:.1f} s"
    )

    assert (first.reused, first.replaced, first.ports) == (False, None, ports)
    assert first.http_url == f"http://127.0.0.1:{ports.http}"
    assert first.grpc_url == f"127.0.0.1:{ports.grpc}"
    assert http_status(f"{first.http_url}/v2/models/echo/ready", 5) == 200
    assert served_tag(first.http_url) == "A"
    assert stream_generate(first.http_url, "hello") == ["A", "hello"]

    container = client.containers.get(first.container_id)
    assert container.labels[LABEL_MANAGED] == "true"
    assert container.labels[LABEL_DIGEST] == digest
    assert container.labels[LABEL_SLOT] == "blue"
    assert container.attrs["HostConfig"]["NetworkMode"] == "host"
    assert SECRET not in json.dumps(container.labels)
    assert any("[stoker-" in line for line in lines), (
        "Triton's own log lines reach the log"
    )
    assert not any(SECRET in line for line in lines)

    started_at = container.attrs["State"]["StartedAt"]
    again = deploy(client, request_for(deployment, image, uri, digest, ports), lines)
    assert (
        again.reused
        and again.container_id == first.container_id
        and again.replaced is None
    )
    container.reload()
    assert container.attrs["State"]["StartedAt"] == started_at  # not restarted
    assert find_serving(client, deployment, digest).id == first.container_id
    assert find_serving(client, deployment, "other-digest") is None


def test_new_digest_replaces_old_which_serves_until_new_is_ready(
    client, image, s3_endpoint, s3_bucket, deployment, ports, tmp_path
):
    uri_a, digest_a = publish(s3_bucket, s3_endpoint, write_repo(tmp_path / "a", "A"))
    uri_b, digest_b = publish(s3_bucket, s3_endpoint, write_repo(tmp_path / "b", "B"))
    old = deploy(
        client, request_for(deployment, image, uri_a, digest_a, ports), Lines()
    )

    # Poll the old endpoint until deploy reports the new container ready.
    new_ready = threading.Event()
    old_answers: list[int] = []

    def poll_old() -> None:
        while not new_ready.is_set():
            try:
                old_answers.append(http_status(f"{old.http_url}/v2/health/ready", 2))
            except OSError:
                old_answers.append(0)
            time.sleep(0.2)

    lines = Lines()

    def log(line: str) -> None:
        lines(line)
        if "ready after" in line:
            new_ready.set()

    poller = threading.Thread(target=poll_old)
    poller.start()
    try:
        new = deploy(
            client, request_for(deployment, image, uri_b, digest_b, ports), log
        )
    finally:
        new_ready.set()
        poller.join()

    assert len(old_answers) >= 3 and set(old_answers) == {200}, old_answers
    assert new.ports == ports.shifted(10) and new.replaced == old.container_name
    assert not new.reused
    assert served_tag(new.http_url) == "B"
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(old.container_id)
    assert is_port_free(ports.http)  # the old container is gone, its port with it
    assert client.containers.get(new.container_id).labels[LABEL_SLOT] == "green"

    # The next digest goes back to the requested ports (blue), replacing green.
    uri_c, digest_c = publish(s3_bucket, s3_endpoint, write_repo(tmp_path / "c", "C"))
    third = deploy(
        client, request_for(deployment, image, uri_c, digest_c, ports), Lines()
    )
    assert third.ports == ports and third.replaced == new.container_name
    assert served_tag(third.http_url) == "C"
    assert [c.id for c in managed(client, deployment)] == [third.container_id]


def test_broken_repo_is_not_ready_and_old_keeps_serving(
    client, image, s3_endpoint, s3_bucket, deployment, ports, tmp_path
):
    uri_a, digest_a = publish(s3_bucket, s3_endpoint, write_repo(tmp_path / "a", "A"))
    uri_x, digest_x = publish(
        s3_bucket, s3_endpoint, write_repo(tmp_path / "x", "X", broken=True)
    )
    old = deploy(
        client, request_for(deployment, image, uri_a, digest_a, ports), Lines()
    )

    t0 = time.monotonic()
    with pytest.raises(NotReady) as err:
        deploy(client, request_for(deployment, image, uri_x, digest_x, ports), Lines())
    assert time.monotonic() - t0 < 60, (
        "a container that exits must fail fast, not at the deadline"
    )

    first_line, _, rest = str(err.value).partition("\n")
    assert first_line.startswith(
        f"stoker-{deployment}-green never became ready: container exited"
    )
    assert first_line.endswith(f"{old.container_name} keeps serving")
    assert "model.py raising on purpose" in rest  # Triton's log tail explains why
    assert SECRET not in str(err.value)
    assert [c.id for c in managed(client, deployment)] == [old.container_id]
    assert http_status(f"{old.http_url}/v2/models/echo/ready", 5) == 200
    assert served_tag(old.http_url) == "A"


def test_port_held_by_another_process_fails_before_starting(
    client, image, s3_endpoint, s3_bucket, deployment, ports, tmp_path
):
    uri, digest = publish(s3_bucket, s3_endpoint, write_repo(tmp_path / "a", "A"))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", ports.http))
        squatter.listen()
        with pytest.raises(PortInUse) as err:
            deploy(client, request_for(deployment, image, uri, digest, ports), Lines())
    assert (
        str(err.value)
        == f"port {ports.http} (deploy.ports.http) is in use by another process"
    )
    assert managed(client, deployment) == []


def test_refused_ulimit_fails_start_and_leaves_nothing(
    client, image, deployment, ports
):
    # dockerd here caps memlock at 8 MiB; -1 (what GPU guides use) is refused at start.
    req = request_for(
        deployment,
        image,
        "s3://127.0.0.1:1/b/p",
        "d",
        ports,
        ulimits={"memlock": (-1, -1)},
    )
    with pytest.raises(
        NotReady, match=f"^stoker-{deployment}-blue failed to start: .*rlimit"
    ):
        deploy(client, req, Lines())
    assert managed(client, deployment) == []


def test_missing_image_is_reported(client, deployment, ports):
    req = request_for(
        deployment, "stoker/no-such-image:0", "s3://127.0.0.1:1/b/p", "d", ports
    )
    with pytest.raises(
        ImageMissing, match="^image stoker/no-such-image:0 is not in the Docker"
    ):
        deploy(client, req, Lines())
    assert managed(client, deployment) == []


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


def test_ensure_daemon_starts_and_stops_only_its_own_daemon(
    client, tmp_path, monkeypatch
):
    """A second, private dockerd (own socket, roots and bridge) next to the main one."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 to give the private daemon its own bridge")
    # Its own bridge: a dockerd started with --bridge=none deletes the shared docker0.
    bridge = f"stk{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "link", "add", "name", bridge, "type", "bridge"], check=True)
    root = tmp_path / "dd"
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
    assert client.ping()  # the main daemon was not touched
