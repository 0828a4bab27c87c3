"""Pure parts of serving: backend port choice, the proxy's config and runtime answers, the reconcile
decision, the readiness and settle loops, the recipe digest."""

from __future__ import annotations

import socket
import subprocess
import time
from types import SimpleNamespace
from pathlib import Path

import pytest

from stoker.containers.engine import BackendSpec, triton_args
from stoker.serving import haproxy, retire
from stoker.containers.ports import (
    NoFreePorts,
    Ports,
    backend_port_blocks,
    choose_backend_ports,
    is_port_free,
    parse_ephemeral_range,
    port_owner,
)
from stoker.serving.probe import ProbeFailed, hold_ready, wait_ready
from stoker.serving.topology import Backend, ProxyView, next_slot, plan_repair
from stoker.stack.dockerd import stop_daemon
from stoker.stack.image import BUILD_SH, recipe_digest

LISTEN = Ports(8000, 8001, 8002)
EPHEMERAL = (32768, 60999)


# ------------------------------------------------------------------ backend ports


def test_backend_ports_are_never_in_the_ephemeral_range():
    blocks = backend_port_blocks(EPHEMERAL)
    assert blocks and all(b + 2 < 32768 or b > 60999 for b in blocks)
    assert all(b >= 20000 for b in blocks) and all(b + 2 <= 65535 for b in blocks)
    for seed in ("a", "b", "llama", "x" * 40):
        p = choose_backend_ports(lambda port: True, ephemeral=EPHEMERAL, seed=seed)
        assert all(not 32768 <= v <= 60999 for v in p.values())
        assert p.grpc == p.http + 1 and p.metrics == p.http + 2


def test_backend_ports_skip_claimed_busy_and_avoided_ports():
    first = choose_backend_ports(lambda port: True, ephemeral=EPHEMERAL, seed="d")
    busy = {first.metrics}
    second = choose_backend_ports(lambda port: port not in busy, ephemeral=EPHEMERAL, seed="d")
    assert first.metrics not in second.values() and second != first
    third = choose_backend_ports(lambda port: True, claimed=first.values(), ephemeral=EPHEMERAL, seed="d")
    assert not set(third.values()) & set(first.values())
    with pytest.raises(NoFreePorts, match="outside the ephemeral range"):
        choose_backend_ports(lambda port: False, ephemeral=EPHEMERAL)


def test_ephemeral_range_parsing_and_a_range_leaving_no_room():
    assert parse_ephemeral_range("32768\t60999\n") == (32768, 60999)
    with pytest.raises(ValueError):
        parse_ephemeral_range("70000 80000")
    assert backend_port_blocks((1024, 65535)) == []
    with pytest.raises(NoFreePorts):
        choose_backend_ports(lambda port: True, ephemeral=(1024, 65535))


def test_port_owner_names_a_real_listener():
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen()
        owner = port_owner(listener.getsockname()[1])
    assert owner.startswith("pid ") and "python" in owner


# ------------------------------------------------------------------ proxy config and runtime answers


def test_rendered_config_routes_only_the_live_slot_and_speaks_h2_for_grpc():
    cfg = haproxy.render(haproxy.ProxyLayout(LISTEN, {"blue": Ports(20000, 20001, 20002), "green": None}, "blue"))
    # Loopback unless deploy.listen says otherwise.
    assert "bind 127.0.0.1:8000\n" in cfg and "bind 127.0.0.1:8001 proto h2\n" in cfg and "bind 127.0.0.1:8002\n" in cfg
    open_ = haproxy.render(haproxy.ProxyLayout(LISTEN, {}, None, address="0.0.0.0"))
    assert "bind :8000\n" in open_ and "bind :8001 proto h2\n" in open_
    assert "bind [::1]:8000\n" in haproxy.render(haproxy.ProxyLayout(LISTEN, {}, None, address="::1"))
    assert "server blue 127.0.0.1:20001 proto h2 check port 20000 check-proto h1\n" in cfg
    assert "server green 127.0.0.1:1 proto h2 check port 1 check-proto h1 disabled" in cfg
    assert cfg.count(" disabled") == 3 and "${" not in cfg
    idle = haproxy.render(haproxy.ProxyLayout(LISTEN, {}, None))
    assert idle.count(" disabled") == 6


def test_switch_commands_point_the_slot_then_drain_the_other():
    cmds = haproxy.switch_commands("green", Ports(20003, 20004, 20005), drain="blue").split("; ")
    assert cmds[:4] == ["set server http/green addr 127.0.0.1 port 20003", "set server http/green check-port 20003",
                        "set server http/green state ready", "set server http/blue state drain"]
    assert "set server grpc/green addr 127.0.0.1 port 20004" in cmds and len(cmds) == 12


SERVERS_STATE = """1
# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight srv_time_since_last_change srv_check_status srv_check_result srv_check_health srv_check_state srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord srv_use_ssl srv_check_port srv_check_addr srv_agent_addr srv_agent_port
3 http 1 blue 127.0.0.1 2 8 1 1 1 1 0 2 0 0 0 0 - 20000 - 0 0 - - 0
3 http 2 green 127.0.0.1 2 0 1 1 1 1 0 0 8 0 0 0 - 20003 - 0 0 - - 0
4 grpc 1 blue 127.0.0.1 2 8 1 1 1 1 0 2 0 0 0 0 - 20001 - 0 0 - - 0
4 grpc 2 green 127.0.0.1 2 0 1 1 1 1 0 0 8 0 0 0 - 20004 - 0 0 - - 0
5 metrics 1 blue 127.0.0.1 0 5 1 1 1 1 0 2 0 0 0 0 - 20002 - 0 0 - - 0
5 metrics 2 green 127.0.0.1 2 0 1 1 1 1 0 0 8 0 0 0 - 20005 - 0 0 - - 0
"""


def test_servers_state_parsing_finds_the_live_slot():
    states = haproxy.parse_servers_state(SERVERS_STATE)
    assert states["http"]["blue"].draining and not states["http"]["blue"].ready
    assert states["http"]["green"].ready and states["http"]["green"].port == 20003
    assert not states["metrics"]["blue"].ready and not states["metrics"]["blue"].draining  # maint
    assert haproxy.live_slot(states) == "green"
    both = haproxy.parse_servers_state(SERVERS_STATE.replace(" 2 8 1 1", " 2 0 1 1").replace(" 0 5 1 1", " 2 0 1 1"))
    assert haproxy.live_slot(both) is None  # two ready slots is not one consistent route


def test_stat_csv_sessions_per_server():
    csv = ("# pxname,svname,qcur,qmax,scur,smax\nhttp,FRONTEND,,,3,4\nhttp,blue,0,0,2,5\n"
           "grpc,blue,0,0,1,1\ngrpc,BACKEND,0,0,3,3\n")
    assert haproxy.parse_stat_sessions(csv) == {("http", "blue"): 2, ("grpc", "blue"): 1}


def test_stat_csv_bytes_out_per_server_and_retire_waits_for_them_to_stop():
    csv = "# pxname,svname,scur,bout\nhttp,blue,0,120\ngrpc,blue,1,4096\ngrpc,BACKEND,1,4216\n"
    assert haproxy.parse_stat_counter(csv, "bout") == {("http", "blue"): 120, ("grpc", "blue"): 4096}

    class Counting:  # the proxy's bout while an answer's last bytes pass through, then still
        reads = iter([10, 20, 30] + [30] * 100)

        def bytes_out(self, slot):
            return next(self.reads)

    rt = Counting()
    t0 = time.monotonic()
    retire._wait_proxy_quiet(rt, SimpleNamespace(slot="blue"), t0 + 30)
    waited = time.monotonic() - t0
    assert waited >= retire.QUIET_S + 2 * retire.DRAIN_POLL_S  # the moving reads restarted the quiet window
    assert waited < retire.QUIET_S + 6 * retire.DRAIN_POLL_S


# ------------------------------------------------------------------ reconcile decisions


def B(name, slot, port, *, running=True, ready=True, created=1, legacy=False, digest="d", served=True) -> Backend:
    return Backend(name, slot, Ports(port, port + 1, port + 2), digest, running, ready, ("t", created),
                   legacy=legacy, served=served)


def test_ending_a_slots_streams_covers_every_section():
    assert haproxy.end_sessions_commands("blue").split("; ") == [
        "shutdown sessions server http/blue", "shutdown sessions server grpc/blue", "shutdown sessions server metrics/blue"]


def test_in_flight_sums_the_gauges_of_requests_begun_and_queued():
    from stoker.triton.metrics import in_flight

    text = """# TYPE stoker_requests_in_flight gauge
stoker_requests_in_flight{model="tensorrt_llm"} 1
stoker_requests_in_flight{model="ensemble"} 0
nv_inference_pending_request_count{model="ensemble",version="1"} 2
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="max",version="1"} 64
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 3
"""
    assert in_flight(text) == 6  # 1 + 2 queued + 3 active; TensorRT-LLM's "max" is a capacity, not a request
    assert in_flight('stoker_requests_in_flight{model="m"} 0\nnv_inference_pending_request_count{model="m"} 0') == 0
    # Triton's pending gauge alone cannot tell a request being answered from none: None, retire waits on the proxy.
    assert in_flight('nv_inference_pending_request_count{model="m",version="1"} 0') is None
    assert in_flight("") is None


def test_consistent_deployment_needs_no_repair():
    blue = B("b", "blue", 20000)
    r = plan_repair([blue], ProxyView(True, True, "blue", {"blue": 20000, "green": 1}, LISTEN), LISTEN)
    assert r.live is blue and r.remove == () and r.proxy == "ok" and not r.reroute and r.actions() == []


def test_leftover_candidate_of_a_killed_run_is_removed_and_the_routed_backend_stays():
    blue, green = B("b", "blue", 20000, created=1), B("g", "green", 20003, created=2)  # green newer, not routed
    r = plan_repair([green, blue], ProxyView(True, True, "blue", {"blue": 20000}, LISTEN), LISTEN)
    assert r.live is blue and r.remove == (green,) and not r.reroute


def test_dead_proxy_is_started_and_routes_to_the_newest_ready_backend():
    blue, green = B("b", "blue", 20000, created=1), B("g", "green", 20003, created=2, ready=False)
    r = plan_repair([blue, green], ProxyView(True, False, listen=LISTEN), LISTEN)
    assert r.live is blue and r.remove == (green,) and r.proxy == "start"
    assert plan_repair([blue], ProxyView(False, False), LISTEN).proxy == "create"
    assert plan_repair([blue], ProxyView(True, True, "blue", {"blue": 20000}, Ports(9000, 9001, 9002)),
                       LISTEN).proxy == "recreate"


def test_routed_backend_died_so_another_ready_one_takes_over():
    blue, green = B("b", "blue", 20000, running=False, ready=False), B("g", "green", 20003)
    r = plan_repair([blue, green], ProxyView(True, True, "blue", {"blue": 20000}, LISTEN), LISTEN)
    assert r.live is green and r.remove == (blue,) and r.reroute
    gone = plan_repair([blue], ProxyView(True, True, "blue", {"blue": 20000}, LISTEN), LISTEN)
    assert gone.live is None and gone.reroute and "route the proxy to nothing" in gone.actions()


def test_a_slow_health_answer_never_unseats_the_routed_backend():
    """Regression: a saturated live backend missed one health probe and reconcile removed it."""
    busy = B("b", "blue", 20000, ready=False)  # running, routed, probe timed out
    r = plan_repair([busy], ProxyView(True, True, "blue", {"blue": 20000}, LISTEN), LISTEN)
    assert r.live is busy and r.remove == () and not r.reroute and r.actions() == []
    leftover = B("g", "green", 20003, created=2)
    r = plan_repair([busy, leftover], ProxyView(True, True, "blue", {"blue": 20000}, LISTEN), LISTEN)
    assert r.live is busy and r.remove == (leftover,)


def test_wave_one_containers_are_replaced_and_next_slot_alternates():
    legacy = B("old", "", 8000, legacy=True)
    r = plan_repair([legacy], ProxyView(False, False), LISTEN)
    assert r.live is None and r.remove == (legacy,) and "wave-1" in r.actions()[0]
    assert next_slot(None) == "blue" and next_slot(B("b", "blue", 20000)) == "green"
    assert next_slot(B("g", "green", 20000)) == "blue"


# ------------------------------------------------------------------ backend spec


def test_triton_args_exact():
    assert triton_args("s3://h:1/b/p", Ports(1, 2, 3), ["--x"]) == [
        "--model-repository=s3://h:1/b/p", "--http-address=127.0.0.1", "--http-port=1", "--grpc-address=127.0.0.1",
        "--grpc-port=2", "--metrics-address=127.0.0.1", "--metrics-port=3", "--x"]
    assert Ports.parse(Ports(1, 2, 3).label()) == Ports(1, 2, 3)


def test_request_repr_hides_secrets_and_name_is_validated():
    req = BackendSpec(
        name="llama",
        image="i",
        repository_uri="s3://h/b/p",
        repo_digest="d",
        env={"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"},
    )
    assert "s3cr3t-value" not in repr(req)
    with pytest.raises(ValueError):
        BackendSpec(name="Bad Name!", image="i", repository_uri="u", repo_digest="d")


# ------------------------------------------------------------------ wait_ready


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_ready_returns_elapsed_after_refusals_and_503():
    clock = FakeClock()
    answers = [
        ConnectionRefusedError("refused"),
        ConnectionRefusedError("refused"),
        503,
        200,
    ]
    seen = []

    def request(url: str, timeout: float) -> int:
        seen.append(url)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    waited = wait_ready(
        "http://x/ready",
        30,
        request=request,
        clock=clock,
        sleep=clock.sleep,
        interval_s=0.5,
    )
    assert waited == pytest.approx(1.5)
    assert len(seen) == 4 and clock.sleeps == [0.5, 0.5, 0.5]


def test_wait_ready_deadline_reports_last_answer():
    clock = FakeClock()
    with pytest.raises(ProbeFailed) as err:
        wait_ready(
            "http://x/ready",
            5,
            request=lambda url, t: 503,
            clock=clock,
            sleep=clock.sleep,
            interval_s=1.0,
        )
    assert str(err.value) == "not ready after 5 s (last answer: HTTP 503)"
    assert clock.now == pytest.approx(105.0)


def test_wait_ready_fails_fast_when_container_exits():
    clock = FakeClock()
    calls = []
    reasons = iter([None, "status exited, exit code 1"])

    def request(url: str, timeout: float) -> int:
        calls.append(timeout)
        raise ConnectionRefusedError()

    with pytest.raises(
        ProbeFailed, match=r"exited before it was ready \(status exited, exit code 1\)"
    ):
        wait_ready(
            "http://x/ready",
            120,
            request=request,
            clock=clock,
            sleep=clock.sleep,
            exit_reason=lambda: next(reasons),
        )
    assert len(calls) == 1 and clock.now < 102  # no waiting out the 120 s deadline


def test_wait_ready_request_timeout_never_exceeds_deadline():
    clock = FakeClock()
    timeouts = []

    def request(url: str, timeout: float) -> int:
        timeouts.append(timeout)
        raise TimeoutError()

    with pytest.raises(ProbeFailed):
        wait_ready(
            "u", 1.2, request=request, clock=clock, sleep=clock.sleep, interval_s=1.0
        )
    assert timeouts[0] == pytest.approx(1.2) and all(t >= 0.1 for t in timeouts)


def test_settle_window_catches_a_server_that_was_ready_then_died():
    clock = FakeClock()
    answers = iter([200, 200, ConnectionRefusedError("refused")])

    def request(url: str, timeout: float) -> int:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    with pytest.raises(ProbeFailed, match="was ready, then stopped answering during the settle window"):
        hold_ready("u", 3.0, request=request, clock=clock, sleep=clock.sleep)
    reasons = iter([None, "status exited, exit code 1"])
    with pytest.raises(ProbeFailed, match="then exited during the settle window"):
        hold_ready("u", 3.0, request=lambda u, t: 200, clock=clock, sleep=clock.sleep,
                   exit_reason=lambda: next(reasons))
    clock2 = FakeClock()
    hold_ready("u", 1.0, request=lambda u, t: 200, clock=clock2, sleep=clock2.sleep, interval_s=0.25)
    assert clock2.now == pytest.approx(101.0)


# ------------------------------------------------------------------ real sockets, files


def test_is_port_free_sees_a_real_listener():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not is_port_free(port)
    assert is_port_free(port)


def test_recipe_digest_matches_build_sh():
    out = subprocess.run(
        [str(BUILD_SH), "--print-recipe"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == recipe_digest()


def test_recipe_digest_changes_with_any_byte(tmp_path: Path):
    (tmp_path / "versions.env").write_text("TORCH=2.13.0\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.py").write_text("x = 1\n")
    before = recipe_digest(tmp_path)
    (tmp_path / "sub" / "model.py").write_text("x = 2\n")
    assert recipe_digest(tmp_path) != before


def test_stop_daemon_ignores_a_pid_that_is_not_dockerd(tmp_path: Path):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / "dockerd.pid").write_text(f"{sleeper.pid}\n")
        assert stop_daemon(tmp_path) is False
        assert sleeper.poll() is None  # still alive: not ours to stop
        assert not (tmp_path / "dockerd.pid").exists()
        assert stop_daemon(tmp_path) is False  # no pid file at all
    finally:
        sleeper.kill()
        sleeper.wait()


# ------------------------------------------------------------------ deploy.replicas


def test_replicas_render_one_server_per_replica_balanced_by_least_connections():
    layout = haproxy.ProxyLayout(LISTEN, {"blue": [Ports(20000, 20001, 20002), Ports(20003, 20004, 20005)]}, "blue",
                                 replicas=2)
    cfg = haproxy.render(layout)
    http = cfg[cfg.index("backend http"):cfg.index("frontend grpc")]
    assert "    balance leastconn" in http
    assert "    server blue 127.0.0.1:20000 check port 20000\n" in http and "    server blue_1 127.0.0.1:20003 check" in http
    assert "    server green 127.0.0.1:1 check port 1 disabled" in http and "server green_1 127.0.0.1:1 check port 1 disabled" in http
    # One backend per slot renders as it always did: no balance line, no sibling servers.
    single = haproxy.render(haproxy.ProxyLayout(LISTEN, {"blue": Ports(20000, 20001, 20002)}, "blue"))
    assert "balance" not in single and "blue_1" not in single


def test_a_switch_readies_every_new_replica_before_draining_the_old_ones():
    cmds = haproxy.switch_commands("green", [Ports(1, 2, 3), Ports(4, 5, 6)], drain="blue", replicas=2).split("; ")
    http = [c for c in cmds if " http/" in c and "check-port" not in c]
    assert http == ["set server http/green addr 127.0.0.1 port 1", "set server http/green state ready",
                    "set server http/green_1 addr 127.0.0.1 port 4", "set server http/green_1 state ready",
                    "set server http/blue state drain", "set server http/blue_1 state drain"]
    # Fewer ports than replicas (a sibling gone): its server goes to maint, never to a stale port.
    assert "set server http/green_1 state maint" in haproxy.switch_commands("green", [Ports(1, 2, 3)], None, 2)
    assert haproxy.maint_commands("blue", 2).count("state maint") == 6


def test_sessions_count_every_replica_of_a_slot():
    csv = "# pxname,svname,qcur,qmax,scur,smax\nhttp,blue,0,0,2,5\nhttp,blue_1,0,0,3,3\ngrpc,green_1,0,0,1,1\n"
    stats = haproxy.parse_stat_sessions(csv)
    assert sum(n for (_, s), n in stats.items() if haproxy.slot_of(s) == "blue") == 5
    assert stats[("grpc", "green_1")] == 1


def test_reconcile_keeps_the_live_backends_replicas_and_removes_a_stale_generation():
    r0 = B("b", "blue", 20000)
    r1 = Backend("b-1", "blue", Ports(20010, 20011, 20012), "d", True, True, ("t", 1), replica=1)
    stale = Backend("g-1", "green", Ports(20020, 20021, 20022), "old", True, True, ("t", 0), replica=1)
    r = plan_repair([r0, r1, stale], ProxyView(True, True, "blue", {"blue": 20000}, LISTEN), LISTEN)
    assert r.live.container == "b" and [m.container for m in r.live.members] == ["b-1"]
    assert r.remove == (stale,) and not r.reroute


def test_a_missing_ngc_image_is_pulled_after_an_ngc_login_and_stokers_own_is_built():
    from stoker.containers.engine import missing_image_fix

    ngc = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
    assert missing_image_fix(ngc) == ("pull it: `docker login nvcr.io` (username $oauthtoken, an NGC API key as "
                                      f"password), then `docker pull {ngc}`")
    assert "stoker image" not in missing_image_fix(ngc + "@sha256:" + "a" * 64)
    assert missing_image_fix("stoker/triton-cpu:2.51.0-cpu") == "build it with `stoker image`"
