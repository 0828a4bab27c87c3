"""The stable endpoint's bounds as rendered (stoker/serving/edge.py) and as the spec declares them (deploy.limits).
The real HAProxy holds them in tests/integration/test_edge_limits.py."""

from __future__ import annotations

import json

import pytest

from stoker.containers.ports import Ports
from stoker.errors import StokerError
from stoker.serving import edge, haproxy
from stoker.serving.deployment import Target
from stoker.spec.load import parse_spec

LISTEN = Ports(8000, 8001, 8002)
BLUE = Ports(20000, 20001, 20002)
LIMITS = edge.EdgeLimits(max_body_bytes=65536, request_timeout_s=7, max_connections=500,
                         max_connections_per_client=20, max_requests_per_client_per_s=3)


def _block(cfg: str, header: str) -> list[str]:
    start = cfg.index(f"\n{header}\n") + 1
    end = cfg.find("\n\n", start)
    return cfg[start:end].splitlines()[1:]


def _render(limits: edge.EdgeLimits = LIMITS, **layout) -> str:
    return haproxy.render(haproxy.ProxyLayout(LISTEN, {"blue": BLUE}, "blue", limits=limits, **layout))


def test_buffers_timeout_and_connections_in_all():
    cfg = _render(openai="/stoker/openai/api.sock")
    assert _block(cfg, "global")[2:6] == ["    maxconn 500", "    tune.bufsize 16384", "    tune.maxrewrite 1024",
                                          "    tune.http.maxhdr 101"]
    defaults = _block(cfg, "defaults")
    assert "    timeout http-request 7s" in defaults
    # Long generations and gRPC channels are not bound by the request timeout.
    assert f"    timeout client {haproxy.STREAM_TIMEOUT}" in defaults and "    timeout tunnel 1h" in defaults
    assert _block(cfg, f"backend {edge.TABLE}") == [
        "    stick-table type ipv6 size 100k expire 60s store conn_cur,http_req_rate(10s)"]
    for section in ("http", "grpc", "metrics"):
        front = _block(cfg, f"frontend {section}")
        assert front[front.index("    maxconn 500") + 1:][:2] == [
            f"    tcp-request connection track-sc0 src table {edge.TABLE}",
            "    tcp-request connection reject if { sc0_conn_cur gt 20 }"], section


def test_http_routes_answer_413_and_429_in_their_shape_before_keys_and_routes():
    cfg = _render(openai="/stoker/openai/api.sock", keys="/stoker/keys")
    front = _block(cfg, "frontend http")
    rules = [ln for ln in front if " status 413 " in ln or " status 429 " in ln]
    assert len(rules) == 4 and front.index(rules[-1]) < min(i for i, ln in enumerate(front) if "status 401" in ln)
    v1_rate, v1_body, rate, body = rules
    assert v1_rate.endswith(" if openai { sc0_http_req_rate gt 30 }") and " hdr retry-after 1 " in v1_rate
    assert rate.endswith(" if { sc0_http_req_rate gt 30 }") and " hdr retry-after 1 " in rate
    assert v1_body.endswith(" if openai { req.hdr_val(content-length) gt 65536 }")
    assert body.endswith(" if { req.hdr_val(content-length) gt 65536 }")

    def payload(line: str) -> dict:
        quoted = line.split(" string ", 1)[1].rsplit(" if ", 1)[0]
        return json.loads(json.loads(quoted))

    assert payload(v1_rate)["error"]["code"] == "rate_limit_exceeded"
    assert payload(v1_body)["error"] == {"message": "the request body is over 65536 bytes, the most this endpoint "
                                         "accepts", "type": "invalid_request_error", "param": None,
                                         "code": "request_too_large"}
    assert payload(rate) == {"error": "over 3 requests a second from this client (averaged over 10 s); retry after 1 s"}
    assert payload(body) == {"error": "the request body is over 65536 bytes, the most this endpoint accepts"}


def test_bodies_wait_whole_in_the_proxy_on_http_routes_never_on_grpc():
    cfg = _render(openai="/stoker/openai/api.sock")
    for name, shape in (("http", str), ("metrics", str), (haproxy.OPENAI_BACKEND, dict)):
        backend = _block(cfg, f"backend {name}")
        assert backend[0] == "    option http-buffer-request", name
        assert backend[1].startswith("    http-error status 408 content-type application/json string ")
        message = json.loads(json.loads(backend[1].split(" string ", 1)[1]))["error"]
        assert isinstance(message, shape) and "within 7 s" in str(message), name
        assert backend[2].endswith(" if { req.body_size gt 65536 }"), name
    grpc_front, grpc_back = _block(cfg, "frontend grpc"), _block(cfg, "backend grpc")
    assert not any("http-buffer-request" in ln or "body_size" in ln or "content-length" in ln
                   for ln in grpc_front + grpc_back)
    # Over the rate, a gRPC call ends RESOURCE_EXHAUSTED, trailers-only.
    assert any(ln.startswith("    http-request return status 200 hdr grpc-status 8 ")
               and ln.endswith(" if { sc0_http_req_rate gt 30 }") for ln in grpc_front)


def test_no_rate_rule_when_the_rate_is_unbounded_and_defaults_render_as_documented():
    cfg = _render(edge.EdgeLimits())
    assert "sc0_http_req_rate gt" not in cfg and "grpc-status 8" not in cfg
    assert "    maxconn 4096\n" in cfg and "    timeout http-request 30s\n" in cfg
    assert "{ sc0_conn_cur gt 1024 }" in cfg and "gt 16777216 }" in cfg


BASE = {"model": {"repo_id": "a/b"}, "storage": {"bucket": "abc"}}


@pytest.mark.parametrize("limits, cause", [
    ({"max_body_bytes": 10}, "deploy.limits.max_body_bytes: Input should be greater than or equal to 1024"),
    ({"max_connections": 100000}, "deploy.limits.max_connections: Input should be less than or equal to 8192"),
    ({"max_connections_per_client": 5000}, "deploy.limits: max_connections_per_client 5000 is over "
                                           "max_connections 4096"),
    ({"max_requests_per_client_per_s": -1}, "deploy.limits.max_requests_per_client_per_s: Input should be greater"),
    ({"request_timeout": 5}, "deploy.limits.request_timeout: unknown key"),
])
def test_bad_limits_are_refused_at_spec_load_in_one_line(limits, cause):
    with pytest.raises(StokerError) as exc:
        parse_spec({**BASE, "deploy": {"limits": limits}})
    assert cause in str(exc.value) and "\n" not in str(exc.value), exc.value


def test_limits_reach_the_target_and_a_change_recreates_the_proxy():
    from stoker.deploy.rollout import target_for

    default = parse_spec(BASE)
    assert "limits" not in default.model_dump()["deploy"]  # earlier specs' digests are unchanged
    assert target_for(default).limits == edge.EdgeLimits() and "limits" not in target_for(default).front
    bounded = target_for(parse_spec({**BASE, "deploy": {"limits": {"max_requests_per_client_per_s": 5}}}))
    assert bounded.limits == edge.EdgeLimits(max_requests_per_client_per_s=5)
    other = target_for(parse_spec({**BASE, "deploy": {"limits": {"max_requests_per_client_per_s": 6}}}))
    assert "limits:" in bounded.front and bounded.front != other.front
    assert isinstance(bounded, Target)
