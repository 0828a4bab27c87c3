"""Fixtures and helpers of the promotion tests: a deployment target on the session's Docker daemon and images, test
builds published to the session's S3 (moto), and clients streaming through the stable endpoint.

Test modules import the fixtures they use by name (pytest finds fixtures among a module's attributes).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest

from stoker.containers import engine
from stoker.deploy.rollout import EXPLICIT_ARGS
from stoker.serving import promote
from stoker.containers.ports import Ports
from stoker.protocol import ENSEMBLE, LLMAPI, Interface
from stoker.stack.services import free_port

from serving_models import publish, repo_digest, write_llmapi_repo, write_repo
from stream_clients import grpc_inputs

ROOT = Path(__file__).resolve().parents[2]
SECRET = f"stoker-test-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def images(triton_image):
    from stoker.spec.schema import Deploy

    return triton_image, Deploy().proxy_image  # the session's daemon and images (tests/conftest.py)


@pytest.fixture(scope="module")
def client(images):
    return engine.connect(None)


def new_bucket(local_stack, prefix: str):
    """A fresh bucket on the session's S3: (boto3 client, bucket name, the credentials' environment)."""
    env = {**local_stack["aws_env"], "AWS_DEFAULT_REGION": "us-east-1"}
    c = boto3.client("s3", endpoint_url=local_stack["s3"], region_name="us-east-1",
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    bucket = f"{prefix}-{uuid.uuid4().hex[:10]}"
    c.create_bucket(Bucket=bucket)
    return c, bucket, env


@pytest.fixture(scope="module")
def s3(local_stack):
    c, bucket, _env = new_bucket(local_stack, "promo")
    return c, bucket, local_stack["s3"], local_stack["aws_env"]


def listen_ports() -> Ports:
    a = free_port()
    b = free_port(exclude=(a,))
    return Ports(a, b, free_port(exclude=(a, b)))


@pytest.fixture
def target(client, tmp_path, images):
    t = promote.Target(name=f"p{uuid.uuid4().hex[:8]}", listen=listen_ports(), proxy_image=images[1],
                       state_dir=tmp_path / "proxy")
    yield t
    engine.remove_deployment(client, t.name, lambda _l: None)


class Build:
    """Publish a test repository and describe the backend that serves it."""

    interface = ENSEMBLE  # how clients speak to what it serves (stoker.protocol)

    def __init__(self, s3, images, tmp_path: Path, name: str) -> None:
        self.s3, self.image, self.tmp, self.name = s3, images[0], tmp_path, name

    def __call__(self, tag: str, ready_timeout_s: float = 60, **model) -> engine.BackendSpec:
        c, bucket, endpoint, env = self.s3
        uri, digest = publish(c, bucket, endpoint, write_repo(self.tmp / f"{tag}-{uuid.uuid4().hex[:6]}", tag,
                                                               **model))
        # As the reference target's backends run (rollout.backend_spec): explicit model control, so that retire
        # can make the old backend refuse new requests (retire.refuse_new).
        return engine.BackendSpec(name=self.name, image=self.image, repository_uri=uri, repo_digest=digest,
                                  env={**env, "AWS_DEFAULT_REGION": "us-east-1"}, ready_timeout_s=ready_timeout_s,
                                  run_id=f"run-{tag}", extra_args=list(EXPLICIT_ARGS))

    def source(self, b: engine.BackendSpec) -> str:
        """Python that makes ``b`` again in another process (which imports json and stoker's docker_engine)."""
        return f"engine.BackendSpec(**json.loads({json.dumps({**b.__dict__, 'env': b.env})!r}))"


class GpuBuild(Build):
    """The same test builds, served by the backends `target: tensorrt` supplies (stoker/targets/gpu.py) on the
    STAND-IN (STOKER_STANDIN=1): its image, its serve command, the repository mounted from a folder on this host
    at /models, device ids labelled (and dropped). Only the repository's models are the scripted fault models."""

    gpu_target = "tensorrt"

    def write(self, root: Path, tag: str, **model) -> Path:
        return write_repo(root, tag, **model)

    def __call__(self, tag: str, ready_timeout_s: float = 60, **model) -> engine.BackendSpec:
        from stoker.deploy import rollout
        from stoker.spec.load import parse_spec

        root = self.write(self.tmp / f"{tag}-{uuid.uuid4().hex[:6]}", tag, **model)
        data = {"model": {"repo_id": "a/b"}, "storage": {"bucket": "unused"}, "target": self.gpu_target,
                "gpus": {"type": "h100-80gb", "count": 2, "rollout": "surge"},
                "deploy": {"name": self.name, "image": "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3",
                           "ready_timeout_s": ready_timeout_s, "openai": False}}
        args = (str(root), repo_digest(root), f"run-{tag}")
        b = rollout.backend_spec(parse_spec(data), args[0], args[1], {}, run_id=args[2], reload=False, gpus=(0,),
                                 standin=True)
        self.made = {**getattr(self, "made", {}), b.repo_digest: (data, args)}
        return b

    def source(self, b: engine.BackendSpec) -> str:
        data, (root, digest, run_id) = self.made[b.repo_digest]
        return (f"__import__('importlib').import_module('stoker.deploy.rollout').backend_spec("
                f"__import__('importlib').import_module('stoker.spec.load').parse_spec("
                f"json.loads({json.dumps(data)!r})), {root!r}, {digest!r}, {{}}, run_id={run_id!r}, reload=False, "
                "gpus=(0,), standin=True)")


class PytorchBuild(GpuBuild):
    """The backends `target: pytorch` supplies, on the STAND-IN: TensorRT-LLM's `llmapi` layout (one `tensorrt_llm`
    model with the LLM API's inputs, text in, cumulative text out), here the scripted fault model of that contract."""

    gpu_target = "pytorch"
    interface = LLMAPI

    def write(self, root: Path, tag: str, **model) -> Path:
        return write_llmapi_repo(root, tag, **model)


@pytest.fixture(params=["reference"])
def build(request, s3, images, tmp_path, target, monkeypatch):
    """Builds for the reference target; ``@pytest.mark.parametrize("build", ["reference", "tensorrt", "pytorch"],
    indirect=True)`` runs a test for the GPU targets' backends (on the stand-in) too."""
    if request.param in ("tensorrt", "pytorch"):
        request.getfixturevalue("standin_image")
        kind = GpuBuild if request.param == "tensorrt" else PytorchBuild
        return kind(s3, images, tmp_path, target.name)
    return Build(s3, images, tmp_path, target.name)


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)
        print(line, flush=True)


def generate(http_url: str, text: str = "hi", max_tokens: int = 3, timeout_s: float = 10,
             headers: dict | None = None, context=None, interface: Interface = ENSEMBLE) -> str:
    body = json.dumps(interface.request(text, max_tokens, streaming=True)).encode()
    req = urllib.request.Request(f"{http_url}/v2/models/{interface.model}/generate_stream", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s, context=context) as r:
        raw = r.read().decode()
    events = [json.loads(ln[5:]) for ln in raw.splitlines() if ln.startswith("data:")]
    assert events and not any("error" in e for e in events), raw
    out = b""
    for e in events:
        out += interface.new_part(e[interface.text_output].encode(), out)
    return out.decode()


def serving_tag(target: promote.Target, interface: Interface = ENSEMBLE) -> str:
    return generate(target.endpoint["http"], interface=interface).split(":")[0]


def deploy(client, target, spec, log=None, settle_s=1.0, watch_s=2.0):
    log = Lines() if log is None else log
    staged = promote.prepare(client, target, spec, settle_s, log)
    if staged["reused"]:
        return staged, None
    return staged, promote.go_live(client, target, staged, watch_s, 1.0, 10.0, log)


def backends(client, name):
    return [c for c in engine.containers(client, name, role=engine.ROLE_BACKEND)]


def assert_one_live(client, target, tag, interface: Interface = ENSEMBLE):
    assert serving_tag(target, interface) == tag
    running = [c for c in backends(client, target.name) if c.status == "running"]
    assert len(running) == 1, [c.name for c in running]
    view, _ = promote.observe_proxy(client, target)
    assert view.running and view.live == running[0].labels[engine.LABEL_SLOT]


class Load:
    """Clients streaming through the stable endpoint: persistent gRPC channel + HTTP keep-alive SSE."""

    def __init__(self, endpoint: dict, interface: Interface = ENSEMBLE) -> None:
        self.endpoint, self.stop, self.interface = endpoint, threading.Event(), interface
        self.ok = {"grpc": 0, "http": 0}
        self.failures: list[str] = []
        self.tags: set[str] = set()
        self.threads = [threading.Thread(target=self._grpc, daemon=True),
                        threading.Thread(target=self._http, daemon=True)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def _grpc(self) -> None:
        import asyncio

        import tritonclient.grpc.aio as tritonclient_aio
        from tritonclient.grpc.aio import InferenceServerClient

        iface = self.interface

        async def run() -> None:
            client = InferenceServerClient(self.endpoint["grpc"])
            try:
                while not self.stop.is_set():
                    async def requests():
                        model, inputs = grpc_inputs(tritonclient_aio, 3, iface)
                        yield {"model_name": model, "inputs": inputs}

                    got, so_far = [], b""
                    try:
                        async for result, error in client.stream_infer(requests()):
                            if error is not None:
                                raise error
                            part = iface.new_part(result.as_numpy(iface.text_output)[0], so_far)
                            so_far += part
                            got.append(part.decode())
                            if len(got) == 3:
                                break
                    except Exception as exc:  # noqa: BLE001 - every failure is recorded, the test asserts none
                        self.failures.append(f"grpc: {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    if len(got) != 3:
                        self.failures.append(f"grpc: truncated stream {got}")
                    else:
                        self.ok["grpc"] += 1
                        self.tags.add(got[0].split(":")[0])
            finally:
                await client.close()

        asyncio.run(run())

    def _http(self) -> None:
        import http.client

        host, port = self.endpoint["http"].removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)  # one keep-alive connection
        iface = self.interface
        body = json.dumps(iface.request("hi", 3, streaming=True))
        while not self.stop.is_set():
            try:
                conn.request("POST", f"/v2/models/{iface.model}/generate_stream", body,
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read().decode()
                events = [json.loads(ln[5:]) for ln in raw.splitlines() if ln.startswith("data:")]
                if resp.status != 200 or len(events) != 3 or any("error" in e for e in events):
                    self.failures.append(f"http: status {resp.status}, {raw[:200]}")
                else:
                    self.ok["http"] += 1
                    self.tags.add(events[0][iface.text_output].split(":")[0])
            except Exception as exc:  # noqa: BLE001
                self.failures.append(f"http: {type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=10)


def restart_proxy(client, target) -> None:
    promote.proxy_container(client, target.name).restart(timeout=5)
    promote.wait_proxy(client, target)
