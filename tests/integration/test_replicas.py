"""deploy.replicas on the reference target's serving path: real Docker, HAProxy, Triton, S3 (moto).

N identical backends behind the one address share its traffic (HAProxy leastconn); a replace stages all N of the
new build beside the old ones, each proven, and switches them together, so the proxy never has fewer than N ready
servers and no request fails.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from stoker.containers import engine
from stoker.serving import haproxy, probe, promote
from stoker.containers.ports import Ports

from promotion_kit import Lines, Load, backends, serving_tag
from promotion_kit import build, client, images, s3, target  # noqa: F401 -- fixtures the tests request

pytestmark = [pytest.mark.docker, pytest.mark.s3]
N = 2


class ReadyServers:
    """Polls the proxy's runtime state: how many http servers take new requests (the fewest seen)."""

    def __init__(self, client, target) -> None:
        self.rt = promote.runtime_for(target, promote.proxy_container(client, target.name))
        self.fewest, self.stop = 99, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.is_set():
            try:
                ready = [s for s in self.rt.servers().get("http", {}).values() if s.ready]
                self.fewest = min(self.fewest, len(ready))
            except haproxy.ProxyApiError:
                pass
            time.sleep(0.05)

    def __enter__(self) -> ReadyServers:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def _running(client, name) -> list:
    return sorted((c for c in backends(client, name) if c.status == "running"), key=lambda c: c.name)


def test_replicas_share_the_address_and_a_replace_keeps_n_ready_and_drops_nothing(client, target, build):
    t = dataclasses.replace(target, replicas=N)
    a = build("A")
    log = Lines()
    promote.go_live(client, t, promote.prepare(client, t, [a] * N, 1.0, log), 2.0, 1.0, 10.0, log)
    first = _running(client, t.name)
    assert [c.name for c in first] == [engine.backend_name(t.name, "blue"), engine.backend_name(t.name, "blue", 1)]
    assert serving_tag(t) == "A"

    b = build("B", interval_s=0.01)
    with Load(t.endpoint) as load, ReadyServers(client, t) as servers:
        time.sleep(1.5)
        staged = promote.prepare(client, t, [b] * N, 1.0, log)
        assert len(staged["candidate"]["replicas"]) == N - 1  # every replica proven before the switch
        done = promote.go_live(client, t, staged, 3.0, 1.0, 10.0, log)
        time.sleep(1.5)
    assert load.failures == [], load.failures[:5]
    assert load.ok["grpc"] > 5 and load.ok["http"] > 5 and load.tags == {"A", "B"}
    assert done["switched"] and servers.fewest >= N, servers.fewest
    after = _running(client, t.name)
    assert [c.labels[engine.LABEL_SLOT] for c in after] == ["green"] * N
    # Least connections spread the load: every new replica answered requests.
    for c in after:
        ports = Ports.parse(c.labels[engine.LABEL_PORTS])
        ok, _ = probe.request_counts(f"http://127.0.0.1:{ports.metrics}/metrics")
        assert ok > 0, c.name
    # Reconcile sees one live generation of N replicas and has nothing to repair.
    again = Lines()
    live = promote.reconcile(client, t, again)
    assert live.slot == "green" and len(live.members) == N - 1 and not any("remove" in ln for ln in again), again

    # A replica that dies loses its share of traffic: the proxy's health check (Triton's readiness) marks it DOWN
    # within a few seconds; meanwhile a request that finds it refusing is retried on its sibling. Only a request
    # already on it when it died can fail: at most one per client of the load (2), and none once it is DOWN.
    victim = after[1]
    rt = promote.runtime_for(t, promote.proxy_container(client, t.name))
    server = haproxy.server_name("green", 1)
    with Load(t.endpoint) as load:
        time.sleep(1.0)
        victim.kill()
        killed = time.monotonic()
        # Each section checks on its own: every one of them has it DOWN.
        while not all(rt.status().get((section, server), "").startswith("DOWN") for section in ("http", "grpc",
                                                                                                  "metrics")):
            assert time.monotonic() - killed < 20, rt.status()
            time.sleep(0.1)
        down_s = time.monotonic() - killed
        at_down, ok_at_down = len(load.failures), dict(load.ok)
        time.sleep(3.0)
    print(f"replica killed: DOWN after {down_s:.1f} s, {at_down} failed request(s) before, "
          f"{len(load.failures) - at_down} after; answered {load.ok}")
    assert down_s < 10 and at_down <= 2 and len(load.failures) == at_down, (down_s, load.failures[:5])
    assert load.ok["http"] > ok_at_down["http"] and load.ok["grpc"] > ok_at_down["grpc"]
