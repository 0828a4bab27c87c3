"""The OpenAI API at a deployment's stable address, on the real Docker engine, HAProxy, Triton and S3 (moto).

Two builds of a tiny Llama, identical but for a chat template in the second, are promoted one after the
other behind one proxy. The official `openai` client talks to the stable HTTP port only: /v1/ reaches the
deployment's OpenAI service container, everything else still reaches Triton. After the switch the
service answers with the new build's tokenizer (its chat template, its fingerprint) without a restart.
The deployment asks for an API key (deploy.api_keys) and serves TLS (deploy.tls): the client's key goes through
the service to the proxy's gRPC frontend, which checks it again (the service holds no key of its own), over a unix
socket in the service's folder, so the service needs no TLS of its own.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import httpx
import pytest

from stoker.containers import engine
from stoker.serving import api_keys, haproxy, promote

from promotion_kit import listen_ports, new_bucket
from serving_models import publish

pytestmark = [pytest.mark.docker, pytest.mark.s3, pytest.mark.slow]
openai = pytest.importorskip("openai")
pytest.importorskip("torch")
TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
KEY = f"test-key-{uuid.uuid4().hex}"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _repos(tmp_path):
    """The real reference build of a tiny Llama as a Triton repository, and a copy with a chat template."""
    from stoker.triton.config import RepoSettings
    from stoker.triton.repository import assemble
    from stoker.workers import build_reference
    from stoker.workers.tinymodel import make_tiny_model

    ckpt, artifact, a = tmp_path / "ckpt", tmp_path / "artifact", tmp_path / "repo-a"
    make_tiny_model(ckpt, seed=0)
    build_reference.build(ckpt, artifact)
    assemble(artifact, a, RepoSettings(model_threads=1))
    (a / "ensemble" / "1" / ".keep").write_text("")  # S3 has no empty folders; Triton needs this one
    b = tmp_path / "repo-b"
    shutil.copytree(a, b)
    (b / "tensorrt_llm" / "1" / "weights" / "chat_template.jinja").write_text(TEMPLATE)
    return a, b, artifact


def _wait_models(base: str, context: ssl.SSLContext, timeout_s: float = 60) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{base}/models", headers=AUTH), timeout=5,
                                        context=context) as r:
                return json.loads(r.read())["data"]
        except (urllib.error.URLError, OSError):
            assert time.monotonic() < deadline, f"{base}/models never answered"
            time.sleep(0.5)


def _certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)], check=True,
                   capture_output=True)
    return cert, key


def test_openai_api_on_the_stable_address_follows_a_switch(local_stack, triton_image, tmp_path):
    from tokenizers import Tokenizer

    image = triton_image
    client = engine.connect(None)
    s3, bucket, env = new_bucket(local_stack, "oa")
    repo_a, repo_b, artifact = _repos(tmp_path)
    listen = listen_ports()
    target = promote.Target(name=f"oa{uuid.uuid4().hex[:6]}", listen=listen, proxy_image="stoker/haproxy:2.6",
                            state_dir=tmp_path / "proxy", openai_image=image,
                            keys=api_keys.parse(f"{KEY}\n", "the test's key"), tls=_certificate(tmp_path))
    trusted = ssl.create_default_context(cafile=str(target.tls[0]))
    log = print

    def deploy(repo):
        uri, digest = publish(s3, bucket, local_stack["s3"], repo)
        spec = engine.BackendSpec(name=target.name, image=image, repository_uri=uri, repo_digest=digest, env=env,
                                  ready_timeout_s=120)
        staged = promote.prepare(client, target, spec, 0.5, log)
        promote.go_live(client, target, staged, watch_s=0.5, max_error_rate_pct=100, drain_timeout_s=5, log=log)
        return digest

    try:
        digest_a = deploy(repo_a)
        base = target.endpoint["openai"]
        assert base == f"https://127.0.0.1:{listen.http}/v1"
        assert [m["id"] for m in _wait_models(base, trusted)] == [target.name]
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=base, api_key="not-the-key-at-all", max_retries=0,
                          http_client=httpx.Client(verify=trusted)).models.list()
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        api = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=60,
                            http_client=httpx.Client(verify=trusted))
        tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))

        out = api.chat.completions.create(model=target.name, messages=MESSAGES, max_tokens=6, temperature=0)
        assert out.system_fingerprint == f"fp_{digest_a[:12]}"
        assert out.usage.prompt_tokens == len(tok.encode("user: Name a colour.\nassistant:").ids)  # fallback template
        chunks = list(api.completions.create(model=target.name, prompt="Hello", max_tokens=5, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens == len(tok.encode("Hello").ids)
        assert chunks[-1].usage.completion_tokens >= 1
        # Issue 50 item 5: structured output and log probs through the stable address, over TLS, with the key.
        shaped = api.chat.completions.create(
            model=target.name, messages=MESSAGES, max_tokens=48, temperature=0, logprobs=True, top_logprobs=2,
            response_format={"type": "json_schema", "json_schema": {"name": "colour", "strict": True, "schema": {
                "type": "object", "properties": {"c": {"type": "string", "maxLength": 4}}, "required": ["c"]}}})
        choice = shaped.choices[0]
        assert choice.finish_reason == "stop" and set(json.loads(choice.message.content)) == {"c"}, shaped
        assert len(choice.logprobs.content) == shaped.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
        with pytest.raises(openai.NotFoundError):
            api.chat.completions.create(model="gpt-4o", messages=MESSAGES)
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model=target.name, messages=MESSAGES, n=9)  # above 8 (MAX_CHOICES)
        # The same port still serves Triton's own API.
        req = urllib.request.Request(f"{target.endpoint['http']}/v2/models/ensemble/generate_stream",
                                     data=json.dumps({"text_input": "Hi", "max_tokens": 2}).encode(), headers=AUTH)
        with urllib.request.urlopen(req, timeout=30, context=trusted) as r:
            assert b"text_output" in r.read()

        # The process that parses public requests cannot reach the proxy's admin socket: its container mounts its
        # own folder only, where the proxy's container sees the whole state folder, socket included.
        service = promote.openai_service.container(client, target.name)
        proxy = client.containers.get(engine.proxy_name(target.name))
        assert [m["Source"] for m in service.attrs["Mounts"]] == [str(target.state_dir / "openai")]
        assert [m["Source"] for m in proxy.attrs["Mounts"]] == [str(target.state_dir)]
        # It reaches Triton through the proxy's gRPC frontend on a socket in its own folder (no TCP, no TLS).
        assert f"unix:{promote.openai_service.grpc_socket_path()}" in service.attrs["Args"]
        admin = f"{haproxy.MOUNT}/{haproxy.SOCKET_NAME}"
        assert proxy.exec_run(["test", "-S", admin]).exit_code == 0
        seen = service.exec_run(["/opt/venv/bin/python", "-c", f"import os; print(os.path.exists({admin!r}))"])
        assert seen.output.decode().strip() == "False", seen.output
        # The key itself is nowhere: not in a container's environment, labels or arguments, nor in a state file.
        assert KEY not in json.dumps(service.attrs) and KEY not in json.dumps(proxy.attrs)
        assert not [p for p in target.state_dir.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
        # Access logs (docker logs, rotated by Docker): a line per request from the proxy and from the service
        # (method, path, status, ms), never the key (h3, issue 49 item 7b).
        served, proxied = service.logs().decode(), proxy.logs().decode()
        assert "POST /v1/chat/completions 200 " in served and "POST /v1/completions 200 " in served, served[-1500:]
        assert '"POST /v1/chat/completions HTTP/1.1"' in proxied, proxied[-1500:]
        assert KEY not in served and KEY not in proxied
        assert service.attrs["HostConfig"]["LogConfig"] == proxy.attrs["HostConfig"]["LogConfig"] == engine.LOG_CONFIG

        # Blue/green: the switch moves the service onto the new build's tokenizer, no restart.
        digest_b = deploy(repo_b)
        out = api.chat.completions.create(model=target.name, messages=MESSAGES, max_tokens=6, temperature=0)
        assert out.system_fingerprint == f"fp_{digest_b[:12]}"
        templated = tok.encode("<s>[user] Name a colour.\n[assistant]", add_special_tokens=False).ids
        assert out.usage.prompt_tokens == len(templated)
        assert promote.openai_service.container(client, target.name).id == service.id

        # The service gone: the proxy answers /v1/ in OpenAI's error shape; the next reconcile brings it back.
        service.stop(timeout=5)
        with pytest.raises(openai.InternalServerError) as err:
            api.models.list()
        assert err.value.status_code == 503 and err.value.body["code"] == "backend_unavailable"
        promote.reconcile(client, target, log)
        assert [m["id"] for m in _wait_models(base, trusted)] == [target.name]
        assert api.chat.completions.create(model=target.name, messages=MESSAGES, max_tokens=2,
                                           temperature=0).system_fingerprint == f"fp_{digest_b[:12]}"
    finally:
        engine.remove_deployment(client, target.name, lambda _l: None)
