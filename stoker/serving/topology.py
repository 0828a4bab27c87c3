"""What runs, what should, and what to repair: pure decisions over an observed deployment.

A deployment is consistent when its proxy runs and routes to exactly one backend that is
running and ready, and no other backend exists. Anything else (a candidate left by a killed
run, a backend that died, a proxy that died, wave-1 containers on the spec's ports) is
repaired to that state before a deploy, a rollback or a status report trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .haproxy import SLOTS, server_name
from ..containers.ports import Ports


@dataclass(frozen=True)
class Backend:
    container: str
    slot: str  # "" for a wave-1 container (no proxy in front of it)
    ports: Ports
    digest: str
    running: bool
    ready: bool
    created: tuple[str, int] = ("", 0)
    run_id: str = ""
    legacy: bool = False
    replica: int = 0  # deploy.replicas: 0 is the one the proxy's slot server names; 1.. its siblings
    members: tuple[Backend, ...] = ()  # the live backend's siblings (replicas 1..N-1), set by plan_repair
    # The proxy switched to this container once (deployment.SERVED_FILE): it passed its gates. A candidate left by a
    # killed run never did, so it is never made live in place of a routed backend that died.
    served: bool = False


@dataclass(frozen=True)
class ProxyView:
    """The proxy as observed: ``routes`` is the slot → backend http port it routes to now, if it answers."""

    exists: bool
    running: bool
    live: str | None = None  # the slot ready in every section
    http_ports: dict[str, int] = field(default_factory=dict)
    listen: Ports | None = None
    openai: bool | None = None  # whether the running proxy routes /v1/ to the OpenAI service (None: unknown)
    address: str | None = None  # the address it binds (None: unknown)
    front: str | None = None  # what it asks of clients (Target.front; None: unknown)


@dataclass(frozen=True)
class Repair:
    live: Backend | None
    remove: tuple[Backend, ...]
    proxy: str  # ok | start | create | recreate
    reroute: bool  # the proxy must be pointed at ``live`` (or away from a dead backend)
    why: str = ""  # why nothing serves although a backend runs (the endpoint answers 503)

    def actions(self) -> list[str]:
        """Human-readable list of what the repair changes (empty: already consistent)."""
        out = [f"remove {b.container} ({'wave-1 container' if b.legacy else 'not live' if b.running else 'stopped'})"
               for b in self.remove]
        if self.proxy != "ok":
            out.append(f"{self.proxy} the proxy")
        if self.reroute:
            out.append(f"route the proxy to {self.live.container}" if self.live else "route the proxy to nothing")
        if self.why:
            out.append(self.why)
        return out


def other_slot(slot: str | None) -> str:
    return "green" if slot == "blue" else "blue"


def routes_to(proxy: ProxyView, b: Backend) -> bool:
    """Whether the proxy routes to backend ``b`` now: it runs, its slot is the live one, and the proxy's server of
    that slot and replica points at its port (a slot's server can still name a retired backend's port). Pure; the
    one rule for "the backend that serves" (status, rollback, the fleet, a rebuild's GPU sets)."""
    return (proxy.running and b.running and b.slot == proxy.live
            and proxy.http_ports.get(server_name(b.slot, b.replica)) == b.ports.http)


def plan_repair(backends: list[Backend], proxy: ProxyView, listen: Ports, openai: bool | None = None,
                address: str | None = None, front: str | None = None) -> Repair:
    """The one consistent state to reach from what runs. Pure.

    The live backend is the one the proxy routes to while its container runs, even if a health
    probe just timed out (a saturated server answers slowly; removing it would take the endpoint
    down); else the newest running, ready backend that has served before (``served``: a proxy that
    died, or a routed backend that died). A backend that never served is a candidate that may not
    have passed its gates: it never becomes live here, and with nothing else the endpoint answers
    503 (``why`` says so). Every other backend goes. A proxy whose /v1/ route is not the one wanted (``openai``)
    is recreated: HAProxy reads its routes only at start.
    """
    routed = next((b for b in backends if b.replica == 0 and not b.legacy and routes_to(proxy, b)), None)
    serving = [b for b in backends if b.replica == 0 and b.running and b.ready and not b.legacy]
    live = routed or max((b for b in serving if b.served), key=lambda b: b.created, default=None)
    ungated = [b.container for b in serving if not b.served] if live is None else []
    why = (f"nothing that served before runs, and {', '.join(ungated)} never served (never known to have passed "
           "its gates): nothing serves, the endpoint answers 503" if ungated else "")
    # deploy.replicas: the live backend's running siblings (same slot, build and run) stay with it.
    members = tuple(sorted((b for b in backends if live is not None and b is not live and b.replica > 0 and b.running
                            and b.slot == live.slot and b.digest == live.digest and b.run_id == live.run_id),
                           key=lambda b: b.replica))
    remove = tuple(b for b in backends if b is not live and b not in members)
    if live is not None and members:
        live = replace(live, members=members)
    if not proxy.exists:
        action = "create"
    elif proxy.listen is not None and proxy.listen != listen:
        action = "recreate"  # the spec's ports changed
    elif address is not None and proxy.address is not None and proxy.address != address:
        action = "recreate"  # deploy.listen changed (or an older proxy bound every interface)
    elif front is not None and proxy.front is not None and proxy.front != front:
        action = "recreate"  # keys switched on or off, or TLS (its certificate): HAProxy reads them at start
    elif openai is not None and proxy.running and proxy.openai is not None and proxy.openai != openai:
        action = "recreate"  # the OpenAI route came (or went) with this version of stoker or the spec
    elif not proxy.running:
        action = "start"
    else:
        action = "ok"
    reroute = action != "ok" or (live is not None and routed is None) or (live is None and proxy.live is not None)
    return Repair(live=live, remove=remove, proxy=action, reroute=reroute, why=why)


def next_slot(live: Backend | None) -> str:
    """Where a candidate goes: the slot the live backend does not use."""
    return other_slot(live.slot) if live and live.slot in SLOTS else "blue"
