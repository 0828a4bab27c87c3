"""The watch window's judgement (stoker/serving/traffic.py): every route counted, failures judged by rate and kind."""

from __future__ import annotations

from stoker.serving.traffic import OPENAI_ROUTE, Tally, describe, judge, proxy_tally, triton_tallies

# As tritonserver 2.51 writes them (the reason label on failures, one line per model, version and reason).
METRICS = """\
# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="tensorrt_llm",version="1"} 7
nv_inference_request_success{model="ensemble",version="1"} 20
nv_inference_request_success{model="preprocessing",version="1"} 0
# TYPE nv_inference_request_failure counter
nv_inference_request_failure{model="tensorrt_llm",reason="REJECTED",version="1"} 1
nv_inference_request_failure{model="tensorrt_llm",reason="CANCELED",version="1"} 4
nv_inference_request_failure{model="tensorrt_llm",reason="BACKEND",version="1"} 2
nv_inference_request_failure{model="tensorrt_llm",reason="OTHER",version="1"} 1
nv_inference_request_failure{model="ensemble",reason="BACKEND",version="1"} 0
nv_inference_count{model="ensemble",version="1"} 99
"""

SHOW_STAT = """\
# pxname,svname,qcur,scur,hrsp_1xx,hrsp_2xx,hrsp_3xx,hrsp_4xx,hrsp_5xx,hrsp_other,
http,blue,0,0,0,30,0,0,0,0,
openai,openai,0,1,0,10,0,6,2,0,
openai,BACKEND,0,1,0,10,0,6,2,0,
"""


def test_triton_failures_are_split_by_reason_into_the_builds_and_the_clients():
    t = triton_tallies(METRICS)
    # BACKEND, OTHER and REJECTED are the build's; CANCELED is the client's; every answer is a request.
    assert t["tensorrt_llm"] == Tally(requests=15, build_faults=4, client_faults=4)
    assert t["ensemble"] == Tally(requests=20, build_faults=0, client_faults=0)
    assert t["preprocessing"] == Tally()


def test_v1_answers_by_status_class_from_the_proxy():
    assert proxy_tally(SHOW_STAT, "openai", "openai") == Tally(requests=18, build_faults=2, client_faults=6)
    assert proxy_tally(SHOW_STAT, "openai", "absent") is None
    assert proxy_tally("", "openai", "openai") is None


def test_the_window_counts_from_its_baseline_and_a_restart_counts_everything_since():
    assert Tally(10, 3, 1) - Tally(4, 1, 1) == Tally(6, 2, 0)
    assert Tally(2, 2, 0) - Tally(40, 0, 0) == Tally(2, 2, 0)


def test_one_failure_in_a_quiet_window_does_not_fail_it():
    assert judge({"ensemble": Tally(1, 1, 0)}, max_error_rate_pct=1.0) is None
    assert judge({"ensemble": Tally(2, 2, 0)}, max_error_rate_pct=1.0) is None


def test_enough_failures_over_the_rate_fail_it_naming_the_route():
    cause = judge({"ensemble": Tally(50, 0, 0), "tensorrt_llm": Tally(5, 3, 0)}, max_error_rate_pct=1.0)
    assert cause == "tensorrt_llm failed 3 of 5 requests (60.0 % > 1 %, at least 3 needed)"


def test_enough_failures_under_the_rate_do_not():
    assert judge({"ensemble": Tally(1000, 5, 0)}, max_error_rate_pct=1.0) is None
    assert judge({"ensemble": Tally(1000, 11, 0)}, max_error_rate_pct=1.0) is not None


def test_client_errors_never_fail_the_window():
    # /v1 answered 400 to forty bad requests: the build is not at fault.
    assert judge({OPENAI_ROUTE: Tally(40, 0, 40)}, max_error_rate_pct=0.0) is None
    cause = judge({OPENAI_ROUTE: Tally(40, 4, 30)}, max_error_rate_pct=1.0)
    assert cause and cause.startswith("/v1 failed 4 of 40") and "30 client error(s) not counted" in cause


def test_the_minimum_is_configurable_and_the_worst_route_is_named():
    routes = {"ensemble": Tally(10, 1, 0), OPENAI_ROUTE: Tally(2, 2, 0)}
    assert judge(routes, max_error_rate_pct=1.0, min_failures=1).startswith("/v1 failed 2 of 2")
    assert describe(routes) == "ensemble 10 (1 failed), /v1 2 (2 failed)"
    assert describe({}) == "no requests"
