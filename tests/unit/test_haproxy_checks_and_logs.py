"""The proxy's health checks and access log as rendered, the handover's one-line cause, and the OpenAI service's
access line. The real HAProxy runs them in tests/integration (test_replicas, test_endpoint_boundary,
test_proxy_image)."""

from __future__ import annotations

import asyncio
import logging

from stoker.containers.ports import Ports
from stoker.openai_api.access_log import AccessLog
from stoker.serving import haproxy, promote

LISTEN = Ports(8000, 8001, 8002)
BLUE = [Ports(20000, 20001, 20002), Ports(20003, 20004, 20005)]


def _section(cfg: str, name: str) -> str:
    start = cfg.index(f"\nbackend {name}\n") + 1
    end = cfg.find("\n\n", start)
    return cfg[start:end if end > 0 else len(cfg)]


def test_every_backend_server_is_checked_on_its_backends_http_port():
    cfg = haproxy.render(haproxy.ProxyLayout(LISTEN, {"blue": BLUE}, "blue", replicas=2, keys="/stoker/k",
                                             openai="/stoker/openai/api.sock"))
    for name in ("http", "grpc", "metrics"):
        backend = _section(cfg, name)
        assert "    option httpchk\n" in backend
        assert f"http-check send meth GET uri {haproxy.HEALTH_URI} " in backend
        assert "    http-check expect status 200" in backend and " fall 3 rise 2" in backend
        servers = [ln for ln in backend.splitlines() if ln.strip().startswith("server ")]
        assert len(servers) == 4 and all(" check port " in ln for ln in servers), servers
    # gRPC's servers speak h2; their check goes to the paired HTTP port in HTTP/1.
    assert "server blue_1 127.0.0.1:20004 proto h2 check port 20003 check-proto h1\n" in cfg
    assert "server blue_1 127.0.0.1:20005 check port 20003\n" in cfg
    # The OpenAI service is not Triton: no readiness check on its socket.
    assert _section(cfg, "openai").count(" check") == 0


def test_a_switch_moves_each_servers_check_with_it_and_maint_stays_unchecked():
    cmds = haproxy.switch_commands("green", BLUE, drain="blue", replicas=2).split("; ")
    for section in ("http", "grpc", "metrics"):
        i = cmds.index(f"set server {section}/green_1 check-port 20003")
        assert cmds[i - 1].startswith(f"set server {section}/green_1 addr 127.0.0.1 port ")
        assert cmds[i + 1] == f"set server {section}/green_1 state ready"  # checked at its new port once ready
    assert not any("check-port" in c for c in haproxy.maint_commands("blue", 2).split("; "))


def test_the_access_log_goes_to_stdout_and_captures_no_header():
    cfg = haproxy.render(haproxy.ProxyLayout(LISTEN, {"blue": BLUE[0]}, "blue", keys="/stoker/k", tls="/stoker/t"))
    assert "    log stdout format raw local0\n" in cfg and "    option httplog\n" in cfg and "    log global\n" in cfg
    lowered = cfg.lower()
    # httplog logs a header only where `capture` asks; nothing asks, and no custom format names one.
    assert "capture" not in lowered and "log-format" not in lowered and "%hr" not in lowered


def test_haproxy_first_alert_is_the_one_line_cause():
    out = ("[NOTICE]   (6) : haproxy version is 2.6.12\n"
           "[ALERT]    (6) : Binding [/stoker/haproxy.cfg:14] for frontend http: cannot bind socket (Cannot assign "
           "requested address) for [192.0.2.1:8000]\n"
           "[ALERT]    (6) : [haproxy.main()] Some protocols failed to start their listeners! Exiting.\n")
    assert promote.first_error(out) == ("Binding [/stoker/haproxy.cfg:14] for frontend http: cannot bind socket "
                                        "(Cannot assign requested address) for [192.0.2.1:8000]")
    assert promote.first_error("only this\n") == "only this" and promote.first_error("") == "no output"


def test_show_stat_status_per_server():
    csv = ("# pxname,svname,qcur,status,x\nhttp,FRONTEND,,OPEN,\nhttp,blue,0,UP,\nhttp,blue_1,0,DOWN,\n"
           "grpc,green,0,MAINT,\nhttp,BACKEND,0,UP,\n")
    assert haproxy.parse_stat_status(csv) == {("http", "blue"): "UP", ("http", "blue_1"): "DOWN",
                                              ("grpc", "green"): "MAINT"}


def test_the_openai_service_logs_method_path_status_and_ms_never_a_header_or_query(caplog):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"secret answer", "more_body": False})

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"k=query-secret",
             "headers": [(b"authorization", b"Bearer key-secret")]}
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"prompt-secret", "more_body": False}

    with caplog.at_level(logging.INFO, logger="stoker_openai.access"):
        asyncio.run(AccessLog(app)(scope, receive, send))
    [line] = [r.getMessage() for r in caplog.records if r.name == "stoker_openai.access"]
    assert line.startswith("POST /v1/chat/completions 201 ") and line.endswith(" ms"), line
    assert not any(word in line for word in ("secret", "Bearer", "k=")), line
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]  # answered unchanged


def test_a_soft_stopped_proxy_answers_the_next_request_on_an_idle_connection_before_closing_it():
    # The handover's old proxy: idle keep-alive connections are not cut under a client's next write.
    cfg = haproxy.render(haproxy.ProxyLayout(LISTEN, {"blue": BLUE[0]}, "blue"))
    defaults = cfg.split("defaults\n", 1)[1].split("\n\n", 1)[0]
    assert "    option idle-close-on-response" in defaults.splitlines()
