"""stoker.commands.status_watch: the pure diff of two observations into the watch's lines, the failed-poll carry,
the timestamps, the `show stat` parse, and the loop's exit codes and recovery over a scripted sequence of looks."""

from __future__ import annotations

import copy

import pytest

from stoker.commands import status_watch as w
from stoker.commands.status_watch import ALERT, INFO, OK, diff


def _backend(**kw) -> dict:
    return {"state": "running", "exit_code": 0, "oom": False, "error": "", "restarts": 0, "check": "UP",
            "check_reason": "L7OK/200 in 2ms", "refused": None, **kw}


def _obs(**kw) -> dict:
    return {"error": None, "proxy": "running", "backends": {"d-blue": _backend()},
            "live": {"digest": "a" * 64, "run_id": "r1", "from_run": True}, "rollbacks": {}, **kw}


def _with(base: dict, backend: str = "d-blue", **kw) -> dict:
    out = copy.deepcopy(base)
    out["backends"][backend].update(kw)
    return out


def test_a_steady_deployment_says_nothing_after_its_first_look():
    first = diff(None, _obs())
    assert first == [(INFO, f"first look: proxy running, 1 of 1 backend(s) running, live build {'a' * 12} (run r1)")]
    assert diff(_obs(), _obs()) == []


def test_the_first_look_reports_what_is_wrong_now_but_not_history():
    cur = _obs(proxy="missing", rollbacks={"x-rollback-1": {"from": "b", "to": "a", "reason": "r"}})
    cur = _with(cur, state="exited", exit_code=1, check="DOWN", check_reason="L4CON Connection refused")
    lines = diff(None, cur)
    texts = [t for _, t in lines]
    assert (ALERT, "proxy not running (missing)") in lines
    assert (ALERT, "backend d-blue exited (exit code 1; restarts 0)") in lines
    assert (ALERT, "backend d-blue DOWN (proxy check: L4CON Connection refused)") in lines
    assert not any("rollback" in t for t in texts)


def test_a_proxy_check_going_down_and_up_again_is_one_line_each_way():
    down = _with(_obs(), check="DOWN", check_reason="L7STS/503 in 1ms")
    assert diff(_obs(), down) == [(ALERT, "backend d-blue DOWN (proxy check: L7STS/503 in 1ms)")]
    assert diff(down, down) == []  # a change, not a poll
    assert diff(down, _obs()) == [(OK, "backend d-blue UP again")]
    # HAProxy's "UP 1/3": up, a check failed, not down yet; "DOWN 1/2": still down, one check passed
    assert diff(_obs(), _with(_obs(), check="UP 1/3")) == []
    assert diff(down, _with(down, check="DOWN 1/2")) == []


def test_maint_and_drain_are_the_proxy_s_own_doing_not_an_alert():
    for state in ("MAINT", "DRAIN", "no check"):
        assert diff(_obs(), _with(_obs(), check=state)) == []


def test_a_killed_backend_says_its_signal_and_restarts():
    killed = _with(_obs(), state="exited", exit_code=137, check="DOWN", check_reason="L4CON Connection refused")
    lines = diff(_obs(), killed)
    assert lines[0] == (ALERT, "backend d-blue exited (exit code 137, signal 9; restarts 0)")
    assert lines[1] == (ALERT, "backend d-blue DOWN (proxy check: L4CON Connection refused)")
    assert diff(killed, killed) == []
    oom = _with(_obs(), state="exited", exit_code=137, oom=True, restarts=2, error="boom\nmore")
    assert diff(_obs(), oom)[0] == (ALERT, "backend d-blue exited (exit code 137, signal 9, out of memory, "
                                           "boom\nmore; restarts 2)")
    assert diff(killed, _with(killed, state="running", restarts=0)) == [(OK, "backend d-blue running again")]


def test_a_restart_loop_is_an_alert_per_restart_with_the_credentials_line():
    refused = "d-blue: S3 refused the backend's credentials (InvalidAccessKeyId); rotate ..."
    crashed = _with(_obs(), state="restarting", exit_code=1, restarts=1, refused=refused, check=None)
    lines = diff(_obs(), crashed)
    assert lines == [(ALERT, f"backend d-blue restarting (exit code 1; restarts 1): {refused}")]
    again = _with(crashed, restarts=2)
    assert diff(crashed, again) == [(ALERT, f"backend d-blue restarting (exit code 1; restarts 2): {refused}")]
    back = _with(again, state="running", check=None)
    assert diff(again, back) == [(OK, "backend d-blue running again")]
    # Docker restarted it between two polls: running both times, one restart more.
    assert diff(_obs(), _with(_obs(), restarts=1)) == [(ALERT, "backend d-blue restarted (restarts 1)")]


def test_the_proxy_stopping_and_coming_back():
    assert diff(_obs(), _obs(proxy="down")) == [(ALERT, "proxy not running (down)")]
    assert diff(_obs(proxy="down"), _obs(proxy="missing")) == []
    assert diff(_obs(proxy="down"), _obs()) == [(OK, "proxy running again")]


def test_a_new_rollback_record_is_an_alert_once():
    rb = {"20261128T060000-rollback-abc123": {"from": "b" * 64, "to": "a" * 64, "reason": "latency"}}
    lines = diff(_obs(), _obs(rollbacks=rb))
    assert lines == [(ALERT, f"rollback: 20261128T060000-rollback-abc123 rolled back {'b' * 12} to {'a' * 12} "
                             "(latency)")]
    assert diff(_obs(rollbacks=rb), _obs(rollbacks=rb)) == []


def test_the_live_build_changing_is_info_from_a_completed_run_else_an_alert():
    new_by_run = _obs(live={"digest": "c" * 64, "run_id": "r2", "from_run": True})
    assert diff(_obs(), new_by_run) == [(INFO, f"live build changed {'a' * 12} -> {'c' * 12} (run r2, completed)")]
    behind_its_back = _obs(live={"digest": "c" * 64, "run_id": "", "from_run": False})
    assert diff(_obs(), behind_its_back) == [
        (ALERT, f"live build changed {'a' * 12} -> {'c' * 12} (run ?, no completed run switched to it)")]
    assert diff(_obs(), _obs(live=None)) == []  # nothing live: the DOWN / exited lines say why


def test_backends_appearing_and_leaving():
    two = _obs(backends={"d-blue": _backend(), "d-green": _backend(check="MAINT")})
    assert diff(_obs(), two) == []
    assert diff(two, _obs()) == [(INFO, "backend d-green removed")]
    dead_newcomer = _obs(backends={"d-blue": _backend(), "d-green": _backend(state="exited", exit_code=2)})
    assert diff(_obs(), dead_newcomer) == [(ALERT, "backend d-green exited (exit code 2; restarts 0)")]


def test_a_failed_poll_is_one_alert_then_recovery_compares_with_the_last_good_look():
    err = {"error": "DockerException: Error while fetching server API version"}
    prev = w.carry(None, _obs())
    assert diff(prev, err) == [(ALERT, "watcher error: DockerException: Error while fetching server API version")]
    prev = w.carry(prev, err)
    assert diff(prev, {"error": "another"}) == []  # still failing: said once
    prev = w.carry(prev, {"error": "another"})
    assert prev["last_good"] == _obs()
    assert diff(prev, _obs()) == [(OK, "watcher recovered: polling again")]
    down = _with(_obs(), check="DOWN", check_reason="L4TOUT")
    assert diff(prev, down) == [(OK, "watcher recovered: polling again"),
                                (ALERT, "backend d-blue DOWN (proxy check: L4TOUT)")]
    # failing from the very start: on recovery, the first look
    start = w.carry(None, err)
    assert [lv for lv, _ in diff(start, _obs())] == [OK, INFO]


def test_stamp_is_iso_utc_then_the_level():
    assert w.stamp(ALERT, "x", now=0) == "1970-01-01T00:00:00Z ALERT x"


STAT = """# pxname,svname,qcur,scur,status,check_status,last_chk,
http,FRONTEND,,0,OPEN,,,
http,blue,0,0,UP,L7OK,,
http,green,0,0,MAINT,,,
http,BACKEND,0,0,UP,,,
grpc,blue,0,0,DOWN,L4CON,Connection refused,
grpc,green,0,0,MAINT,,,
"""


def test_parse_stat_checks_takes_the_worst_section_and_the_check_reason():
    assert w.parse_stat_checks(STAT) == {"blue": ("DOWN", "L4CON Connection refused"), "green": ("MAINT", "")}
    assert w.parse_stat_checks("") == {} and w.parse_stat_checks("garbage\n") == {}


class _Script:
    """observe() stand-in: a list of looks (dicts, or exceptions to raise) played in order."""

    def __init__(self, looks):
        self.looks = list(looks)

    def __call__(self, client, name, home):
        look = self.looks.pop(0)
        if isinstance(look, BaseException):
            raise look
        return look


def _run(monkeypatch, looks, **kw):
    monkeypatch.setattr(w, "observe", _Script(looks))
    monkeypatch.setattr(w.time, "sleep", lambda s: None)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    said: list[str] = []
    rc = w.watch("d", 0.01, log=said.append, client_factory=lambda: object(), home="/nonexistent",
                 polls=len(looks), **kw)
    return rc, said


def test_the_loop_keeps_going_through_errors_and_exits_3_on_the_first_alert(monkeypatch):
    looks = [_obs(), ConnectionError("Docker is gone"), _obs(), _with(_obs(), check="DOWN", check_reason=""), _obs()]
    rc, said = _run(monkeypatch, looks)
    assert rc == 0
    body = [ln.split(" ", 1)[1] for ln in said]
    assert body == ["info watching d every 0.01 s (Ctrl-C stops)",
                    f"info first look: proxy running, 1 of 1 backend(s) running, live build {'a' * 12} (run r1)",
                    "ALERT watcher error: ConnectionError: Docker is gone", "ok watcher recovered: polling again",
                    "ALERT backend d-blue DOWN (proxy check: no reason given)", "ok backend d-blue UP again"]
    rc, said = _run(monkeypatch, looks, exit_on_alert=True)
    assert rc == w.EXIT_ALERT and said[-1].endswith("ALERT watcher error: ConnectionError: Docker is gone")


def test_ctrl_c_ends_the_watch_with_status_0(monkeypatch):
    rc, said = _run(monkeypatch, [_obs(), KeyboardInterrupt()])
    assert rc == 0 and len(said) == 2


def test_alerts_go_out_as_prefect_events_when_configured(monkeypatch):
    import prefect.events

    sent: list[tuple] = []
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    monkeypatch.setattr(prefect.events, "emit_event", lambda event, resource, payload: sent.append(
        (event, resource, payload)))
    w.emit("d", ALERT, "backend d-blue DOWN")
    assert sent == [("stoker.deployment.watch.alert", {"prefect.resource.id": "stoker.deployment.d",
                                                        "prefect.resource.name": "d"},
                     {"level": ALERT, "message": "backend d-blue DOWN"})]
    said: list[str] = []
    monkeypatch.setattr(prefect.events, "emit_event", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    w.emit("d", ALERT, "x", log=said.append)
    assert len(said) == 1 and said[0].endswith("warning event not emitted: RuntimeError")
    monkeypatch.delenv("PREFECT_API_URL")
    sent.clear()
    w.emit("d", ALERT, "x")
    assert sent == []


@pytest.mark.parametrize("argv, says", [
    (["status", "--watch"], "--watch needs one deployment"),
    (["status", "d", "--watch", "--interval", "0"], "--interval must be more than 0 seconds"),
    (["status", "--exit-on-alert"], "go with --watch"),
])
def test_bad_flags_are_one_line_before_docker_is_asked(argv, says, capsys):
    from stoker.cli import main

    assert main(argv) == 1
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
