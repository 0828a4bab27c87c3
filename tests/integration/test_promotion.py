"""Promotion behind the stable endpoint, on the real Docker engine, real HAProxy, real Triton, real S3 (moto).

Every fault ends the same way: the old build still serves at the same address, and the error is one
line naming the cause. Load during a replace streams through the proxy over gRPC and HTTP at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest

from stoker import docker_engine as engine
from stoker.serving import promote
from stoker.serving.ports import Ports, choose_backend_ports, is_port_free
from stoker.stack.services import free_port

from serving_models import publish, write_repo

pytestmark = [pytest.mark.docker, pytest.mark.s3]
ROOT = Path(__file__).resolve().parents[2]
SECRET = f"stoker-test-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def images(triton_image):
    from stoker.spec import Deploy

    return triton_image, Deploy().proxy_image  # the session's daemon and images (tests/conftest.py)


@pytest.fixture(scope="module")
def client(images):
    return engine.connect(None)


@pytest.fixture(scope="module")
def s3(local_stack):
    env = local_stack["aws_env"]
    c = boto3.client("s3", endpoint_url=local_stack["s3"], region_name="us-east-1",
                     aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    bucket = f"promo-{uuid.uuid4().hex[:10]}"
    c.create_bucket(Bucket=bucket)
    return c, bucket, local_stack["s3"], env


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

    def __init__(self, s3, images, tmp_path: Path, name: str) -> None:
        self.s3, self.image, self.tmp, self.name = s3, images[0], tmp_path, name

    def __call__(self, tag: str, ready_timeout_s: float = 60, **model) -> engine.BackendSpec:
        c, bucket, endpoint, env = self.s3
        uri, digest = publish(c, bucket, endpoint, write_repo(self.tmp / f"{tag}-{uuid.uuid4().hex[:6]}", tag,
                                                               **model))
        return engine.BackendSpec(name=self.name, image=self.image, repository_uri=uri, repo_digest=digest,
                                  env={**env, "AWS_DEFAULT_REGION": "us-east-1"}, ready_timeout_s=ready_timeout_s,
                                  run_id=f"run-{tag}")


@pytest.fixture
def build(s3, images, tmp_path, target):
    return Build(s3, images, tmp_path, target.name)


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)
        print(line, flush=True)


def generate(http_url: str, text: str = "hi", max_tokens: int = 3, timeout_s: float = 10,
             headers: dict | None = None, context=None) -> str:
    body = json.dumps({"text_input": text, "max_tokens": max_tokens, "stream": True}).encode()
    req = urllib.request.Request(f"{http_url}/v2/models/ensemble/generate_stream", data=body,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s, context=context) as r:
        raw = r.read().decode()
    events = [json.loads(ln[5:]) for ln in raw.splitlines() if ln.startswith("data:")]
    assert events and not any("error" in e for e in events), raw
    return "".join(e["text_output"] for e in events)


def serving_tag(target: promote.Target) -> str:
    return generate(target.endpoint["http"]).split(":")[0]


def deploy(client, target, spec, log=None, settle_s=1.0, watch_s=2.0):
    log = Lines() if log is None else log
    staged = promote.prepare(client, target, spec, settle_s, log)
    if staged["reused"]:
        return staged, None
    return staged, promote.go_live(client, target, staged, watch_s, 1.0, 10.0, log)


def backends(client, name):
    return [c for c in engine.containers(client, name, role=engine.ROLE_BACKEND)]


def assert_one_live(client, target, tag):
    assert serving_tag(target) == tag
    running = [c for c in backends(client, target.name) if c.status == "running"]
    assert len(running) == 1, [c.name for c in running]
    view, _ = promote.observe_proxy(client, target)
    assert view.running and view.live == running[0].labels[engine.LABEL_SLOT]


# ------------------------------------------------------------------ the happy path, under load


class Load:
    """Clients streaming through the stable endpoint: persistent gRPC channel + HTTP keep-alive SSE."""

    def __init__(self, endpoint: dict) -> None:
        self.endpoint, self.stop = endpoint, threading.Event()
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

        import numpy as np
        from tritonclient.grpc import InferInput
        from tritonclient.grpc.aio import InferenceServerClient

        async def run() -> None:
            client = InferenceServerClient(self.endpoint["grpc"])
            try:
                while not self.stop.is_set():
                    text = InferInput("text_input", [1], "BYTES")
                    text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
                    n = InferInput("max_tokens", [1], "INT32")
                    n.set_data_from_numpy(np.array([3], dtype=np.int32))

                    async def requests():
                        yield {"model_name": "ensemble", "inputs": [text, n]}

                    got = []
                    try:
                        async for result, error in client.stream_infer(requests()):
                            if error is not None:
                                raise error
                            got.append(result.as_numpy("text_output")[0].decode())
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
        body = json.dumps({"text_input": "hi", "max_tokens": 3, "stream": True})
        while not self.stop.is_set():
            try:
                conn.request("POST", "/v2/models/ensemble/generate_stream", body,
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                raw = resp.read().decode()
                events = [json.loads(ln[5:]) for ln in raw.splitlines() if ln.startswith("data:")]
                if resp.status != 200 or len(events) != 3 or any("error" in e for e in events):
                    self.failures.append(f"http: status {resp.status}, {raw[:200]}")
                else:
                    self.ok["http"] += 1
                    self.tags.add(events[0]["text_output"].split(":")[0])
            except Exception as exc:  # noqa: BLE001
                self.failures.append(f"http: {type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=10)


def test_replace_under_streaming_load_keeps_the_address_and_drops_nothing(client, target, build):
    a, b = build("A"), build("B", interval_s=0.01)
    staged, done = deploy(client, target, a)
    assert done["switched"] and staged["previous"] is None
    assert_one_live(client, target, "A")
    proxy = promote.proxy_container(client, target.name)
    assert proxy.attrs["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert proxy.labels[engine.LABEL_ROLE] == "proxy"
    live = backends(client, target.name)[0]
    assert live.attrs["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert SECRET not in json.dumps(live.labels)
    ports = Ports.parse(live.labels[engine.LABEL_PORTS])
    assert all(v < 32768 or v > 60999 for v in ports.values())  # never in the ephemeral range
    assert set(ports.values()).isdisjoint(target.listen.values())

    with Load(target.endpoint) as load:
        time.sleep(1.5)
        staged, done = deploy(client, target, b, watch_s=3.0)
        time.sleep(1.5)
    assert load.failures == [], load.failures[:5]
    assert load.ok["grpc"] > 5 and load.ok["http"] > 5 and load.tags == {"A", "B"}
    # switch_s < 1.0: a deadline against hangs (>= 20x the 7-51 ms measured); benchmarks/operate.py measures it.
    assert done["switched"] and done["switch_s"] < 1.0 and "retire_s" in done
    assert_one_live(client, target, "B")

    # The same digest again: nothing restarts, nothing moves.
    started = engine.started_at(backends(client, target.name)[0])
    again, _ = deploy(client, target, b)
    assert again["reused"] and engine.started_at(backends(client, target.name)[0]) == started


# ------------------------------------------------------------------ faults: the old build keeps serving


def test_candidate_ready_then_exits_is_caught_by_the_settle_window(client, target, build):
    """Regression: Triton answered ready once, then exited (its metrics port was taken); the old one was gone."""
    deploy(client, target, build("A"))
    lines = Lines()
    with pytest.raises(engine.NotReady) as err:
        promote.prepare(client, target, build("X", mode="exit_after", arg=0.5), 4.0, lines)
    first = str(err.value).splitlines()[0]
    assert "settle window" in first or "exited before it was ready" in first, first
    assert "keeps serving" in first
    assert_one_live(client, target, "A")


def test_candidate_that_never_becomes_ready(client, target, build):
    deploy(client, target, build("A"))
    t0 = time.monotonic()
    with pytest.raises(engine.NotReady) as err:
        promote.prepare(client, target, build("H", mode="hang", ready_timeout_s=6), 1.0, Lines())
    # A deadline against hangs: 10x the expected ~7 s (the 6 s ready timeout and a 1 s settle window).
    assert time.monotonic() - t0 < 70
    assert "not ready after 6 s" in str(err.value).splitlines()[0]
    assert_one_live(client, target, "A")


def test_candidate_whose_smoke_inference_fails(client, target, build):
    deploy(client, target, build("A"))
    with pytest.raises(engine.NotReady) as err:
        promote.prepare(client, target, build("R", mode="raise"), 0.5, Lines())
    first = str(err.value).splitlines()[0]
    assert "smoke inference: the model answered an error" in first and "model raising on purpose" in first
    assert_one_live(client, target, "A")


def test_new_backend_dying_in_the_watch_window_switches_back(client, target, build):
    deploy(client, target, build("A"))
    lines = Lines()
    staged = promote.prepare(client, target, build("D", mode="exit_after", arg=4.0), 0.5, lines)
    with pytest.raises(promote.PromotionFailed) as err:
        promote.go_live(client, target, staged, 15.0, 1.0, 5.0, lines)
    msg = str(err.value)
    assert "\n" not in msg and "during the watch window" in msg and "traffic is back on" in msg, msg
    assert "died" in msg or "stopped answering ready" in msg
    assert_one_live(client, target, "A")


def test_a_taken_internal_port_is_skipped_or_retried(client, target, build, monkeypatch):
    deploy(client, target, build("A"))
    claimed = {p for b in promote.observe_backends(client, target.name) for p in b.ports.values()}
    first = choose_backend_ports(is_port_free, claimed, seed=f"{target.name}/1", avoid=set(target.listen.values()))
    with socket.socket() as squatter:  # another process takes the port stoker would pick first
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("0.0.0.0", first.metrics))
        squatter.listen()
        deploy(client, target, build("B"))
        ports = Ports.parse(backends(client, target.name)[0].labels[engine.LABEL_PORTS])
        assert first.metrics not in ports.values()
        assert_one_live(client, target, "B")

        # Taken between the check and Triton's bind: the check is fooled, Triton fails, stoker retries.
        claimed = {p for b in promote.observe_backends(client, target.name) for p in b.ports.values()}
        fooled = choose_backend_ports(is_port_free, claimed, seed=f"{target.name}/1",
                                      avoid=set(target.listen.values()))
        with socket.socket() as racer:
            racer.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            racer.bind(("0.0.0.0", fooled.http))
            racer.listen()
            real = promote.is_port_free
            monkeypatch.setattr(promote, "is_port_free", lambda p: True if p == fooled.http else real(p))
            lines = Lines()
            deploy(client, target, build("C"), log=lines)
            assert any("retrying on other ports" in ln for ln in lines)
            assert_one_live(client, target, "C")


def test_killed_proxy_comes_back_and_a_removed_one_is_recreated(client, target, build):
    deploy(client, target, build("A"))
    proxy = promote.proxy_container(client, target.name)
    pid = proxy.attrs["State"]["Pid"]
    os.kill(pid, signal.SIGKILL)  # a crash: Docker's restart policy brings it back with its config
    deadline = time.monotonic() + 30
    while True:
        try:
            assert serving_tag(target) == "A"
            break
        except (OSError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    proxy.reload()
    assert proxy.attrs["RestartCount"] >= 1

    proxy.remove(force=True)
    lines = Lines()
    deploy(client, target, build("B"), log=lines)  # reconcile recreates it, routed to the live one first
    assert any("create the proxy" in ln for ln in lines)
    assert_one_live(client, target, "B")


def test_sigkill_of_the_deploy_midway_then_a_rerun(client, target, build, tmp_path):
    deploy(client, target, build("A"))
    b = build("B")
    script = tmp_path / "deploy.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from stoker import docker_engine as engine
from stoker.serving import promote
from stoker.serving.ports import Ports
t = promote.Target({target.name!r}, Ports(*{list(target.listen.values())!r}), {target.proxy_image!r},
                   Path({str(target.state_dir)!r}))
spec = engine.BackendSpec(**json.loads({json.dumps({**b.__dict__, 'env': b.env})!r}))
promote.prepare(engine.connect(None), t, spec, 30.0, lambda l: print(l, flush=True))
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:  # kill it in the middle: the candidate is up, settling
        if "staging" in line:
            time.sleep(2.0)
            proc.kill()
            break
    proc.wait(timeout=10)
    assert len(backends(client, target.name)) == 2  # the killed run's candidate is left behind
    assert serving_tag(target) == "A"
    lines = Lines()
    deploy(client, target, build("C"), log=lines)
    assert any("reconcile" in ln and "remove" in ln for ln in lines)
    assert_one_live(client, target, "C")


def test_proxy_ports_held_by_a_foreign_process_are_refused_naming_the_owner(client, target):
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("0.0.0.0", target.listen.grpc))
        squatter.listen()
        with pytest.raises(engine.PortInUse) as err:
            promote.check_listen_ports(client, target)
    msg = str(err.value)
    assert f"port {target.listen.grpc} (deploy.ports.grpc) is in use by pid {os.getpid()}" in msg
    assert engine.containers(client, target.name) == []  # nothing started


# ------------------------------------------------------------------ a switch cut midway (issue 25)


def _restart_proxy(client, target) -> None:
    promote.proxy_container(client, target.name).restart(timeout=5)
    promote.wait_proxy(client, target)


@pytest.mark.parametrize("cut", ["runtime switched, file not rewritten", "file rewritten, runtime not switched"])
def test_a_switch_cut_midway_leaves_file_and_runtime_agreeing_after_reconcile(client, target, build, cut):
    """The process dies between the two halves of a switch (each cut is reproduced by doing exactly its first
    half); the next run's reconcile makes the config file say what the running proxy does, so a proxy restart
    routes where traffic went, never to a backend reconcile removed."""
    deploy(client, target, build("a"))
    log = Lines()
    staged = promote.prepare(client, target, build("b"), 1.0, log)
    cand, old = promote.BackendRef.from_dict(staged["candidate"]), promote.BackendRef.from_dict(staged["previous"])
    if cut.startswith("runtime"):  # what the runtime-first order of earlier versions could leave
        promote.runtime_for(target, promote.proxy_container(client, target.name)).switch(cand.slot, cand.p,
                                                                                          drain=old.slot)
        expect = "b"
    else:  # today's order: the file first
        promote.write_config(target, {cand.slot: cand.p, old.slot: old.p}, cand.slot)
        expect = "a"
    assert serving_tag(target) == expect  # the running proxy decides while it runs
    again = Lines()
    live = promote.reconcile(client, target, again)
    assert any("config file disagreed with its running state; rewritten" in line for line in again), again
    assert live is not None and live.digest == (cand.digest if expect == "b" else old.digest)
    _restart_proxy(client, target)
    assert_one_live(client, target, expect)
    # Consistent now: a further reconcile has nothing to rewrite.
    quiet = Lines()
    promote.reconcile(client, target, quiet)
    assert not any("disagreed" in line for line in quiet), quiet


# ------------------------------------------------------------------ only inference is public (issue 25)

ADMIN_HTTP = [("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/ensemble/unload"),
              ("POST", "/v2/repository/models/ensemble/load"), ("GET", "/v2/logging"), ("GET", "/v2/trace/setting"),
              ("GET", "/v2/models/ensemble/stats"), ("GET", "/v2/systemsharedmemory/status"),
              ("GET", "/v2/cudasharedmemory/status"), ("GET", "/v2/models/ensemble/trace/setting")]


def _http(url: str, method: str = "GET", body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body if body is not None else (b"{}" if method == "POST" else None),
                                 method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_only_inference_health_and_metadata_are_public_at_the_stable_address(client, target, build):
    import grpc
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    deploy(client, target, build("a"))
    http, metrics = target.endpoint["http"], target.endpoint["metrics"].removesuffix("/metrics")
    for method, path in ADMIN_HTTP:
        code, body = _http(f"{http}{path}", method)
        assert code == 403, (path, code, body[:200])
        assert json.loads(body)["error"].startswith("this route is not served at the public endpoint"), path
    for path in ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/ensemble", "/v2/models/ensemble/ready",
                 "/v2/models/ensemble/config"):
        assert _http(f"{http}{path}")[0] == 200, path
    assert serving_tag(target) == "a"  # generate_stream streams through
    assert _http(f"{metrics}/metrics")[0] == 200 and _http(f"{metrics}/v2/models/ensemble/stats")[0] == 403

    g = grpcclient.InferenceServerClient(target.endpoint["grpc"])
    assert g.is_server_live() and g.is_model_ready("ensemble") and g.get_model_metadata("ensemble")
    for call in (g.get_model_repository_index, lambda: g.unload_model("ensemble"), g.get_log_settings,
                 lambda: g.get_inference_statistics("ensemble"), g.get_system_shared_memory_status):
        with pytest.raises(InferenceServerException) as exc:
            call()
        assert exc.value.status() == str(grpc.StatusCode.PERMISSION_DENIED), exc.value
    g.close()
    # The refused unload never reached Triton: the model still serves.
    assert serving_tag(target) == "a"

    # Triton itself refuses them on the backend's own loopback port without the backend's token, which only
    # stoker's reload path reads (from Docker): a local process that reaches the port cannot unload the model.
    backend = backends(client, target.name)[0]
    own = Ports.parse(backend.labels[engine.LABEL_PORTS])
    code, body = _http(f"http://127.0.0.1:{own.http}/v2/repository/index", "POST")
    assert code == 403 and engine.ADMIN_HEADER in body.decode(), (code, body)
    admin = engine.admin_headers(backend)
    assert _http(f"http://127.0.0.1:{own.http}/v2/repository/index", "POST", headers=admin)[0] == 200
    assert _http(f"http://127.0.0.1:{own.http}/v2/models/ensemble/stats")[0] == 403
    direct = grpcclient.InferenceServerClient(f"127.0.0.1:{own.grpc}")
    with pytest.raises(InferenceServerException) as exc:
        direct.unload_model("ensemble")
    assert engine.ADMIN_HEADER in str(exc.value) and direct.is_model_ready("ensemble"), exc.value
    direct.close()


# ------------------------------------------------------------------ listen where meant (issue 25)


def _host_address() -> str:
    """An IPv4 address of this host that is not loopback (the bridge's will do): what another machine dials."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True,
                         check=True).stdout
    return out.split()[3].split("/")[0]


def _answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def test_backends_listen_on_loopback_and_the_endpoint_where_the_spec_says(client, target, build):
    import dataclasses

    outside = _host_address()
    _, done = deploy(client, target, build("a"))
    backend = done["live"]
    for port in backend["ports"]:  # http, grpc, metrics
        assert _answers("127.0.0.1", port) and not _answers(outside, port), port
    assert _answers("127.0.0.1", target.listen.http) and not _answers(outside, target.listen.http)

    # deploy.listen 0.0.0.0 (allowed by the spec in as many words): the proxy is recreated on every interface; the
    # backend it routes to still answers on loopback only.
    opened = dataclasses.replace(target, address="0.0.0.0")
    log = Lines()
    live = promote.reconcile(client, opened, log)
    assert any("recreate" in line for line in log), log
    assert _answers(outside, opened.listen.http) and not _answers(outside, live.ports.http)
    assert serving_tag(opened) == "a"


# ------------------------------------------------------------------ API keys (issue 25)


def test_api_keys_guard_every_route_but_health_and_rotate_without_a_restart(client, target, build, monkeypatch):
    import dataclasses

    import grpc
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from stoker.serving import api_keys

    key_a, key_b = f"key-a-{uuid.uuid4().hex}", f"key-b-{uuid.uuid4().hex}"
    keyed = dataclasses.replace(target, keys=api_keys.parse(f"{key_a}\n", "the test's file"))
    log = Lines()
    deploy(client, keyed, build("a"), log=log)
    http, metrics = keyed.endpoint["http"], keyed.endpoint["metrics"]
    with_a, with_b = {"Authorization": f"Bearer {key_a}"}, {"Authorization": f"Bearer {key_b}"}

    for headers in ({}, with_b, {"Authorization": key_a}, {"Authorization": f"Basic {key_a}"}):
        code, body = _http(f"{http}/v2/models/ensemble/generate", "POST", headers=headers)
        assert code == 401 and json.loads(body)["error"].startswith("an API key is required"), (headers, body)
        code, body = _http(f"{http}/v1/models", headers=headers)
        assert code == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body  # OpenAI's shape
        assert _http(metrics, headers=headers)[0] == 401
        assert _http(f"{http}/v2/repository/index", "POST", headers=headers)[0] == 401  # before the route check
    assert _http(f"{http}/v2/health/ready")[0] == 200 and _http(f"{http}/v2/health/live")[0] == 200  # open
    assert generate(http, headers=with_a).startswith("a")
    assert _http(metrics, headers=with_a)[0] == 200
    assert _http(f"{http}/v2/repository/index", "POST", headers=with_a)[0] == 403  # a key opens no admin route

    g = grpcclient.InferenceServerClient(keyed.endpoint["grpc"])
    assert g.is_server_live() and g.is_server_ready()  # health stays open over gRPC too
    for headers in (None, {"authorization": f"Bearer {key_b}"}):
        with pytest.raises(InferenceServerException) as exc:
            g.is_model_ready("ensemble", headers=headers)
        assert exc.value.status() == str(grpc.StatusCode.UNAUTHENTICATED), exc.value
    grpc_a = {"authorization": f"Bearer {key_a}"}
    assert g.is_model_ready("ensemble", headers=grpc_a) and g.get_model_metadata("ensemble", headers=grpc_a)
    with pytest.raises(InferenceServerException) as exc:
        g.unload_model("ensemble", headers=grpc_a)
    assert exc.value.status() == str(grpc.StatusCode.PERMISSION_DENIED), exc.value

    # `stoker bench` against the keyed address: $STOKER_API_KEY goes with every request, HTTP and gRPC.
    from stoker.bench.client import BenchConfig, run_sweep
    from stoker.bench.load import Level
    from stoker.bench.workload import make_prompts

    monkeypatch.setenv("STOKER_API_KEY", key_a)
    for url, protocol in ((http, "http"), (keyed.endpoint["grpc"], "grpc")):
        result = run_sweep(BenchConfig(url=url, model="ensemble", levels=[Level(concurrency=1)], max_tokens=3,
                                       requests_per_level=3, warmup_requests=0, timeout_s=30, protocol=protocol),
                           make_prompts(4, 8, seed=0), count_tokens=lambda text: len(text.split()))
        assert (result.levels[0].completed, result.levels[0].errors) == (3, 0), protocol

    # Rotation: add key b, then drop key a; the running proxy takes each list at once, no restart.
    proxy_id = client.containers.get(engine.proxy_name(keyed.name)).id
    both = dataclasses.replace(target, keys=api_keys.parse(f"{key_a}\n{key_b}\n", "the test's file"))
    promote.reconcile(client, both, log)
    assert any("now accepts the 2 API key(s)" in line for line in log), log
    assert generate(http, headers=with_a).startswith("a") and generate(http, headers=with_b).startswith("a")
    only_b = dataclasses.replace(target, keys=api_keys.parse(f"{key_b}\n", "the test's file"))
    promote.reconcile(client, only_b, log)
    assert _http(f"{http}/v2/models/ensemble/generate", "POST", headers=with_a)[0] == 401
    assert g.is_model_ready("ensemble", headers={"authorization": f"Bearer {key_b}"})
    assert client.containers.get(engine.proxy_name(keyed.name)).id == proxy_id
    # A restarted proxy reads the same list from its file.
    _restart_proxy(client, only_b)
    assert generate(http, headers=with_b).startswith("a")
    assert _http(f"{http}/v2/models/ensemble/generate", "POST", headers=with_a)[0] == 401
    g.close()

    # The keys are nowhere: not in a log line, a state file, the proxy's labels, environment or arguments.
    proxy = client.containers.get(engine.proxy_name(keyed.name))
    for key in (key_a, key_b):
        assert not any(key in line for line in log)
        assert key not in json.dumps(proxy.attrs)
        assert not [p for p in target.state_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]

    # Keys off again: the proxy is recreated open (HAProxy reads its checks at start).
    promote.reconcile(client, target, log)
    assert any("recreate the proxy" in line for line in log), log[-5:]
    assert serving_tag(target) == "a"


def test_tls_at_the_proxy_serves_https_and_grpc_over_tls_with_the_key_checked_inside(client, target, build, tmp_path):
    import dataclasses
    import ssl

    import tritonclient.grpc as grpcclient

    from stoker.serving import api_keys

    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key_file), "-out", str(cert)],
                   check=True, capture_output=True)
    key = f"tls-key-{uuid.uuid4().hex}"
    secure = dataclasses.replace(target, keys=api_keys.parse(f"{key}\n", "t"), tls=(cert, key_file))
    deploy(client, secure, build("a"))
    http = secure.endpoint["http"]
    assert http.startswith("https://127.0.0.1:")
    trusted = ssl.create_default_context(cafile=str(cert))
    assert generate(http, headers={"Authorization": f"Bearer {key}"}, context=trusted).startswith("a")
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # cleartext on the TLS port: no HTTP answer
        urllib.request.urlopen(f"http://127.0.0.1:{secure.listen.http}/v2/health/ready", timeout=5)
    g = grpcclient.InferenceServerClient(secure.endpoint["grpc"], ssl=True, root_certificates=str(cert))
    assert g.is_server_live()
    assert g.is_model_ready("ensemble", headers={"authorization": f"Bearer {key}"})
    g.close()
    # The proxy's copy of the private key stays in its own folder, readable by its owner only.
    pem = target.state_dir / "tls.pem"
    assert pem.stat().st_mode & 0o077 == 0 and "PRIVATE KEY" in pem.read_text()
    assert client.containers.get(engine.proxy_name(target.name)).labels[engine.LABEL_FRONT].startswith("keys,tls:")
