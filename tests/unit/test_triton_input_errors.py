"""The proxy's rules that answer Triton's client-input parse errors 400 (issue 51), as rendered; the real HAProxy and
Triton run them in tests/integration/test_fuzz_triton.py."""

from __future__ import annotations

import json
import re

from benchmarks.fuzz_surfaces import triton as surface
from stoker.containers.ports import Ports
from stoker.serving import haproxy

LISTEN = Ports(8000, 8001, 8002)
BLUE = Ports(20000, 20001, 20002)


def _section(cfg: str, name: str) -> str:
    start = cfg.index(f"\n{name}\n") + 1
    end = cfg.find("\n\n", start)
    return cfg[start:end if end > 0 else len(cfg)]


def test_only_the_http_backend_maps_tritons_parse_errors_and_only_on_inference_routes():
    cfg = haproxy.render(haproxy.ProxyLayout(LISTEN, {"blue": BLUE}, "blue", openai="/stoker/openai/api.sock"))
    http = _section(cfg, "backend http").splitlines()
    start = next(i for i, line in enumerate(http) if "acl triton_input" in line)  # after the edge's body bounds
    assert http[start:start + 8] == [
        r"    acl triton_input path_reg ^/v2/models/[^/]+(/versions/[^/]+)?/(infer|generate|generate_stream)$",
        "    http-request set-var(txn.triton_input) bool(true) if triton_input",
        "    http-response wait-for-body time 1s if { var(txn.triton_input) -m bool } { status 500:501 }",
        '    acl triton_parse_error res.body -m beg "{\\"error\\":\\"failed to parse the request JSON buffer: " '
        '"{\\"error\\":\\"Unable to parse " "{\\"error\\":\\"attempt to get members for non-object\\"" '
        '"{\\"error\\":\\"Expected JSON object for keyword: "',
        '    acl triton_route_error res.body -m beg "{\\"error\\":\\"HTTP end point doesn\'t support models with '
        'decoupled transaction policy\\"" "{\\"error\\":\\"Unsupported compression type\\""',
        "    http-response set-header content-type application/json if { var(txn.triton_input) -m bool } "
        "{ status 501 } triton_route_error",
        "    http-response set-status 400 if { var(txn.triton_input) -m bool } { status 500 } triton_parse_error",
        "    http-response set-status 400 if { var(txn.triton_input) -m bool } { status 501 } triton_route_error",
    ]
    for other in ("backend grpc", "backend metrics", "backend openai", "frontend http"):
        assert "triton_" not in _section(cfg, other), other


def test_the_route_pattern_is_the_inference_routes_and_nothing_else():
    route = re.compile(haproxy.TRITON_INPUT_ROUTE)
    for path in ("/v2/models/ensemble/generate", "/v2/models/ensemble/generate_stream", "/v2/models/m/infer",
                 "/v2/models/m/versions/1/infer"):
        assert route.match(path), path
    for path in ("/v2/models/ensemble", "/v2/models/ensemble/config", "/v2/models/m/ready", "/v2/health/ready",
                 "/v2/models/m/infer/x", "/v1/completions"):
        assert not route.match(path), path


def test_the_mapped_prefixes_are_tritons_own_bodies_and_a_models_error_is_not_one_of_them():
    # Bodies Triton 2.51 answered (tests/integration/test_fuzz_triton.py sends their requests): each begins with one
    # of the mapped prefixes. A model's own failure (the test model's "raise" mode) begins with none.
    seen_500 = ['{"error":"Unable to parse JSON bytes array: attempt to access JSON non-string as string"}',
                '{"error":"Unable to parse \'data\': attempt to access JSON non-boolean as boolean"}',
                '{"error":"failed to parse the request JSON buffer: Invalid value. at 0"}',
                '{"error":"attempt to get members for non-object"}',
                '{"error":"Expected JSON object for keyword: \'parameters\': attempt to access JSON non-object as '
                'object"}']
    for body in seen_500:
        assert body.startswith(haproxy.TRITON_PARSE_ERRORS), body
        assert surface.error_shape_ok(body.encode())
    assert not '{"error":"model raising on purpose"}'.startswith(haproxy.TRITON_PARSE_ERRORS)
    assert all(json.loads(p + ("}" if p.endswith('"') else '"}')) for p in haproxy.TRITON_ROUTE_ERRORS)


def test_the_surface_records_a_5xx_and_a_wrong_error_shape_once_per_class():
    tally = surface.Tally(surface.SURFACE)
    surface.check_http(tally, "generate", 500, b'{"error":"Unable to parse JSON bytes array: x"}', b'{"text_input":null}')
    surface.check_http(tally, "generate", 500, b'{"error":"Unable to parse JSON bytes array: y"}', b'{"text_input":5}')
    surface.check_http(tally, "infer", 400, b"not json", b"{}")
    surface.check_http(tally, "infer", 400, b'{"error":"fine"}', b"{}")
    surface.check_grpc(tally, "ModelInfer", "INVALID_ARGUMENT", "input byte size mismatch")
    surface.check_grpc(tally, "ModelInfer", "INTERNAL", "oops")
    assert tally.by_status == {"500": 2, "400": 2, "grpc:INVALID_ARGUMENT": 1, "grpc:INTERNAL": 1}
    assert sorted(tally.failures) == ["error not in KServe's shape (400 on infer)", "grpc INTERNAL on ModelInfer: oops",
                                      "http 500 on generate: Unable to parse JSON bytes array"]
    assert tally.as_json()["responses_5xx"] == 2


def test_a_valid_request_takes_the_required_inputs_with_plain_values():
    inputs = [{"name": "text_input", "datatype": "BYTES", "optional": False},
              {"name": "max_tokens", "datatype": "INT32", "optional": False},
              {"name": "temperature", "datatype": "FP32", "optional": True}]
    assert surface.valid_request(inputs) == {"text_input": "hi", "max_tokens": 1}
