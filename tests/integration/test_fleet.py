"""A fleet of two serving hosts for real (tests/integration/fleet_kit.py): the default Docker engine ("east") and a
second dockerd ("west") on this machine, a Prefect process worker per host running serve_host, the front HAProxy
across the two. One kit, shared by the module's tests.

(1) build A rolled to both hosts in one wave (the two hosts' runs at once); then, under one held-out-style load through
the front: build B wave [east] then [west] (both hosts serve B), build D failing its accuracy gate on east in wave 1
(halted, west untouched, both still serve B; where the benchmark measures, see MEASURING), and `stoker rollback --fleet` taking both hosts back to A in one wave;
nothing failed or truncated in any phase; (2) west's engine stopped after wave 1 halts the next fleet
run: east is switched back to what it served before (A), west untouched, the run fails naming west, `stoker status --fleet` shows it; (3) the
preflight's refusals against real engines and a pool without a worker, one line each, before any heavy step.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from fleet_kit import FleetKit, parse, wait_for
from operate_helpers import ROOT, prefect_api, record  # noqa: F401
from stream_clients import BATCHED_ENV, PACE_ENV, load_process

# The load's per-request clients pause this long after each answer, except when benchmarks/fleet_rollout.py measures
# (STOKER_OPERATE_OUT set: back to back, the held-out load): in the parallel service tier the unpaced load took both
# cores from the other test processes for the whole rollout (ci75: the tier 2,612 s against ci74's 2,063 s). The
# streams stay as they are: a long-lived one 0.3 s apart, a busy one with no pause.
PACE_S = "0" if os.environ.get("STOKER_OPERATE_OUT") else "0.5"

# The module fixture below runs four fleet runs under load (first run to its end: ~540 s alone on this machine, over
# 900 s in the parallel tier of ci77), and pytest-timeout counts a fixture's setup in its first test.
pytestmark = [pytest.mark.prefect, pytest.mark.docker, pytest.mark.s3, pytest.mark.hub, pytest.mark.slow,
              pytest.mark.timeout(1800)]
# The failed-gate run (build D: an evaluation with a torch baseline and lm-eval on a host) runs where the benchmark
# measures (benchmarks/fleet_rollout.py, STOKER_OPERATE_OUT set), not in the parallel service tier: in ci77 the CPU of
# the whole module slowed three other files past their limits. Its test says so when it does not run.
MEASURING = bool(os.environ.get("STOKER_OPERATE_OUT"))


@pytest.fixture(scope="module")
def kit(prefect_api, local_stack, triton_image, tmp_path_factory):  # noqa: F811
    from stoker.spec.schema import Deploy

    api, state = prefect_api
    k = FleetKit(api, state, local_stack, tmp_path_factory.mktemp("fleet"))
    try:
        k.start([triton_image, Deploy().proxy_image])
        yield k
    finally:
        k.stop()  # the workers stop with the Prefect stack (prefect_api's stop_all)


@pytest.fixture(scope="module")
def rolled(kit):
    """Build A on both hosts in one wave; then, under one load through the front: build B wave [east] then [west],
    build D whose accuracy gate fails on east in wave 1, and `stoker rollback --fleet` taking both hosts back to A in
    one wave. Each phase's start and end, for the load's records."""
    name = f"fl-{uuid.uuid4().hex[:6]}"
    a = kit.spec(name, threads=1)
    b = json.loads(json.dumps(a))
    b["triton"] = {"model_threads": 2}
    # D: another build whose evaluation gate cannot pass (an lm-eval task score of 1.0 from a tiny random model);
    # perplexity and agreement are not judged, so the task's score alone fails it.
    d = json.loads(json.dumps(b))
    d["triton"] = {"model_threads": 4}
    d["evaluation"] = {"enabled": True, "max_perplexity_rise_pct": None, "min_greedy_agreement": None,
                       "lm_eval": {"task": "stoker_cloze", "limit": 4, "min_score": 1.0}}
    a["fleet"]["waves"] = [["east", "west"]]  # the first rollout and the rollback: both hosts in one wave
    back = kit.tmp / f"{name}-fleet.yaml"
    back.write_text(json.dumps(a))
    phases: dict[str, list[float]] = {}
    try:
        first = kit.run(a)
        assert first["ok"], first.get("error", "") + first["log"][-5000:]
        # The demo spec's ensemble batches (max_batch_size 8) and streams only when asked: the load's clients send
        # [1, 1] and stream=true (the spawned load process reads these at each request).
        os.environ[BATCHED_ENV] = "1"
        os.environ[PACE_ENV] = PACE_S
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        out = kit.tmp / "load.json"
        front = a["fleet"]["front"]
        loader = ctx.Process(target=load_process, args=({"http": f"http://127.0.0.1:{front['http']}",
                                                         "grpc": f"127.0.0.1:{front['grpc']}"}, stop, str(out), ready))
        loader.start()
        ready.wait(60)
        time.sleep(2)
        t = time.time()
        second = kit.run(b)
        phases["rollout"] = [t, time.time()]
        after = {"rollout": kit.serving(b)}
        gated = None
        if MEASURING:
            runs = kit.tmp / "home-fleet" / "runs"
            known = set(runs.iterdir())
            gated = kit.run(d)
            phases["failed_gate"] = [phases["rollout"][1], time.time()]
            after["failed_gate"] = kit.serving(d)
            gated["run_dir"] = next(iter(set(runs.iterdir()) - known), None)
        t = time.time()
        r = subprocess.run([sys.executable, "-m", "stoker.cli", "rollback", name, "--fleet", str(back)], cwd=ROOT,
                           env={**os.environ, **kit.env, "STOKER_HOME": str(kit.tmp / "home-fleet")},
                           capture_output=True, text=True, timeout=900)
        phases["rollback"] = [t, time.time()]
        time.sleep(1)
        stop.set()
        loader.join(120)
        yield {"name": name, "a": a, "b": b, "d": d, "first": first, "second": second, "gated": gated,
               "rollback": r, "phases": phases, "after": after, "load": json.loads(out.read_text())}
    finally:
        os.environ.pop(BATCHED_ENV, None)
        os.environ.pop(PACE_ENV, None)
        kit.cleanup(name)


def _summary(records: list) -> dict:
    """Requests, failed and truncated per client kind."""
    return {k: {"requests": sum(1 for r in records if r[0] == k),
                "failed": sum(1 for r in records if r[0] == k and not r[3] and not r[4]),
                "truncated": sum(1 for r in records if r[0] == k and r[4])} for k in sorted({r[0] for r in records})}


def test_a_fleet_rolls_wave_by_wave_under_load_through_the_front_losing_nothing(kit, rolled):
    first, second = rolled["first"], rolled["second"]
    digest_a = first["manifest"]["steps"]["upload"]["digest"]
    assert second["ok"], second.get("error", "") + second["log"][-5000:]
    digest_b = second["manifest"]["steps"]["upload"]["digest"]
    assert digest_a != digest_b
    # The first rollout's one wave ran both hosts' runs at once: the wave took less than the two runs one after
    # the other would have.
    one = first["manifest"]["fleet"]
    assert [w["hosts"] for w in one["waves"]] == [["east", "west"]], one["waves"]
    assert all(one["hosts"][h]["status"] == "switched" and one["hosts"][h]["after"] == digest_a for h in ("east", "west"))
    host_s = [one["hosts"][h]["seconds"] for h in ("east", "west")]
    assert one["waves"][0]["seconds"] < sum(host_s), (one["waves"], host_s)
    fleet = second["manifest"]["fleet"]
    assert [w["hosts"] for w in fleet["waves"]] == [["east"], ["west"]]
    for h in ("east", "west"):
        rec = fleet["hosts"][h]
        assert rec["status"] == "switched" and rec["before"] == digest_a and rec["after"] == digest_b, rec
        assert rec["switch_s"] is not None and rec["retire_s"] is not None, rec
    serving = rolled["after"]["rollout"]
    assert {h: s["digest"] for h, s in serving.items()} == {"east": digest_b, "west": digest_b}, serving
    # The build ran once: each host's run found every heavy step in the shared cache.
    for h in ("east", "west"):
        hm = json.loads((kit.homes[h] / "runs" / fleet["hosts"][h]["run_id"] / "manifest.json").read_text())
        assert hm["steps"]["build"]["layer"] in ("remote", "local"), hm["steps"]["build"]
    record("rollout", {  # benchmarks/fleet_rollout.py reads these
        "first_run_s": round(first["s"], 1), "second_run_s": round(second["s"], 1),
        "first_wave": {"hosts": one["waves"][0]["hosts"], "wave_s": one["waves"][0]["seconds"], "host_s": host_s},
        "waves": fleet["waves"], "hosts": {h: {k: fleet["hosts"][h].get(k) for k in
                                                ("wave", "status", "switch_s", "retire_s", "seconds", "run_id")}
                                            for h in ("east", "west")}})


def test_a_failed_gate_halts_the_fleet_in_its_wave_and_the_candidate_never_serves(kit, rolled):
    gated, digest_b = rolled["gated"], rolled["second"]["manifest"]["steps"]["upload"]["digest"]
    if gated is None:
        pytest.skip("the failed-gate run runs in benchmarks/fleet_rollout.py (STOKER_OPERATE_OUT), not in the "
                    "parallel service tier (see MEASURING)")
    assert not gated["ok"], gated["log"][-3000:]
    err = gated["error"]
    assert "fleet: host 'east' failed in wave 1" in err and "switched back: none" in err, err
    assert "stoker_cloze" in err and "is below 1" in err, err  # the accuracy gate's own cause
    assert "\n" not in err
    serving = rolled["after"]["failed_gate"]
    assert {h: s["digest"] for h, s in serving.items()} == {"east": digest_b, "west": digest_b}, serving
    m = json.loads((gated["run_dir"] / "fleet.json").read_text())
    assert m["hosts"]["east"]["status"] == "failed" and m["hosts"]["west"]["status"] == "untouched", m["hosts"]
    assert [w["status"] for w in m["waves"]] == ["failed"], m["waves"]
    east = json.loads((kit.homes["east"] / "runs" / m["hosts"]["east"]["run_id"] / "manifest.json").read_text())
    assert east["steps"]["evaluate"]["status"] == "failed" and "switch" not in east["steps"], east["steps"].keys()
    record("failed_gate", {"run_s": round(gated["s"], 1), "error": err, "hosts": {
        h: {k: m["hosts"][h].get(k) for k in ("wave", "status", "seconds")} for h in ("east", "west")},
        "waves": m["waves"], "serving_after": {h: serving[h]["digest"] for h in ("east", "west")}, "b": digest_b})


def test_stoker_rollback_fleet_takes_every_host_back_in_one_wave(kit, rolled):
    r, name = rolled["rollback"], rolled["name"]
    digest_a = rolled["first"]["manifest"]["steps"]["upload"]["digest"]
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    lines = {ln.split(":", 1)[0]: ln for ln in r.stdout.splitlines() if ln.startswith(("east:", "west:"))}
    assert set(lines) == {"east", "west"}, r.stdout
    for h, line in lines.items():
        assert f"rolled back, serving {digest_a[:12]}" in line, line
    serving = kit.serving(rolled["a"])
    assert {h: s["digest"] for h, s in serving.items()} == {"east": digest_a, "west": digest_a}, serving
    # Refused in one line, nothing changed: a fleet run that never served.
    again = subprocess.run([sys.executable, "-m", "stoker.cli", "rollback", name, "--fleet",
                            str(kit.tmp / f"{name}-fleet.yaml"), "--to", "20000101T000000-nope00"], cwd=ROOT,
                           env={**os.environ, **kit.env, "STOKER_HOME": str(kit.tmp / "home-fleet")},
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "fleet rollback: host 'east'" in again.stderr, again.stderr[-2000:]
    assert "nothing changed" in again.stderr and len(again.stderr.strip().splitlines()) == 1, again.stderr
    assert {h: s["digest"] for h, s in kit.serving(rolled["a"]).items()} == {"east": digest_a, "west": digest_a}
    runs = sorted((kit.tmp / "home-fleet" / "runs").glob("*/fleet.json"), key=lambda p: p.stat().st_mtime)
    detail = json.loads(runs[-1].read_text())
    record("rollback", {"run_s": round(rolled["phases"]["rollback"][1] - rolled["phases"]["rollback"][0], 1),
                        "waves": detail["waves"], "hosts": {h: {k: detail["hosts"][h].get(k) for k in
                                                                 ("wave", "status", "seconds", "to_run")}
                                                             for h in ("east", "west")}})


def test_the_load_through_the_front_lost_nothing_in_any_phase(kit, rolled):
    """The one load ran through the rollout, the failed-gate wave and the rollback."""
    records = rolled["load"]["records"]
    assert len(records) > 50, len(records)
    assert {r[0] for r in records} >= {"grpc", "grpc-busy", "grpc-long", "http"}, {r[0] for r in records}
    truncated = [r for r in records if r[4]]
    failed = [r for r in records if not r[3] and not r[4]]
    # HTTP-SSE through the front: every answer whole, none failed.
    http = [r for r in records if r[0] == "http"]
    assert http and not [r for r in http if not r[3]], [r for r in http if not r[3]][:3]
    # gRPC: no answer truncated (each whole answer is 4 responses); no request of a stream per request failed; each
    # long-lived stream (busy, paused) was refused at most once per host switch before any answer, as on one host
    # (docs/serving.md#long-lived-streams): 2 switches in the rollout and 2 in the rollback.
    assert not truncated, truncated[:3]
    errored = [r for r in records if r[0] != "http" and r[5]]
    assert not [r for r in errored if r[0] == "grpc"], [r for r in errored if r[0] == "grpc"][:3]
    for kind in ("grpc-busy", "grpc-long"):
        assert len([r for r in errored if r[0] == kind]) <= 4, [r for r in errored if r[0] == kind][:3]
    phases = {k: _summary([r for r in records if t0 <= r[1] < t1]) for k, (t0, t1) in rolled["phases"].items()}
    record("load", {"pace_s": float(PACE_S), "requests": len(records), "failed": len(failed),
                    "truncated": len(truncated), "by_client": _summary(records), "by_phase": phases,
                    "long_stream_reconnects": rolled["load"]["long_stream"],
                    "busy_stream_reconnects": rolled["load"]["busy_stream"]})


def test_a_host_lost_mid_fleet_halts_it_and_switches_back_what_rolled(kit, rolled):
    b = rolled["b"]
    digest_a = rolled["first"]["manifest"]["steps"]["upload"]["digest"]
    c = json.loads(json.dumps(b))
    c["triton"] = {"model_threads": 3}
    before = {p.name for p in (kit.homes["east"] / "runs").glob("*")}
    proc = kit.run(c, background=True)
    try:
        # Wave 1 done (east's run wrote its manifest): west's engine goes away before wave 2 reaches it.
        wait_for(lambda: any(p.name.endswith("-east") and (p / "manifest.json").exists()
                             for p in (kit.homes["east"] / "runs").glob("*") if p.name not in before),
                 600, "east's host run")
        kit.stop_west()
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    res = parse(out)
    assert not res["ok"], res["log"][-3000:]
    assert "fleet: host 'west' failed in wave 2" in res["error"] and "switched back: east" in res["error"], res["error"]
    serving = kit.serving(c)
    assert serving["east"]["digest"] == digest_a, serving  # what it served before: A, since the fleet rollback
    assert serving["west"]["health"] == "engine down", serving
    record("host_lost", {"run_s": round(res["s"], 1), "error": res["error"], "east_after": serving["east"]["digest"],
                         "east_back": serving["east"]["digest"] == digest_a})
    spec_file = kit.tmp / "fleet-c.yaml"
    spec_file.write_text(json.dumps(c))
    r = subprocess.run([sys.executable, "-m", "stoker.cli", "status", "--fleet", str(spec_file)], cwd=ROOT,
                       env={**os.environ, **kit.env, "STOKER_HOME": str(kit.tmp / "home-fleet")}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {ln.split(":", 1)[0].strip(): ln for ln in r.stdout.splitlines() if ln.strip().startswith(("east", "west"))}
    assert digest_a[:12] in lines["east"] and "ready" in lines["east"], r.stdout
    assert "engine down" in lines["west"], r.stdout
    kit.start_west()  # the later tests' west again
    wait_for(lambda: kit.serving(c)["west"]["health"] != "engine down", 60, "west's engine back")


def test_the_fleet_preflight_refuses_bad_hosts_in_one_line_before_heavy_work(kit, rolled):
    a = rolled["a"]
    dead = json.loads(json.dumps(a))
    dead["fleet"]["hosts"][1]["docker_host"] = "unix:///tmp/stoker-no-such-engine.sock"
    link = Path(f"/tmp/stk-same-{uuid.uuid4().hex[:6]}.sock")
    link.symlink_to((kit.east.removeprefix("unix://")))
    same = json.loads(json.dumps(a))
    same["fleet"]["hosts"][1]["docker_host"] = f"unix://{link}"
    noworker = json.loads(json.dumps(a))
    noworker["fleet"]["hosts"][1]["deployment"] = "serve_host/nowhere"
    try:
        for data, says in ((dead, "fleet host 'west': engine unix:///tmp/stoker-no-such-engine.sock does not answer"),
                           (same, "fleet hosts 'east' and 'west' are the same Docker engine"),
                           (noworker, "fleet host 'west': deployment 'serve_host/nowhere' is not registered")):
            out = kit.run(data, home=kit.tmp / "home-refused", timeout=180)
            assert not out["ok"] and says in out["error"], out.get("error")
            assert "\n" not in out["error"]
            assert out["s"] < 90, out["s"]  # refused at preflight: nothing fetched or built
    finally:
        link.unlink()
