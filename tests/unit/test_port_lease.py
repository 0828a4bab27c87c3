"""Port leases: a port one pick claimed is refused to every other pick of the host until the lease runs out."""

from __future__ import annotations

import os

from stoker.containers import port_lease


def test_a_claimed_port_is_refused_to_the_next_pick_until_its_lease_runs_out(tmp_path):
    assert not port_lease.held(24001, folder=tmp_path)
    assert port_lease.claim(24001, folder=tmp_path)
    assert port_lease.held(24001, folder=tmp_path)
    assert not port_lease.claim(24001, folder=tmp_path)  # another process's pick
    assert port_lease.claim(24002, folder=tmp_path)  # its neighbour is not affected
    later = os.stat(tmp_path / "24001").st_mtime + port_lease.LEASE_S + 1
    assert not port_lease.held(24001, now=later, folder=tmp_path)
    assert port_lease.claim(24001, now=later, folder=tmp_path)  # expired: taken over
    assert port_lease.held(24001, folder=tmp_path)  # and leased afresh
    assert sorted(p.name for p in tmp_path.iterdir()) == ["24001", "24002"]  # no temporary file left


def test_free_port_never_hands_out_a_leased_port(tmp_path, monkeypatch):
    from stoker.stack import services

    monkeypatch.setenv("STOKER_PORT_LEASES", str(tmp_path))
    picked = {services.free_port() for _ in range(30)}
    assert len(picked) == 30
    assert all(port_lease.held(p) for p in picked)
