"""A fleet of serving hosts (spec `fleet:`): each host's one-host spec, what each host serves now, the preflight's
checks of the engines, and the one-line verdict of a halted fleet.

The rollout itself (drain at the front, a routed serve_host run per host, switch back on failure) is Prefect's
work: tasks/fleet.py and flows/serve_host.py. This module talks to the hosts' Docker engines only.
"""

from __future__ import annotations

from pathlib import Path

from ..containers import engine
from ..containers.ports import Ports
from ..errors import StokerError, one_line
from ..spec.fleet import Host
from ..spec.schema import Spec
from . import deployment


class FleetError(StokerError):
    """A fleet refused at preflight, or halted by a host that failed."""


def host_spec(spec: Spec, host: Host) -> Spec:
    """The one-host spec a host's serve_host run deploys: its engine, its stable ports, no fleet. Pure."""
    ports = spec.deploy.ports if host.ports is None else spec.deploy.ports.model_copy(update=host.ports.model_dump())
    deploy = spec.deploy.model_copy(update={"docker_host": host.docker_host, "ports": ports})
    return spec.model_copy(update={"deploy": deploy, "fleet": None})


def engine_id(host: Host, timeout_s: int = 10) -> str:
    """Who the engine is: `docker info`'s ID, with its host name and data root. The ID alone is not enough: Docker
    before 23 derives it from /etc/docker/key.json, which every daemon of one machine shares (seen here: the second
    dockerd answered the default one's ID), and two daemons never share a data root. FleetError naming the host
    when it does not answer."""
    try:
        info = engine.connect(host.docker_host, timeout_s=timeout_s).info()
        return f"{info['ID']}@{info.get('Name', '')}:{info.get('DockerRootDir', '')}"
    except Exception as exc:  # noqa: BLE001 - any failure to answer is the one line below
        raise FleetError(f"fleet host {host.name!r}: engine {host.docker_host} does not answer: {one_line(exc)}") \
            from None


def check_engines(hosts: list[Host]) -> dict[str, str]:
    """Every host's engine answers, and no two hosts are one engine; returns host → engine ID."""
    ids: dict[str, str] = {}
    for h in hosts:
        ident = engine_id(h)
        twin = next((n for n, i in ids.items() if i == ident), None)
        if twin is not None:
            raise FleetError(f"fleet hosts {twin!r} and {h.name!r} are the same Docker engine ({ident}): "
                             "each host needs an engine of its own")
        ids[h.name] = ident
    return ids


def serving_now(host: Host, name: str) -> dict:
    """What the host's proxy routes to now: {"run_id", "digest", "health", "proxy", "engine_error"}; engine_error:
    the one-line cause when the engine does not answer (health "engine down")."""
    try:
        client = engine.connect(host.docker_host, timeout_s=10)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - a host that does not answer is reported, not raised
        return {"run_id": None, "digest": None, "health": "engine down", "proxy": "-", "engine_error": one_line(exc)}
    proxy = deployment.proxy_container(client, name)
    listen = Ports.parse(proxy.labels[engine.LABEL_PORTS]) if proxy is not None else Ports(0, 0, 0)
    target = deployment.Target(name, listen, "", Path("/nonexistent"))
    view, _ = deployment.observe_proxy(client, target)
    live = deployment.routed_backend(client, target)
    return {"run_id": live.run_id if live else None, "digest": live.digest if live else None,
            "health": ("ready" if live.ready else "not ready") if live else "nothing live",
            "proxy": ("running" if view.running else "down") if view.exists else "missing", "engine_error": None}


def halted(host: str, wave: int, cause: str, reverted: list[str], failed_reverts: dict[str, str]) -> str:
    """The fleet run's one-line failure. Pure."""
    back = ", ".join(reverted) or "none"
    line = f"fleet: host {host!r} failed in wave {wave}: {cause}; switched back: {back}"
    for name, why in failed_reverts.items():
        line += f"; NOT switched back: {name} ({why})"
    return line


def fleet_rollback_plan(spec, to_run: str | None) -> dict[str, dict]:
    """fleet_plan from what each host of ``spec``'s fleet serves now and the fleet's runs in its bucket; a host whose
    engine does not answer refuses it in one line."""
    from ..record.history import remote_manifests
    from ..record.returnable import RollbackError, fleet_plan
    from ..storage import s3

    serving = {}
    for h in spec.fleet.hosts:
        now = serving_now(h, spec.deploy.name)
        if now["health"] == "engine down":
            raise RollbackError(f"fleet rollback: host {h.name!r}: its engine does not answer ({now['engine_error']}); "
                                "nothing changed")
        serving[h.name] = now["digest"]
    st = spec.storage
    return fleet_plan(remote_manifests(s3.client(st), st), spec.deploy.name, serving, to_run)
