"""`stoker status NAME --watch` run as a user runs it, against a real deployment (the session's Docker daemon, HAProxy
and a Triton backend serving a test build from S3): killing the live backend is an ALERT naming it within seconds,
and --exit-on-alert ends the watch with status 3."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stoker.commands.status_watch import EXIT_ALERT

from promotion_kit import deploy
from promotion_kit import build, client, images, s3, target  # noqa: F401 -- fixtures the tests request

pytestmark = [pytest.mark.docker, pytest.mark.s3]

STOKER = str(Path(sys.executable).with_name("stoker"))


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line.rstrip("\n"))
    into.put(None)


def test_watch_alerts_when_the_live_backend_is_killed(client, target, build, tmp_path):  # noqa: F811
    _, done = deploy(client, target, build("a"))
    container = done["live"]["container"]
    env = {**os.environ, "STOKER_HOME": str(tmp_path / "home")}
    env.pop("PREFECT_API_URL", None)  # lines only: the Prefect path is unit-tested
    p = subprocess.Popen([STOKER, "status", target.name, "--watch", "--interval", "1", "--exit-on-alert"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    got: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(p.stdout, got), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while not any(" first look: " in ln for ln in seen):  # a healthy deployment: the baseline, no ALERT
            line = got.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "\n".join(seen)
            seen.append(line)
        assert not any(" ALERT " in ln for ln in seen), "\n".join(seen)
        assert f"live build {done['live']['digest'][:12]}" in seen[-1] and "1 of 1 backend(s) running" in seen[-1]

        t0 = time.monotonic()
        client.containers.get(container).kill()
        rc = p.wait(timeout=20)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    while (line := got.get(timeout=5)) is not None:
        seen.append(line)
    print(f"watch exited {rc} {took:.1f} s after the kill:\n" + "\n".join(seen), flush=True)
    assert rc == EXIT_ALERT, "\n".join(seen)
    alerts = [ln for ln in seen if " ALERT " in ln]
    assert alerts and container in alerts[0], "\n".join(seen)
    assert alerts[0][:4].isdigit() and alerts[0][19] == "Z"  # ISO time first: 2026-11-28T06:40:00Z ALERT ...
