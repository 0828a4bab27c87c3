"""Port leases: a port one pick holds is refused to every other pick of the host (processes racing included) for as
long as the picker lives or until it releases it, in a folder of its user's own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stoker.containers import port_lease

HOLD = ("import sys, time\nfrom pathlib import Path\nfrom stoker.containers import port_lease\n"
        "ok = port_lease.claim(int(sys.argv[1]), folder=Path(sys.argv[2]))\nprint('won' if ok else 'lost', flush=True)\n"
        "time.sleep(float(sys.argv[3]))\n")


def _holder(port: int, folder, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLD, str(port), str(folder), str(seconds)], stdout=subprocess.PIPE,
                            text=True)


def test_a_held_port_is_refused_until_its_holder_releases_it_or_ends(tmp_path):
    assert not port_lease.held(24001, folder=tmp_path)
    assert port_lease.claim(24001, folder=tmp_path)
    assert port_lease.held(24001, folder=tmp_path)
    assert not port_lease.claim(24001, folder=tmp_path)  # a second pick, even of this process
    assert port_lease.claim(24002, folder=tmp_path)  # its neighbour is not affected
    other = _holder(24001, tmp_path, 0)
    assert other.communicate(timeout=60)[0].strip() == "lost"  # another process while this one holds it
    port_lease.release(24001, folder=tmp_path)
    assert not port_lease.held(24001, folder=tmp_path)

    holder = _holder(24003, tmp_path, 30)
    assert holder.stdout.readline().strip() == "won"
    assert port_lease.held(24003, folder=tmp_path) and not port_lease.claim(24003, folder=tmp_path)
    holder.kill()  # a picker that dies: its lease ends with it, whatever time it had meant to hold it
    holder.wait(timeout=30)
    assert not port_lease.held(24003, folder=tmp_path) and port_lease.claim(24003, folder=tmp_path)
    for port in (24002, 24003):
        port_lease.release(port, folder=tmp_path)


def test_pickers_racing_for_one_port_get_it_once(tmp_path):
    racers = [_holder(24010, tmp_path, 3) for _ in range(6)]
    answers = sorted(r.communicate(timeout=120)[0].strip() for r in racers)
    assert answers == ["lost"] * 5 + ["won"]


def test_leases_live_in_stoker_home_in_a_folder_of_the_users_own(tmp_path, monkeypatch):
    monkeypatch.delenv("STOKER_PORT_LEASES", raising=False)
    monkeypatch.setenv("STOKER_HOME", str(tmp_path / "home"))
    assert port_lease.claim(24020)
    folder = tmp_path / "home" / "port-leases"
    assert (folder / "24020").is_file() and oct(folder.stat().st_mode & 0o777) == "0o700"
    port_lease.release(24020)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # others may write it: their files could stand for leases
    with pytest.raises(PermissionError, match="writable by it alone"):
        port_lease.claim(24021, folder=shared)


def test_free_port_never_hands_out_a_leased_port(tmp_path, monkeypatch):
    from stoker.stack import services

    monkeypatch.setenv("STOKER_PORT_LEASES", str(tmp_path))
    picked = {services.free_port() for _ in range(30)}
    assert len(picked) == 30
    assert all(port_lease.held(p) for p in picked)
    for p in picked:
        port_lease.release(p)
