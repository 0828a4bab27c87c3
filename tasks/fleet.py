"""A fleet rollout as Prefect tasks: the fleet's preflight, then wave after wave of routed serve_host runs, halting
and switching back every host this run switched when one host fails (docs/serving.md#fleet)."""

from __future__ import annotations

import contextvars
import time
from concurrent.futures import ThreadPoolExecutor

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from stoker.errors import one_line
from stoker.orchestration.routing import check_route, run_routed
from stoker.run import RunContext, StepResult
from stoker.serving import fleet, front
from stoker.spec.schema import Spec
from stoker.storage import s3


@task(name="fleet-preflight", cache_policy=NO_CACHE, persist_result=False)
def fleet_preflight(spec: Spec) -> StepResult:
    """Every host's engine answers and is its own; every host's deployment exists with an online worker."""
    t0 = time.perf_counter()
    ids = fleet.check_engines(spec.fleet.hosts)
    workers = {}
    for h in spec.fleet.hosts:
        route = check_route(h.deployment, what=f"fleet host {h.name!r}")
        workers[h.name] = {"pool": route.pool, "workers": route.workers, "engine_id": ids[h.name]}
    get_run_logger().info("fleet preflight: " + "; ".join(f"{n}: engine {w['engine_id'][:12]}, pool {w['pool']}"
                                                          for n, w in workers.items()))
    return StepResult(name="fleet-preflight", duration_s=time.perf_counter() - t0, detail={"hosts": workers})


@task(name="fleet", cache_policy=NO_CACHE, persist_result=False)
def roll_fleet(spec: Spec, fetched: StepResult, uploaded: StepResult, ctx: RunContext) -> StepResult:
    """Wave by wave, each host drained at the front, rolled by its own serve_host run, then back to ready. A failed
    host halts the fleet: no later wave starts, each host this run switched is switched back to what it served
    before, and FleetError says which host failed, why, and who was switched back."""
    log = get_run_logger().info
    t0 = time.perf_counter()
    fl, name, st = spec.fleet, spec.deploy.name, spec.storage
    sha = (fetched.detail or {}).get("sha")
    pinned = spec.model_copy(update={"model": spec.model.model_copy(update={"revision": sha})}) if sha else spec
    before = {h.name: fleet.serving_now(h, name) for h in fl.hosts}
    folder = front.ensure(spec, ctx.home, log) if fl.front else None
    hosts = {h.name: {"wave": i, "status": "pending", "engine": h.docker_host, "before": before[h.name]["digest"],
                      "before_run": before[h.name]["run_id"], "after": None, "run_id": None}
             for i, wave in enumerate(fl.plan(), 1) for h in map(fl.host, wave)}
    measured: dict[str, dict] = {}  # host → its benchmark's detail, for the promote step

    def roll(host_name: str) -> None:
        h = fl.host(host_name)
        rec = hosts[host_name]
        run_id = f"{ctx.run_id}-{h.name}"
        rec.update(status="rolling", run_id=run_id)
        params = {"spec": fleet.host_spec(pinned, h).model_dump(mode="json"), "run_id": run_id, "host": h.name,
                  "digest": uploaded.digest, "standin": ctx.standin}
        rec["flow_run"] = _on_host(spec, h, params, f"serve-{name}-{h.name}-{ctx.run_id}", folder, rec, log)
        m = s3.get_json(s3.client(st), st, s3.run_manifest_key(st, run_id)) or {}
        switch = ((m.get("steps") or {}).get("switch") or {}).get("detail") or {}
        rec.update(status="switched", after=uploaded.digest, switch_s=switch.get("switch_s"),
                   retire_s=switch.get("retire_s"))
        measured[host_name] = ((m.get("steps") or {}).get("benchmark") or {}).get("detail") or {}

    waves, halt = _in_waves(fl, roll, log)
    if halt:
        bad, i, cause = halt
        reverted, not_reverted = _switch_back(spec, pinned, hosts, ctx, log)
        for n in (n for n, r in hosts.items() if r["status"] == "pending"):
            hosts[n]["status"] = "untouched"
        _record(ctx, {"hosts": hosts, "waves": waves, "digest": uploaded.digest})
        raise fleet.FleetError(fleet.halted(bad, i, cause, reverted, not_reverted))
    detail = {"hosts": hosts, "waves": waves, "digest": uploaded.digest,
              # promote_run reads the canary host's benchmark: the fleet's build as measured on a host.
              **_benchmark_of([measured[n] for w in fl.plan() for n in w if n in measured])}
    _record(ctx, detail)
    return StepResult(name="fleet", duration_s=time.perf_counter() - t0, digest=uploaded.digest, detail=detail)


@task(name="fleet-rollback-plan", cache_policy=NO_CACHE, persist_result=False)
def plan_fleet_rollback(spec: Spec, to_run: str | None) -> dict[str, dict]:
    """Per host: what it serves now and the host run to go back to, decided for every host before any host changes
    (a host with nowhere to go refuses the whole rollback, in one line, with nothing changed). ``to_run``: a fleet
    run's id (each host goes back to its own part of that run); None: each host goes back as `stoker rollback` would
    on that host alone, choosing among that host's own runs."""
    return fleet.fleet_rollback_plan(spec, to_run)


@task(name="fleet-rollback", cache_policy=NO_CACHE, persist_result=False)
def roll_back_fleet(spec: Spec, plan: dict[str, dict], ctx: RunContext, reason: str) -> StepResult:
    """Wave by wave, as a rollout goes, each host drained at the front and switched back by a rollback run on its
    own worker to the run ``plan`` names. A host that fails halts: no later wave starts, the hosts already back stay
    back (each serves a build that passed its gates), and FleetError names the host and both lists."""
    log = get_run_logger().info
    t0 = time.perf_counter()
    fl, name = spec.fleet, spec.deploy.name
    folder = front.ensure(spec, ctx.home, log) if fl.front else None
    hosts = {n: {"wave": i, "status": "pending", "engine": fl.host(n).docker_host, "after": None, **plan[n]}
             for i, wave in enumerate(fl.plan(), 1) for n in wave}

    def back(host_name: str) -> None:
        h, rec = fl.host(host_name), hosts[host_name]
        if rec["skip"]:
            rec.update(status="already serving", after=rec["to"])
            return
        rec["status"] = "rolling back"
        params = _rollback_params(spec, h, ctx, rec["to_run"], reason)
        rec["flow_run"] = _on_host(spec, h, params, f"rollback-{name}-{h.name}-{ctx.run_id}", folder, rec, log)
        rec.update(status="rolled back", after=rec["to"])

    waves, halt = _in_waves(fl, back, log)
    for n in (n for n, r in hosts.items() if r["status"] == "pending"):
        hosts[n]["status"] = "untouched"
    detail = {"hosts": hosts, "waves": waves}
    _record(ctx, detail)
    if halt:
        bad, i, cause = halt
        done = ", ".join(n for n, r in hosts.items() if r["status"] in ("rolled back", "already serving")) or "none"
        left = ", ".join(n for n, r in hosts.items() if r["status"] == "untouched") or "none"
        raise fleet.FleetError(f"fleet rollback: host {bad!r} failed in wave {i}: {cause}; back: {done}; "
                               f"untouched: {left}")
    return StepResult(name="fleet-rollback", duration_s=time.perf_counter() - t0, detail=detail)


def _on_host(spec: Spec, h, params: dict, run_name: str, folder, rec: dict, log) -> str:
    """One routed serve_host run on host ``h``'s worker, the host drained at the front meanwhile; ``rec`` gets its
    time, and the failure's one line if it fails (raised on)."""
    fl, began = spec.fleet, time.perf_counter()
    route = check_route(h.deployment, what=f"fleet host {h.name!r}")  # again: a worker may have gone
    # A wave of every host is not drained: the front would be left no host for new requests, while each host's own
    # proxy switches its clients without a gap anyway.
    if len(fl.plan()[rec["wave"] - 1]) == len(fl.hosts):
        folder = None
    if folder:
        front.set_state(folder, h.name, "drain")
    try:
        return run_routed(route, params, run_name, fl.start_timeout_s, fl.host_timeout_s, log)
    except BaseException as exc:
        rec.update(status="failed", error=one_line(exc) or type(exc).__name__)
        raise
    finally:
        rec["seconds"] = round(time.perf_counter() - began, 2)
        if folder:
            try:  # a host whose engine went is taken out by the front's health checks, not by this state
                front.set_state(folder, h.name, "ready")
            except Exception as exc:  # noqa: BLE001 - the verdict matters more
                log(f"fleet front: {h.name} not set back to ready: {one_line(exc)}")


def _in_waves(fl, act, log) -> tuple[list[dict], tuple[str, int, str] | None]:
    """``act(host)`` for the hosts of each wave at once, wave after wave, stopping after a wave where one failed:
    (each wave's record, (the first failed host, its wave, its one-line cause) or None)."""
    waves: list[dict] = []
    for i, wave in enumerate(fl.plan(), 1):
        w0 = time.perf_counter()
        log(f"fleet: wave {i}: {', '.join(wave)}")
        # The hosts of a batch go at once: each thread carries this flow run's context (run_deployment starts the
        # host's run as a subflow of it).
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            futures = {n: pool.submit(contextvars.copy_context().run, act, n) for n in wave}
            failed = {}
            for n, fut in futures.items():
                try:
                    fut.result()
                except Exception as exc:  # noqa: BLE001 - every host's cause is recorded; the first is reported
                    failed[n] = one_line(exc) or type(exc).__name__
        waves.append({"wave": i, "hosts": wave, "seconds": round(time.perf_counter() - w0, 2),
                      "status": "failed" if failed else "completed"})
        if failed:
            bad = next(iter(failed))
            return waves, (bad, i, failed[bad])
    return waves, None


def _switch_back(spec: Spec, pinned: Spec, hosts: dict, ctx: RunContext, log) -> tuple[list[str], dict[str, str]]:
    """Every host this run switched goes back to the run it served before (a routed rollback on its worker)."""
    reverted, not_reverted = [], {}
    for n, rec in hosts.items():
        if rec["status"] != "switched":
            continue
        if not rec["before_run"]:
            not_reverted[n] = "it served nothing before"
            continue
        h = spec.fleet.host(n)
        try:
            route = check_route(h.deployment, what=f"fleet host {n!r}")
            params = _rollback_params(pinned, h, ctx, rec["before_run"])
            run_routed(route, params, f"revert-{spec.deploy.name}-{n}-{ctx.run_id}", spec.fleet.start_timeout_s,
                       spec.fleet.host_timeout_s, log)
            rec.update(status="switched back", after=rec["before"])
            reverted.append(n)
        except Exception as exc:  # noqa: BLE001 - named in the run's one line
            rec.update(status="switch back failed", error=one_line(exc))
            not_reverted[n] = one_line(exc)
    return reverted, not_reverted


def _rollback_params(spec: Spec, h, ctx: RunContext, to_run: str, reason: str | None = None) -> dict:
    """serve_host's parameters for host ``h`` going back to run ``to_run`` (reason None: serve_host's own, a halted
    fleet run's)."""
    return {"spec": fleet.host_spec(spec, h).model_dump(mode="json"), "run_id": f"{ctx.run_id}-{h.name}",
            "host": h.name, "action": "rollback", "to_run": to_run, **({"reason": reason} if reason else {})}


def _benchmark_of(measured: list[dict]) -> dict:
    first = next((d for d in measured if d), {})
    return {"workload": first.get("workload"), "levels": first.get("levels", [])}


def _record(ctx: RunContext, detail: dict) -> None:
    """The fleet's per-host record beside the run's manifest (the fleet step's detail has it when it completes)."""
    import json

    from stoker.atomic import write_atomic

    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(ctx.run_dir / "fleet.json", json.dumps(detail, indent=1, default=str))
