"""The stable endpoint's boundary (issue 25), on the real Docker engine, HAProxy, Triton and S3 (moto): only inference,
health and metadata are public, backends listen on loopback, API keys guard every route but health and rotate
without a restart, TLS at the proxy.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from stoker.containers import engine
from stoker.serving import promote
from stoker.containers.ports import Ports

from promotion_kit import Lines, Load, backends, deploy, generate, listen_ports, serving_tag, restart_proxy
from promotion_kit import build, client, images, s3, target  # noqa: F401 -- fixtures the tests request

pytestmark = [pytest.mark.docker, pytest.mark.s3]


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
    # The ensemble's internal steps (not decoupled: a huge declared shape on /infer killed Triton 2.51) are refused.
    huge = json.dumps({"inputs": [{"name": "QUERY", "shape": [2 ** 62, 1], "datatype": "BYTES", "data": ["x"]}]})
    for path in ("/v2/models/preprocessing/infer", "/v2/models/postprocessing/versions/1/infer"):
        code, body = _http(f"{http}{path}", "POST", huge.encode(), {"Content-Type": "application/json"})
        assert code == 403 and "internal step of the ensemble" in json.loads(body)["error"], (path, code, body)
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


# ------------------------------------------------------------------ the admin token on no command line (issue 51)


def _processes(container) -> dict[int, tuple[bytes, bytes]]:
    """Host pid -> (cmdline, environ) of every process of ``container`` (docker top: the host's pids), as this
    host's root reads them in /proc; a process that ended in between is skipped."""
    top = container.top()
    column = top["Titles"].index("PID")
    out = {}
    for row in top["Processes"]:
        pid = int(row[column])
        try:
            out[pid] = (Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/environ").read_bytes())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def test_no_process_of_a_backend_shows_its_admin_token_on_its_command_line(client, target, build):
    """Any local user reads every process's /proc/PID/cmdline: a backend's tritonserver, its python stubs and
    Docker's init carry only the placeholder there, while Triton still guards its admin APIs with the token that
    stoker's reload path reads back (the argv_secret shim puts it into tritonserver's argv in memory)."""
    from stoker.containers import argv_secret

    deploy(client, target, build("a"))
    backend = backends(client, target.name)[0]
    token = engine.admin_headers(backend)[engine.ADMIN_HEADER]
    assert len(token) == 32
    processes = _processes(backend)
    program = {pid: os.path.basename(cmdline.split(b"\0")[0]) for pid, (cmdline, _) in processes.items()}
    servers = [pid for pid, name in program.items() if name == b"tritonserver"]
    stubs = [pid for pid, name in program.items() if name == b"triton_python_backend_stub"]
    assert len(servers) == 1 and stubs and b"docker-init" in program.values(), program
    leaked = [pid for pid, (cmdline, _) in processes.items() if token.encode() in cmdline]
    assert not leaked, f"the admin token is on the command line of {len(leaked)} of {len(processes)} processes"
    assert argv_secret.PLACEHOLDER.encode() in processes[servers[0]][0]
    # The shim wiped the value from tritonserver's environment block, and its children never had it; only
    # Docker's init (root's to read) and the container's Config.Env keep it.
    assert not [pid for pid, (_, environ) in processes.items() if token.encode() in environ
                and program[pid] != b"docker-init"], program
    own = Ports.parse(backend.labels[engine.LABEL_PORTS])
    assert _http(f"http://127.0.0.1:{own.http}/v2/repository/index", "POST")[0] == 403
    assert _http(f"http://127.0.0.1:{own.http}/v2/repository/index", "POST",
                 headers={engine.ADMIN_HEADER: argv_secret.PLACEHOLDER})[0] == 403
    code, body = _http(f"http://127.0.0.1:{own.http}/v2/repository/index", "POST",
                       headers=engine.admin_headers(backend))
    assert code == 200 and any(m["name"] == "ensemble" for m in json.loads(body)), (code, body[:200])


def test_a_tritonserver_whose_shim_did_not_load_is_refused_before_it_serves(client, images, tmp_path):
    """Without the shim (an image whose loader cannot load it only warns), tritonserver takes the placeholder
    itself as its key, which anyone can send: the staging probe refuses such a backend; a shimmed one passes."""
    from stoker.containers import argv_secret
    from stoker.serving import probe

    http = listen_ports().http
    name = f"stoker-noshim-{uuid.uuid4().hex[:8]}"
    c = client.containers.run(images[0], ["--model-repository=/tmp", "--http-address=127.0.0.1",
                                          f"--http-port={http}", "--allow-grpc=false", "--allow-metrics=false",
                                          engine.restricted_args()[0]],
                              name=name, detach=True, network_mode="host")
    try:
        probe.wait_ready(f"http://127.0.0.1:{http}/v2/health/live", 60, exit_reason=lambda: engine.exit_reason(c))
        with pytest.raises(probe.ProbeFailed, match="argv_secret shim did not load"):
            probe.admin_closed(f"http://127.0.0.1:{http}", engine.placeholder_header())
    finally:
        c.remove(force=True)
    assert argv_secret.PLACEHOLDER in engine.restricted_args()[0]


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

    # A recreate whose new proxy cannot start (an address this host lacks: preflight refuses it, reconcile is called
    # directly here to reach what preflight cannot see): the running proxy serves throughout and stays, one line
    # names HAProxy's error.
    old_proxy = client.containers.get(engine.proxy_name(target.name)).id
    with Load(target.endpoint) as load:
        time.sleep(1.0)
        with pytest.raises(promote.ProxyRefused) as refused:
            promote.reconcile(client, dataclasses.replace(target, address="192.0.2.1"), Lines())
        time.sleep(1.0)
    assert "\n" not in str(refused.value) and "192.0.2.1" in str(refused.value), refused.value
    assert "cannot bind socket" in str(refused.value) and "keeps serving" in str(refused.value), refused.value
    assert load.failures == [] and load.ok["http"] > 0 and load.ok["grpc"] > 0, (load.failures[:3], load.ok)
    assert [c.id for c in engine.containers(client, target.name, role=engine.ROLE_PROXY)] == [old_proxy]
    log = Lines()
    assert promote.reconcile(client, target, log) and not log, log  # its runtime API and files are its own again

    # deploy.listen 0.0.0.0 (allowed by the spec in as many words): the proxy is recreated on every interface, the
    # new one beside the old one before the old one goes; the backend it routes to still answers on loopback only.
    opened = dataclasses.replace(target, address="0.0.0.0")
    log = Lines()
    with Load(target.endpoint) as load:
        time.sleep(1.0)
        live = promote.reconcile(client, opened, log)
        time.sleep(1.0)
    assert any("recreate" in line for line in log) and any("the new proxy serves" in line for line in log), log
    print(next(line for line in log if "the new proxy serves" in line), f"; answered {load.ok} meanwhile")
    assert load.failures == [] and load.ok["http"] > 0 and load.ok["grpc"] > 0, (load.failures[:3], load.ok)
    proxies = engine.containers(client, target.name, role=engine.ROLE_PROXY)
    assert [c.name for c in proxies] == [engine.proxy_name(target.name)] and proxies[0].id != old_proxy
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
    restart_proxy(client, only_b)
    assert generate(http, headers=with_b).startswith("a")
    assert _http(f"{http}/v2/models/ensemble/generate", "POST", headers=with_a)[0] == 401
    g.close()

    # The keys are nowhere: not in a log line, a state file, the proxy's labels, environment or arguments.
    proxy = client.containers.get(engine.proxy_name(keyed.name))
    for key in (key_a, key_b):
        assert not any(key in line for line in log)
        assert key not in json.dumps(proxy.attrs)
        assert not [p for p in target.state_dir.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]

    # The proxy's access log (docker logs): a line per request, status and path, never the key.
    access = proxy.logs().decode()
    assert " 401 " in access and " 200 " in access and "/v2/models/ensemble/generate" in access, access[-2000:]
    assert key_a not in access and key_b not in access and "earer" not in access

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

    # A certificate file that also holds another private key: OpenSSL loads the pair (preflight passes), HAProxy
    # takes the PEM's first key and refuses it. The recreate stops at `haproxy -c`, before anything is touched: the
    # running proxy serves on with its certificate, and one line names HAProxy's error.
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True)
    bundled = tmp_path / "bundled.pem"
    bundled.write_text(cert.read_text() + other.read_text())
    proxy_id, before = client.containers.get(engine.proxy_name(target.name)).id, pem.read_bytes()
    with pytest.raises(promote.ProxyRefused) as refused:
        promote.reconcile(client, dataclasses.replace(secure, tls=(bundled, key_file)), Lines())
    message = str(refused.value)
    assert "\n" not in message and "inconsistencies between private key and certificate" in message, message
    assert "keeps serving" in message and "PRIVATE KEY" not in message
    assert client.containers.get(engine.proxy_name(target.name)).id == proxy_id and pem.read_bytes() == before
    assert generate(http, headers={"Authorization": f"Bearer {key}"}, context=trusted).startswith("a")
    assert not list(target.state_dir.glob(".proxy-check-*"))  # the trial folder (a key's copy) is gone
