"""Pure parts of the Docker deployment: slot/port choice, readiness loop, recipe digest."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from stoker.docker_engine import (
    DeployError,
    DeployRequest,
    NotReady,
    PortInUse,
    Ports,
    Slot,
    choose_slot,
    is_port_free,
    triton_args,
    wait_ready,
)
from stoker.stack.dockerd import stop_daemon
from stoker.stack.image import BUILD_SH, recipe_digest

REQ = Ports(8000, 8001, 8002)


def free_except(*busy: int):
    return lambda port: port not in busy


# ------------------------------------------------------------------ choose_slot


def test_first_deploy_takes_requested_ports_in_blue():
    assert choose_slot(REQ, 10, None, free_except()) == Slot("blue", REQ)


def test_requested_ports_held_by_current_blue_go_to_green_standby():
    current = Slot("blue", REQ)
    assert choose_slot(REQ, 10, current, free_except(8000, 8001, 8002)) == Slot(
        "green", Ports(8010, 8011, 8012)
    )


def test_current_on_standby_frees_requested_ports_for_next_deploy():
    current = Slot("green", Ports(8010, 8011, 8012))
    assert choose_slot(REQ, 10, current, free_except(8010, 8011, 8012)) == Slot(
        "blue", REQ
    )


def test_port_held_by_another_process_is_named_in_error():
    with pytest.raises(PortInUse) as err:
        choose_slot(REQ, 10, None, free_except(8000))
    assert (
        str(err.value) == "port 8000 (deploy.ports.http) is in use by another process"
    )


def test_foreign_port_wins_over_standby_when_only_some_ports_are_ours():
    current = Slot(
        "blue", Ports(8000, 9001, 9002)
    )  # the user changed grpc/metrics ports
    with pytest.raises(PortInUse, match=r"^port 8001 \(deploy.ports.grpc\)"):
        choose_slot(REQ, 10, current, free_except(8000, 8001, 9001, 9002))


def test_busy_standby_port_is_reported_with_offset():
    current = Slot("blue", REQ)
    with pytest.raises(PortInUse) as err:
        choose_slot(REQ, 10, current, free_except(8000, 8001, 8002, 8012))
    assert str(err.value) == (
        "port 8012 (deploy.ports.metrics + standby_port_offset 10) "
        "is in use by another process"
    )


def test_port_in_use_is_a_deploy_error():
    assert issubclass(PortInUse, DeployError) and issubclass(NotReady, DeployError)


# ------------------------------------------------------------------ request / args


def test_triton_args_exact():
    assert triton_args("s3://127.0.0.1:9000/b/p", REQ, ["--log-verbose=1"]) == [
        "--model-repository=s3://127.0.0.1:9000/b/p",
        "--http-port=8000",
        "--grpc-port=8001",
        "--metrics-port=8002",
        "--log-verbose=1",
    ]


def test_ports_label_round_trip():
    assert Ports.parse(REQ.label()) == REQ
    assert REQ.shifted(10) == Ports(8010, 8011, 8012)


def test_request_repr_hides_secrets_and_name_is_validated():
    req = DeployRequest(
        name="llama",
        image="i",
        repository_uri="s3://h/b/p",
        repo_digest="d",
        env={"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"},
    )
    assert "s3cr3t-value" not in repr(req)
    with pytest.raises(ValueError):
        DeployRequest(name="Bad Name!", image="i", repository_uri="u", repo_digest="d")


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
    with pytest.raises(NotReady) as err:
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
        NotReady, match=r"exited before it was ready \(status exited, exit code 1\)"
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

    with pytest.raises(NotReady):
        wait_ready(
            "u", 1.2, request=request, clock=clock, sleep=clock.sleep, interval_s=1.0
        )
    assert timeouts[0] == pytest.approx(1.2) and all(t >= 0.1 for t in timeouts)


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
