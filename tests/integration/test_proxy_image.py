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


# ------------------------------------------------------------------ what the proxy handover relies on (issue 49)


def test_a_config_haproxy_refuses_is_named_in_one_line_before_any_proxy_starts(built, tmp_path):
    from stoker.serving import promote

    (tmp_path / "haproxy.cfg").write_text(CONFIG.replace("    bind 127.0.0.1:1", "    bind 127.0.0.1:1 no-such-option"))
    with pytest.raises(promote.ProxyRefused) as exc:
        promote.check_config(docker.from_env(), DEFAULT_PROXY_IMAGE, tmp_path)
    message = str(exc.value)
    assert "\n" not in message and "no-such-option" in message and "[ALERT]" not in message, message
    (tmp_path / "haproxy.cfg").write_text(CONFIG)
    promote.check_config(docker.from_env(), DEFAULT_PROXY_IMAGE, tmp_path)  # valid: no error


def test_the_rendered_config_with_checks_logs_keys_and_replicas_is_valid(built, tmp_path):
    from stoker.containers.ports import Ports
    from stoker.serving import haproxy, promote

    layout = haproxy.ProxyLayout(Ports(18500, 18501, 18502), {"blue": [Ports(20000, 20001, 20002),
                                                                      Ports(20003, 20004, 20005)]}, "blue",
                                 keys="/stoker/keys", replicas=2, openai="/stoker/openai/api.sock",
                                 openai_grpc="/stoker/openai/grpc.sock")
    (tmp_path / "haproxy.cfg").write_text(haproxy.render(layout))
    (tmp_path / "keys").write_text("")
    promote.check_config(docker.from_env(), DEFAULT_PROXY_IMAGE, tmp_path)


def test_two_proxies_share_a_port_unless_noreuseport(built, tmp_path):
    """HAProxy 2.6 binds with SO_REUSEPORT by default on Linux (`noreuseport` turns it off): the handover starts the
    new proxy on the old one's ports before the old one goes."""
    import time

    client = docker.from_env()
    port = 18510
    config = CONFIG.replace("master-worker", "stats timeout 5s").replace("127.0.0.1:1", f"127.0.0.1:{port}")
    (tmp_path / "haproxy.cfg").write_text(config)
    (tmp_path / "noreuse.cfg").write_text(config.replace("global\n", "global\n    noreuseport\n"))
    started = []
    try:
        for name in ("haproxy.cfg", "haproxy.cfg", "noreuse.cfg"):
            started.append(client.containers.run(DEFAULT_PROXY_IMAGE, ["-db", "-f", f"/stoker/{name}"],
                                                 entrypoint="haproxy", detach=True, network_mode="host",
                                                 volumes={str(tmp_path): {"bind": "/stoker", "mode": "ro"}}))
            time.sleep(1.0)
        for c in started:
            c.reload()
        assert [c.status for c in started[:2]] == ["running", "running"]
        assert started[2].status == "exited" and "cannot bind socket" in started[2].logs().decode()
    finally:
        for c in started:
            c.remove(force=True)
