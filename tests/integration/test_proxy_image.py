"""The HAProxy image (infra/proxy) on a real Docker engine: built from the CPU Triton image, without a registry."""

from __future__ import annotations

import docker
import pytest

from stoker.stack.image import BASE_LABEL, DEFAULT_IMAGE, DEFAULT_PROXY_IMAGE, RECIPE_LABEL, ensure_proxy_image, \
    proxy_recipe_digest

pytestmark = [pytest.mark.docker]

CONFIG = """\
global
    master-worker
defaults
    mode http
    timeout connect 1s
    timeout client 10s
    timeout server 10s
frontend http
    bind 127.0.0.1:1
    default_backend triton
backend triton
    server live 127.0.0.1:2
"""


@pytest.fixture(scope="module")
def built():
    logs: list[str] = []
    image_id = ensure_proxy_image(DEFAULT_PROXY_IMAGE, None, logs.append)
    return image_id, logs


def _run(client, entrypoint: str, command: list[str], **kwargs) -> str:
    out = client.containers.run(DEFAULT_PROXY_IMAGE, command, entrypoint=entrypoint, remove=True, stderr=True,
                                **kwargs)
    return out.decode()


def test_image_exists_labelled_with_its_recipe_and_base(built):
    image_id, _ = built
    client = docker.from_env()
    image = client.images.get(DEFAULT_PROXY_IMAGE)
    base = client.images.get(DEFAULT_IMAGE)
    assert image.id == image_id
    assert image.labels[BASE_LABEL] == base.id
    assert image.labels[RECIPE_LABEL] == proxy_recipe_digest(base.id)


def test_haproxy_26_and_python3_are_on_path(built):
    client = docker.from_env()
    assert _run(client, "haproxy", ["-v"]).startswith("HAProxy version 2.6.")
    assert _run(client, "python3", ["-c", "import sys; print(sys.version_info[:2])"]).strip() == "(3, 11)"


def test_the_run_mode_stoker_uses_accepts_a_bind_mounted_config(built, tmp_path):
    (tmp_path / "haproxy.cfg").write_text(CONFIG)
    out = _run(docker.from_env(), "haproxy", ["-W", "-c", "-f", "/stoker/haproxy.cfg"], network_mode="host",
               volumes={str(tmp_path): {"bind": "/stoker", "mode": "ro"}})
    assert "Configuration file is valid" in out


def test_a_second_ensure_does_not_rebuild(built):
    image_id, _ = built
    logs: list[str] = []
    assert ensure_proxy_image(DEFAULT_PROXY_IMAGE, None, logs.append) == image_id
    assert any(line == f"image {DEFAULT_PROXY_IMAGE} is up to date (recipe " + line.rsplit("recipe ", 1)[1]
               for line in logs), logs
    assert not any("docker build" in line for line in logs), logs
