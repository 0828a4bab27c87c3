"""Where Prefect's temporary API listens: never on the ports stoker serves on by default (8000-8999 holds the demo
spec's 8000-8002, the Operate section's 8100-8112 and the webhook receiver's 8787), always on a port leased the way
stoker leases its own."""

from __future__ import annotations

import socket

from stoker.containers import port_lease
from stoker.stack.prefect_ephemeral import LeasedPort, place_temporary_api


def test_the_temporary_api_gets_one_leased_free_port_outside_prefects_default_range(monkeypatch, tmp_path):
    from prefect.server.api.server import SubprocessASGIServer

    monkeypatch.setenv("STOKER_PORT_LEASES", str(tmp_path / "leases"))
    own = SubprocessASGIServer._port_range
    # prefect 3.8.8's own choice, unless this session placed it already (tests/conftest.py, with service tests in)
    assert own == range(8000, 9000) or isinstance(own, LeasedPort)
    monkeypatch.setattr(SubprocessASGIServer, "_port_range", range(8000, 9000))
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})  # the server a flow here would start: untouched
    place_temporary_api()
    server = SubprocessASGIServer()
    first, second = server.find_available_port(), server.find_available_port()
    assert first != second  # drawn afresh each time: a server that starts later does not get a stale pick
    for port in (first, second):
        assert not 8000 <= port < 9000
        assert port_lease.held(port)  # no other pick of this host hands it out before the server binds it
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when picked


def test_a_configured_api_leaves_prefects_choice_alone(monkeypatch, tmp_path):
    from prefect.context import refresh_global_settings_context
    from prefect.server.api.server import SubprocessASGIServer

    monkeypatch.setenv("STOKER_PORT_LEASES", str(tmp_path / "leases"))
    monkeypatch.setattr(SubprocessASGIServer, "_port_range", range(8000, 9000))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    refresh_global_settings_context()
    try:
        place_temporary_api()
    finally:
        monkeypatch.delenv("PREFECT_API_URL")
        refresh_global_settings_context()
    assert SubprocessASGIServer._port_range == range(8000, 9000)
    assert not (tmp_path / "leases").exists()
