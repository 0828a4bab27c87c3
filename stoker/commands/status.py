"""`stoker status [NAME]`: each deployment's stable endpoint, live backend, health and uptime. Read-only."""

from __future__ import annotations

import time
from datetime import datetime

from ..errors import StokerError


NONE_HERE = "no stoker deployments on this host"


class UnknownDeployment(StokerError):
    """No container of that deployment exists."""


def _uptime(started: str) -> str:
    try:
        t = datetime.fromisoformat(started[:26].rstrip("Z") + "+00:00" if "." in started else started)
        s = int(time.time() - t.timestamp())
    except ValueError:
        return "?"
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def describe(client, name: str) -> dict:
    """What runs for deployment ``name``: proxy, the slot it routes to, and every backend."""
    from ..containers import engine
    from ..run import stoker_home
    from ..serving import openai_service, promote, topology
    from ..containers.ports import Ports

    proxy_c = promote.proxy_container(client, name)
    listen = Ports.parse(proxy_c.labels[engine.LABEL_PORTS]) if proxy_c is not None else None
    target = promote.Target(name, listen or Ports(0, 0, 0), "", stoker_home() / "proxy" / name)
    view, _ = promote.observe_proxy(client, target)
    by_name = {c.name: c for c in engine.containers(client, name, role=engine.ROLE_BACKEND)}
    backends = []
    for b in promote.observe_backends(client, name):
        c = by_name.get(b.container)
        backends.append({"container": b.container, "slot": b.slot, "ports": b.ports.label(), "digest": b.digest,
                         "run_id": b.run_id, "state": c.status if c is not None else "?",
                         "health": "ready" if b.ready else "not ready",
                         "live": topology.routes_to(view, b),
                         "uptime": _uptime(engine.started_at(c)) if c is not None and b.running else "-",
                         # GPU targets: the device ids it holds; the stand-in says so (stoker/gpu/standin.py)
                         "gpus": (c.labels.get("ai.stoker.gpus") if c is not None else None) or None,
                         "standin": c is not None and c.labels.get("ai.stoker.gpu.standin") == "true"})
    live = next((b for b in backends if b["live"]), None)
    service = openai_service.container(client, name)
    # What listens where: the proxy on its deploy.listen address (older proxies: every interface), every
    # backend on loopback (it runs with host networking).
    address = proxy_c.labels.get(engine.LABEL_ADDRESS, "0.0.0.0") if proxy_c is not None else None
    for b in backends:
        b["listen"] = engine.BACKEND_ADDRESS
    # What it asks of clients (its label): open, keys, tls:<digest>; never the keys.
    front = proxy_c.labels.get(engine.LABEL_FRONT, "open") if proxy_c is not None else None
    asks = None if front is None else promote.Target.asks(front)
    endpoint = target.endpoint if listen else None
    if endpoint and front and "tls:" in front:
        endpoint = {k: v.replace("http://", "https://") for k, v in endpoint.items()}
    return {"name": name, "endpoint": endpoint, "listen": address, "asks": asks,
            "proxy": ("running" if view.running else "down") if view.exists else "missing",
            "proxy_uptime": _uptime(engine.started_at(proxy_c)) if proxy_c is not None and view.running else "-",
            "live_digest": live["digest"] if live else None, "run_id": live["run_id"] if live else None,
            "openai": service.status if service is not None else "none", "backends": backends}


def deployment_names(client) -> list[str]:
    """Every deployment stoker started on this daemon (its containers carry stoker's managed label)."""
    from ..containers import engine

    return sorted({c.labels.get(engine.LABEL_DEPLOYMENT, "") for c in engine.containers(client)} - {""})


def unknown_message(name: str, known: list[str]) -> str:
    """The one line for a name no stoker container carries; it lists the known ones so the next try is right."""
    return f"unknown deployment {name!r} (deployments here: {', '.join(known) or 'none'})"


def require_known(client, name: str) -> None:
    names = deployment_names(client)
    if name not in names:
        raise UnknownDeployment(unknown_message(name, names))


def status(name: str | None) -> list[dict]:
    from ..containers import engine

    client = engine.connect(None)
    if name is not None:
        require_known(client, name)
    return [describe(client, n) for n in ([name] if name is not None else deployment_names(client))]


class BadWatch(StokerError):
    """--watch without one deployment, or a useless interval."""


def _watch(args) -> int:
    from ..containers import engine
    from . import status_watch

    if args.name is None:
        raise BadWatch("--watch needs one deployment: stoker status NAME --watch")
    args.interval = status_watch.DEFAULT_INTERVAL_S if args.interval is None else args.interval
    if not args.interval > 0:
        raise BadWatch(f"--interval must be more than 0 seconds (got {args.interval:g})")
    require_known(engine.connect(None), args.name)
    return status_watch.watch(args.name, args.interval, args.exit_on_alert)


def fleet_status(spec_path: str) -> list[dict]:
    """Host by host, for a spec with `fleet:`: its engine, what it serves (run, digest, health) and the front's state
    of it. A host whose engine does not answer is a line saying so, not an error."""
    from ..run import stoker_home
    from ..serving import fleet, front
    from ..spec.load import load_spec

    spec = load_spec(spec_path)
    if spec.fleet is None:
        raise StokerError(f"{spec_path}: no fleet section (stoker status --fleet reads a fleet spec)")
    states = front.states(front.state_dir(stoker_home(), spec)) if spec.fleet.front else {}
    return [{"host": h.name, "engine": h.docker_host, **fleet.serving_now(h, spec.deploy.name),
             "front": states.get(h.name, "-" if not spec.fleet.front else "?")} for h in spec.fleet.hosts]


def _print_fleet(spec_path: str) -> int:
    for h in fleet_status(spec_path):
        print(f"{h['host']}: engine {h['engine']}, "
              + (f"engine down ({h['engine_error']})" if h.get("engine_error") else
                 f"live digest {(h['digest'] or 'none')[:12]}, run {h['run_id'] or '-'}, {h['health']}, "
                 f"proxy {h['proxy']}") + f", front {h['front']}")
    return 0


def _handler(args) -> int:
    if args.fleet:
        return _print_fleet(args.fleet)
    if args.watch:
        return _watch(args)
    if args.exit_on_alert or args.interval is not None:
        raise BadWatch("--interval and --exit-on-alert go with --watch")
    found = status(args.name)
    if not found:
        print(NONE_HERE)
    for d in found:
        ep = d["endpoint"]
        where = f" listening on {d['listen']}" + (" (every interface)" if d["listen"] == "0.0.0.0" else "") \
            + f", asking {d['asks']}" if d.get("listen") else ""
        print(f"{d['name']}: {ep['http'] + ' (gRPC ' + ep['grpc'] + ')' if ep else 'no stable endpoint'}{where}, "
              f"proxy {d['proxy']} (up {d['proxy_uptime']}), live digest {(d['live_digest'] or 'none')[:12]}, "
              f"run {d['run_id'] or '-'}, OpenAI API {d['openai']}")
        for b in d["backends"]:
            print(f"  {'*' if b['live'] else ' '} {b['container']:<28} slot {b['slot'] or '-':<5} "
                  f"{b['listen']} ports {b['ports']:<17} "
                  f"digest {b['digest'][:12]:<12} {b['state']:<8} {b['health']:<9} up {b['uptime']}"
                  + (f" GPUs {b['gpus']}" if b.get("gpus") else "")
                  + (" STAND-IN (not TensorRT-LLM)" if b.get("standin") else ""))
    return 0


def register(sub) -> None:
    p = sub.add_parser("status", help="stable endpoint, live backend, health and uptime of each deployment stoker "
                                      "started on this host")
    p.add_argument("name", nargs="?", default=None, help="one deployment (default: all)")
    p.add_argument("--fleet", default=None, metavar="SPEC",
                   help="a spec with fleet: show each host (engine, live run and digest, health, the front's state)")
    p.add_argument("--watch", action="store_true",
                   help="keep polling NAME and print a timestamped line per change: a backend down or exited, the "
                        "proxy not running, a rollback, the live build changing, a failed poll (Ctrl-C stops, "
                        "status 0); also Prefect events when PREFECT_API_URL is set")
    p.add_argument("--interval", type=float, default=None, metavar="S",
                   help="with --watch: seconds between polls (default 5)")
    p.add_argument("--exit-on-alert", action="store_true",
                   help="with --watch: stop at the first ALERT with exit status 3 (scripts, cron)")
    p.set_defaults(fn=_handler)
