"""The steps of a promotion behind a stable endpoint: reconcile, stage, switch, watch, retire.

    reconcile  read what runs (labels, the proxy's runtime state) and repair it to one live backend
    stage      start a candidate on the free slot, on verified ports; ready, settled, smoke-tested
    (gates)    the caller benchmarks/evaluates the candidate directly, before it gets traffic
    switch     the proxy sends new requests to the candidate; the old backend drains, stays warm
    watch      health, liveness and error rate of the new backend; on a fault, switch back
    retire     the old backend goes once its requests are done

Nothing here decides by port arithmetic: slots and ports come from ``topology`` and ``ports``,
routing from ``haproxy``, containers from ``docker_engine``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
import requests

from ..containers import engine
from ..protocol import by_layout
from . import api_keys, haproxy, openai_service, probe, topology, traffic, triton_log
from .retire import retire
from .deployment import (TLS_NAME, BackendRef, Log, PromotionFailed, Target, keys_file, observe_backends,
                         observe_proxy, proxy_container, runtime_for, sync_config, write_config)
from .deployment import mark_served, served_ids  # h1: which backends have served (plan_repair)
from ..atomic import write_atomic
from ..containers import port_lease
from ..containers.ports import Ports, address_missing, choose_backend_ports, is_port_free, port_owner

PROXY_START_TIMEOUT_S = 15.0
# A port verified free can still be taken before Triton binds it, and the python backend can abort at start
# (triton_log.IPC_ABORT): either way the candidate starts again, on other ports, while the live backend serves.
START_ATTEMPTS = 3


# ---------------------------------------------------------------- reconcile


def reconcile(client: docker.DockerClient, target: Target, log: Log) -> topology.Backend | None:
    """Repair the deployment to one consistent state; returns the live backend (None: nothing serves)."""
    backends = observe_backends(client, target.name, served_ids(target.state_dir))  # h1: served before
    remove_stale_proxies(client, target, log)
    view, proxy_c = observe_proxy(client, target)
    repair = topology.plan_repair(backends, view, target.listen, openai=bool(target.openai_image),
                                  address=target.address, front=target.front)
    for action in repair.actions():
        log(f"reconcile {target.name}: {action}")
    by_name = {c.name: c for c in engine.containers(client, target.name, role=engine.ROLE_BACKEND)}
    for b in repair.remove:
        if b.container in by_name:
            engine.stop_and_remove(by_name[b.container], log)
    live = repair.live
    slots = {live.slot: [live.ports, *(m.ports for m in live.members)]} if live else {}
    if repair.proxy == "recreate" and proxy_c is not None and proxy_c.status == "running":
        handover(client, target, proxy_c, slots, live.slot if live else None, log)
    elif repair.proxy in ("create", "recreate", "start"):
        if proxy_c is not None and repair.proxy == "recreate":
            engine.stop_and_remove(proxy_c, log)
            proxy_c = None
        write_config(target, slots, live.slot if live else None)
        if proxy_c is not None and repair.proxy == "start":
            try:
                proxy_c.start()
            except docker.errors.APIError:
                engine.stop_and_remove(proxy_c, log)
                proxy_c = None
        if proxy_c is None:
            start_proxy(client, target, log)
        wait_proxy(client, target)
    elif repair.reroute:
        rt = runtime_for(target, proxy_c)
        if live:
            rt.switch(live.slot, slots[live.slot], drain=None)
        for slot in haproxy.SLOTS:
            if not live or slot != live.slot:
                rt.maint(slot)
        write_config(target, slots, live.slot if live else None)
    else:
        sync_config(target, slots, live.slot if live else None, log)
    # A rotation (keys added or removed, keys still asked) reaches the running proxy without a restart.
    if target.keys and api_keys.sync(runtime_for(target, proxy_container(client, target.name)).sock, keys_file(),
                                     target.keys):
        log(f"reconcile {target.name}: the proxy now accepts the {len(target.keys)} API key(s) of "
            f"{target.keys.source}")
    for b in ([live, *live.members] if live is not None else []):
        c = by_name.get(b.container)
        if c is not None and not (c.attrs.get("HostConfig") or {}).get("RestartPolicy", {}).get("Name"):
            engine.keep_running(c)
    reconcile_openai(client, target, live, log)
    return live


def reconcile_openai(client: docker.DockerClient, target: Target, live: topology.Backend | None, log: Log) -> None:
    """The OpenAI service runs (or, without ``openai_image``, does not) and names the live build.

    Its failure is logged, not raised: Triton's endpoint, which the gates and the switch rely on, is
    unaffected, and the proxy answers /v1/ with a 503 in OpenAI's shape meanwhile.
    """
    if not target.openai_image:
        openai_service.remove(client, target.name, log)
        return
    try:
        openai_service.ensure(client, target.name, target.openai_image, target.state_dir, log)
    except engine.DeployError as err:
        log(f"OpenAI API of {target.name} is not running: {err}")
        return
    if live is not None:
        openai_service.follow(client, target.state_dir, live.container, log)


def check_listen_ports(client: docker.DockerClient, target: Target) -> None:
    """The spec's address must be this host's, and its ports free or held by this deployment's proxy; else name
    the cause (one line)."""
    missing = address_missing(target.address)
    if missing:
        raise engine.PortInUse(f"deploy.listen: {missing}; use an address of this host, or 127.0.0.1")
    proxy_c = proxy_container(client, target.name)
    ours = set()
    if proxy_c is not None and proxy_c.status == "running":
        try:
            ours = set(Ports.parse(proxy_c.labels[engine.LABEL_PORTS]).values())
        except (KeyError, ValueError):
            pass
    legacy = set()
    for b in observe_backends(client, target.name):
        if b.legacy and b.running:
            legacy |= set(b.ports.values())  # wave-1 containers: reconcile replaces them
    for key, port in target.listen.items():
        if port not in ours and port not in legacy and not is_port_free(port):
            raise engine.PortInUse(f"port {port} (deploy.ports.{key}) is in use by {port_owner(port)}")


def start_proxy(client: docker.DockerClient, target: Target, log: Log):
    engine.require_image(client, target.proxy_image)
    log(f"starting proxy {engine.proxy_name(target.name)} ({target.proxy_image}) on {target.address}, ports "
        f"http={target.listen.http} grpc={target.listen.grpc} metrics={target.listen.metrics}")
    return engine.start_proxy(client, target.name, target.proxy_image, target.listen, target.state_dir,
                              haproxy.MOUNT, haproxy.CONFIG_NAME, address=target.address, front=target.front)


# ---------------------------------------------------------------- proxy handover (a recreate)

# The old proxy finishes its requests this long once the new one serves (HAProxy's soft stop), then goes.
PROXY_DRAIN_S = 10.0
CHECK_TIMEOUT_S = 60.0
HANDOVER = ".handover"  # suffix of the second name the old proxy's unix sockets keep during a handover


class ProxyRefused(engine.DeployError):
    """A new proxy did not start (its configuration refused, or a bind failed); the running one still serves."""


def first_error(text: str) -> str:
    """HAProxy's first ALERT line without its prefix (else its last line): the cause, in one line. Pure."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "[ALERT]" in ln:
            return ln.split(" : ", 1)[1].strip() if " : " in ln else ln
    return lines[-1] if lines else "no output"


def check_config(client: docker.DockerClient, image: str, folder) -> None:
    """``haproxy -c`` in a one-off container of the proxy image, ``folder`` mounted where the proxy's state folder
    is: the configuration parses and the certificate and key list it names load. It binds nothing (a bind failure
    shows only when the proxy starts: handover). ProxyRefused names HAProxy's first error."""
    engine.require_image(client, image)
    try:
        client.containers.run(image, ["-c", "-f", f"{haproxy.MOUNT}/{haproxy.CONFIG_NAME}"], entrypoint=["haproxy"],
                              volumes={str(folder): {"bind": haproxy.MOUNT, "mode": "ro"}}, network_mode="host",
                              remove=True, stdout=True, stderr=True)
    except docker.errors.ContainerError as err:
        raise ProxyRefused(f"HAProxy refuses the new configuration: "
                           f"{first_error((err.stderr or b'').decode('utf-8', 'replace'))}") from None


def handover(client: docker.DockerClient, target: Target, old, slots: dict, live_slot: str | None, log: Log) -> None:
    """Replace the running proxy ``old`` by one with a new front (certificate, keys, address, ports, routes) with no
    moment in which nothing answers: the new configuration is validated, the new proxy starts beside the old one and
    must answer before the old one goes; if it does not, the old one keeps serving, as it was, and ProxyRefused says
    why in one line.

    Sharing the ports: HAProxy binds its listeners with SO_REUSEPORT on Linux unless `noreuseport` (global) or -dR
    says otherwise (HAProxy's configuration manual, "noreuseport"), which stoker never sets; both containers use the
    host's network and run HAProxy as the same user, which SO_REUSEPORT asks of sockets sharing a port. So two
    proxies on one port is always possible here, and no stop-then-start fallback is needed (tests/integration/
    test_proxy_image.py starts two on one port, and sees `noreuseport` refuse the second). The unix sockets (runtime API, the OpenAI service's gRPC
    path) cannot be shared: the new proxy takes their names over as it starts, even when it then fails; the old
    proxy's sockets keep a second name meanwhile and get their own back on a failure.
    """
    name = engine.proxy_name(target.name)
    trial = Path(tempfile.mkdtemp(prefix=".proxy-check-", dir=target.state_dir))
    try:
        write_config(dataclasses.replace(target, state_dir=trial), slots, live_slot)
        check_config(client, target.proxy_image, trial)
    except ProxyRefused as err:
        raise ProxyRefused(f"proxy {name} was not replaced: {err}; the running proxy keeps serving") from None
    finally:
        shutil.rmtree(trial, ignore_errors=True)
    log(f"reconcile {target.name}: the new proxy configuration is valid (haproxy -c); starting it beside {name}")
    saved = {n: _read(target.state_dir / n) for n in (haproxy.CONFIG_NAME, TLS_NAME, api_keys.DIGESTS_NAME)}
    sockets = _second_names(target.state_dir)
    old_ino = _inode(target.state_dir / haproxy.SOCKET_NAME)
    old.rename(f"{name}-old-{old.short_id}")  # the new one takes the name: proxy_container finds the newest
    new = None
    try:
        write_config(target, slots, live_slot)
        started = time.monotonic()
        new = start_proxy(client, target, log)
        _wait_new_proxy(target, new, old_ino)
    except BaseException as err:
        for c in [new] if new is not None else []:
            c.remove(force=True)
        for own, second in sockets.items():
            os.replace(second, own)  # the old proxy's runtime API (and gRPC path) under their names again
        for n, data in saved.items():
            if data is None:
                (target.state_dir / n).unlink(missing_ok=True)
            else:
                write_atomic(target.state_dir / n, data)
        old.rename(name)
        if not isinstance(err, Exception):
            raise
        cause = str(err) if isinstance(err, ProxyRefused) else engine.one_line(err)
        raise ProxyRefused(f"proxy {name} was not replaced: {cause}; the running proxy keeps serving") from None
    for second in sockets.values():
        second.unlink(missing_ok=True)
    t0 = time.monotonic()
    _retire_proxy(old, log)
    log(f"reconcile {target.name}: the new proxy serves (started and proven in {t0 - started:.1f} s); the old one "
        f"finished its requests and went in {time.monotonic() - t0:.1f} s")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _second_names(state_dir: Path) -> dict[Path, Path]:
    """A hard link to each unix socket the running proxy listens on, under the state folder: {own name: second}."""
    out = {}
    for own in (state_dir / haproxy.SOCKET_NAME, state_dir / openai_service.FOLDER / openai_service.GRPC_SOCKET):
        if own.is_socket():
            second = own.with_name(own.name + HANDOVER)
            second.unlink(missing_ok=True)
            os.link(own, second)
            out[own] = second
    return out


def _wait_new_proxy(target: Target, new, old_ino: int | None, timeout_s: float = PROXY_START_TIMEOUT_S) -> None:
    """Until ``new`` answers on the runtime API's name (no longer the old proxy's socket): it has bound every
    listener, as HAProxy binds them all before it serves. ProxyRefused with HAProxy's first error if it exits."""
    sock = target.state_dir / haproxy.SOCKET_NAME
    deadline = time.monotonic() + timeout_s
    while True:
        reason = engine.exit_reason(new)
        if reason:
            raise ProxyRefused(first_error(engine.log_tail(new, 10)) or reason)
        if _inode(sock) not in (None, old_ino):
            try:
                haproxy.Runtime(target.state_dir).servers()
                return
            except haproxy.ProxyApiError:
                pass
        if time.monotonic() > deadline:
            raise ProxyRefused(f"the new proxy did not answer within {timeout_s:g} s")
        time.sleep(0.1)


def _retire_proxy(old, log: Log) -> None:
    """HAProxy's soft stop (SIGUSR1): the old proxy stops listening, finishes its requests, then exits; removed
    after PROXY_DRAIN_S at the latest. Docker must not restart it meanwhile."""
    try:
        old.update(restart_policy={"Name": "no"})
        old.kill(signal="SIGUSR1")
        old.wait(timeout=PROXY_DRAIN_S)
    except (docker.errors.DockerException, requests.exceptions.RequestException):
        pass  # gone already, or still draining: removed below
    engine.stop_and_remove(old, log)


def remove_stale_proxies(client: docker.DockerClient, target: Target, log: Log) -> None:
    """A handover cut off (a killed process) can leave two proxies: the newest running one stays."""
    found = engine.containers(client, target.name, role=engine.ROLE_PROXY)
    if len(found) < 2:
        return
    keep = next((c for c in found if c.status == "running"), found[0])
    for c in found:
        if c is not keep:
            log(f"reconcile {target.name}: remove {c.name} (a proxy left by a handover that was cut off)")
            engine.stop_and_remove(c, log)
    if keep.name != engine.proxy_name(target.name):
        keep.rename(engine.proxy_name(target.name))


def wait_proxy(client: docker.DockerClient, target: Target, timeout_s: float = PROXY_START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    c = proxy_container(client, target.name)
    while True:
        try:
            runtime_for(target, c).servers()
            return
        except haproxy.ProxyApiError as err:
            reason = engine.exit_reason(c) if c is not None else "no proxy container"
            if reason or time.monotonic() > deadline:
                tail = engine.log_tail(c, 5) if c is not None else ""
                raise engine.DeployError(f"proxy {engine.proxy_name(target.name)} did not start "
                                         f"({reason or err}): {tail.splitlines()[-1] if tail else ''}") from None
            time.sleep(0.1)


# ---------------------------------------------------------------- stage


def stage(client: docker.DockerClient, target: Target, spec: engine.BackendSpec | list[engine.BackendSpec],
          live: topology.Backend | None, settle_s: float, log: Log, slot: str | None = None) -> BackendRef:
    """Start a candidate next to ``live`` and prove it: ready, still ready after ``settle_s``, smoke inference.

    ``spec``: one per replica (deploy.replicas; a GPU target gives each its own GPUs): every replica is started and
    proven before the candidate counts as staged. On any failure every replica started is removed and ``live`` was
    never touched. ``slot``: where it goes when nothing serves but a backend still holds the other slot (a GPU
    reload rollout's stopped backend).
    """
    specs = spec if isinstance(spec, list) else [spec]
    slot = slot or topology.next_slot(live)
    started: list[BackendRef] = []
    try:
        for replica, one in enumerate(specs):
            started.append(_stage_one(client, target, one, slot, replica, live, settle_s, log))
    except BaseException:
        for ref in started:
            discard(client, ref, log)
        raise
    first = started[0]
    return BackendRef(first.container, first.slot, first.ports, first.digest, first.run_id,
                      tuple((b.container, b.ports) for b in started[1:]))


def _probe(port: int) -> bool:
    """Free now, and picked by no other stoker process of this host lately (claimed here if so)."""
    return is_port_free(port) and port_lease.claim(port)


def _stage_one(client: docker.DockerClient, target: Target, spec: engine.BackendSpec, slot: str, replica: int,
               live: topology.Backend | None, settle_s: float, log: Log) -> BackendRef:
    claimed = {p for b in observe_backends(client, target.name) for p in b.ports.values()}
    avoid: set[int] = set(target.listen.values())
    last_error = ""
    for attempt in range(1, START_ATTEMPTS + 1):
        seed = f"{target.name}/{attempt}" if replica == 0 else f"{target.name}/{replica}/{attempt}"
        ports = choose_backend_ports(_probe, claimed, seed=seed, avoid=avoid)
        name = engine.backend_name(target.name, slot, replica)
        source = spec.repository_uri + "".join(f" (mounted from {h})" for h, c in spec.mounts.items()
                                               if c == spec.repository_uri)
        log(f"staging {name}: digest {spec.repo_digest[:12]} from {source}, ports "
            f"http={ports.http} grpc={ports.grpc} metrics={ports.metrics}")
        try:
            stale = client.containers.get(name)
            engine.stop_and_remove(stale, log)
        except docker.errors.NotFound:
            pass
        c = engine.start_backend(client, spec, slot, ports, replica)
        pump = engine.LogPump(c, log, f"[{name}]", keep=triton_log.shown)
        try:
            url = f"http://127.0.0.1:{ports.http}"
            waited = probe.wait_ready(f"{url}/v2/health/ready", spec.ready_timeout_s,
                                      exit_reason=lambda: engine.exit_reason(c))
            probe.hold_ready(f"{url}/v2/health/ready", settle_s, exit_reason=lambda: engine.exit_reason(c))
            probe.admin_closed(url, engine.placeholder_header())
            smoke = probe.smoke(url, by_layout(spec.interface))
            if target.openai_image and replica == 0:
                openai_service.prefetch(target.state_dir, c, log)
            log(f"{name} proven: ready after {waited:.1f} s, stayed ready {settle_s:g} s, smoke inference "
                f"streamed {smoke['events']} responses in {smoke['seconds']:.2f} s (Triton's log: docker logs {name})")
            return BackendRef(name, slot, ports.values(), spec.repo_digest, spec.run_id)
        except probe.ProbeFailed as err:
            tail = engine.log_tail(c)
            running = engine.exit_reason(c) is None
            engine.stop_and_remove(c, log)
            again = retry_reason(tail, running) if attempt < START_ATTEMPTS else None
            if again:
                log(f"{name}: {again}; starting it again on other ports (attempt {attempt + 1} of {START_ATTEMPTS})")
                avoid |= set(ports.values())
                continue
            kept = f"; {live.container} keeps serving" if live else ""
            last_error = f"{name} {err}{kept}\nlast {engine.LOG_TAIL_LINES} log lines of {name}:\n{tail}"
            raise engine.NotReady(last_error) from None
        except BaseException:
            engine.stop_and_remove(c, log)
            raise
        finally:
            pump.stop()
    raise engine.NotReady(last_error or "candidate never started")


def retry_reason(tail: str, running: bool = False) -> str | None:
    """Why a candidate that was not ready in time is worth starting again (None: its failure is its own)."""
    if running and triton_log.stalled_after_load(tail):
        return "Triton loaded every model and then stalled before opening its ports"
    if "already in use" in tail:
        return "a port was taken between the check and Triton's bind"
    if triton_log.ipc_abort(tail):
        return f"Triton's python backend aborted at start ({triton_log.IPC_ABORT}, a transient upstream crash)"
    return None


def discard(client: docker.DockerClient, candidate: BackendRef, log: Log) -> None:
    """Remove a candidate that never took traffic (every replica)."""
    for member in candidate.members():
        try:
            engine.stop_and_remove(client.containers.get(member.container), log)
            log(f"removed candidate {member.container}")
        except docker.errors.NotFound:
            pass


# ---------------------------------------------------------------- switch, watch (retire: retire.py)


def switch(client: docker.DockerClient, target: Target, to: BackendRef, old: BackendRef | None, log: Log) -> float:
    """New requests go to ``to``; ``old`` drains and stays warm. Returns the seconds the switch took."""
    t0 = time.perf_counter()
    rt = runtime_for(target, proxy_container(client, target.name))
    # The file first: a crash between the two leaves a file that routes to the proven candidate, and reconcile
    # makes file and runtime agree again (sync_config). Runtime first could leave a file routing to a backend
    # that reconcile later removes: the next proxy restart would route to a dead port.
    mark_served(target.state_dir, [client.containers.get(m.container).id for m in to.members()])  # h1: gated, may serve again
    slots = {to.slot: to.all_ports, **({old.slot: old.all_ports} if old else {})}
    write_config(target, slots, to.slot)
    rt.switch(to.slot, to.all_ports, drain=old.slot if old else None)
    took = time.perf_counter() - t0
    if target.openai_image:
        openai_service.follow(client, target.state_dir, to.container, log)
    for member in to.members():
        engine.keep_running(client.containers.get(member.container))
    log(f"switched {target.name}: traffic on {to.container} (digest {to.digest[:12]}) in {took * 1000:.0f} ms"
        + (f"; {old.container} drains and stays warm" if old else ""))
    return took


@dataclass(frozen=True)
class WatchResult:
    healthy: bool
    cause: str | None
    seconds: float
    requests: float  # on the busiest route (one request may count on several: serving.traffic)
    failures: float  # build-fault failures on the route with the most of them
    routes: dict[str, traffic.Tally] = field(default_factory=dict)


def _window_tallies(members: list[BackendRef], proxy: haproxy.Runtime | None) -> dict[str, traffic.Tally]:
    """Every route's cumulative counters now: each Triton model summed over replicas, and /v1 at the proxy."""
    routes: dict[str, traffic.Tally] = {}
    for m in members:
        for model, t in probe.route_tallies(m.metrics).items():
            routes[model] = routes.get(model, traffic.Tally()) + t
    if proxy is not None:
        stat = haproxy.command(proxy.sock, "show stat")
        http = [traffic.proxy_tally(stat, "http", haproxy.server_name(members[0].slot, r)) for r in range(len(members))]
        if any(t is not None for t in http):
            routes[traffic.HTTP_ROUTE] = sum((t for t in http if t is not None), traffic.Tally())
        v1 = traffic.proxy_tally(stat, haproxy.OPENAI_BACKEND, haproxy.OPENAI_BACKEND)
        if v1 is not None:
            routes[traffic.OPENAI_ROUTE] = v1
    return routes


def _since(now: dict[str, traffic.Tally], base: dict[str, traffic.Tally]) -> dict[str, traffic.Tally]:
    return {route: t - base.get(route, traffic.Tally()) for route, t in now.items()}


def watch(client: docker.DockerClient, live: BackendRef, window_s: float, max_error_rate_pct: float,
          log: Log, interval_s: float = 0.5, unready_after_s: float = 15.0,
          min_failures: int = traffic.MIN_FAILURES, proxy: haproxy.Runtime | None = None) -> WatchResult:
    """Watch the new backend (every replica) for ``window_s``: alive, ready, and every route's failures within the
    rule (serving.traffic.judge: at least ``min_failures`` build-fault failures and a rate over
    ``max_error_rate_pct`` on one route switch back; a client's bad input never does). ``proxy``: the proxy's
    runtime API, to count what it relayed over HTTP and /v1 (the OpenAI service) too.

    Readiness is judged over time (probe.Readiness): a backend that misses probes for ``unready_after_s`` is
    switched away from; a slow answer on a busy host is not.
    """
    t0 = time.monotonic()
    members = live.members()
    try:
        containers = [client.containers.get(m.container) for m in members]
    except docker.errors.NotFound as err:
        return WatchResult(False, f"{live.container} was removed ({err.explanation or err})", 0.0, 0, 0)

    try:
        base = _window_tallies(members, proxy)
    except (OSError, haproxy.ProxyApiError):
        base = {}
    routes: dict[str, traffic.Tally] = {}

    def result(healthy: bool, cause: str | None) -> WatchResult:
        busiest = max((t.requests for t in routes.values()), default=0.0)
        worst = max((t.build_faults for t in routes.values()), default=0.0)
        return WatchResult(healthy, cause, time.monotonic() - t0, busiest, worst, routes)

    readiness = [probe.Readiness(span_s=unready_after_s) for _ in members]
    while True:
        for m, c, ready in zip(members, containers, readiness):
            reason = engine.exit_reason(c)
            if reason:
                return result(False, f"{m.container} died during the watch window ({reason})")
            if ready.observe(probe.is_ready(m.http, timeout_s=5.0), time.monotonic()):
                return result(False, f"{m.container} stopped answering ready during the watch window "
                              f"({ready.describe(time.monotonic())})")
        try:
            routes = _since(_window_tallies(members, proxy), base)
        except (OSError, haproxy.ProxyApiError):
            pass  # a missed scrape; the counters are cumulative, the next one catches up
        broken = traffic.judge(routes, max_error_rate_pct, min_failures)
        if broken:
            return result(False, f"{live.container}: {broken} during the watch window")
        # A streak of failed probes open at the window's end is settled first: recovered, or a verdict.
        if time.monotonic() - t0 >= window_s and not any(r.failing for r in readiness):
            served = live.container + (f" and {len(members) - 1} more replica(s)" if len(members) > 1 else "")
            log(f"watch window {window_s:g} s passed: {served} served {traffic.describe(routes)}")
            return result(True, None)
        time.sleep(interval_s)


def backend_alive(client: docker.DockerClient, ref: BackendRef, attempts: int = 3) -> str | None:
    """None when every replica of ``ref`` runs and answers ready; else why not, in a few words."""
    for m in ref.members():
        try:
            reason = engine.exit_reason(client.containers.get(m.container))
        except docker.errors.NotFound:
            reason = "container was removed"
        if reason:
            return f"{m.container}: {reason}"
        if not probe.is_ready(m.http, timeout_s=3.0, attempts=attempts):
            return f"{m.container} does not answer ready"
    return None


def switch_back(client: docker.DockerClient, target: Target, failed: BackendRef, old: BackendRef | None,
                drain_timeout_s: float, log: Log) -> tuple[str, str]:
    """Undo a switch: traffic back on ``old`` (still warm), then the failed backend goes.

    Never onto a dead backend: ``old`` must run and answer ready first. If it does not, the failed backend keeps
    serving while it is alive (a build that fails some requests beats an endpoint that answers none); if both are
    gone, the endpoint answers 503. Returns the line that says which happened and the record's status
    (PromotionFailed.status: "rolled back", "kept" or "nothing serves").
    """
    if old is None:
        discard(client, failed, log)
        _unroute(client, target, failed)
        return "nothing served before: the endpoint now answers 503", "nothing serves"
    old_dead = backend_alive(client, old)
    if old_dead is None:
        switch(client, target, old, failed, log)
        retire(client, target, failed, min(drain_timeout_s, 10.0), log, live=old)
        return f"traffic is back on {old.container} (digest {old.digest[:12]})", "rolled back"
    new_dead = backend_alive(client, failed, attempts=1)
    if new_dead is None:
        line = (f"not switched back: the old backend is dead ({old_dead}); {failed.container} (digest "
                f"{failed.digest[:12]}) keeps serving")
        log(line)
        return line, "kept"
    _unroute(client, target, failed, old)
    line = (f"not switched back: the old backend is dead ({old_dead}) and so is the new one ({new_dead}); "
            "the endpoint now answers 503")
    log(line)
    return line, "nothing serves"


def _unroute(client: docker.DockerClient, target: Target, *refs: BackendRef) -> None:
    """No backend takes traffic: the file routes nowhere and the running proxy's servers of ``refs`` go to maint."""
    view, _ = observe_proxy(client, target)
    write_config(target, {}, None)
    if view.running:
        rt = runtime_for(target, proxy_container(client, target.name))
        for ref in refs:
            rt.maint(ref.slot)


# ---------------------------------------------------------------- the whole promotion


def prepare(client: docker.DockerClient, target: Target, spec: engine.BackendSpec | list[engine.BackendSpec],
            settle_s: float, log: Log) -> dict:
    """Reconcile, then stage ``spec`` unless its digest already serves. Plain data for the next steps."""
    live = reconcile(client, target, log)
    previous = BackendRef.of(live).to_dict() if live else None
    digest = (spec[0] if isinstance(spec, list) else spec).repo_digest
    if live is not None and live.digest == digest:
        log(f"{live.container} already serves digest {digest[:12]}; reusing it")
        return {"candidate": previous, "previous": previous, "reused": True}
    cand = stage(client, target, spec, live, settle_s, log)
    return {"candidate": cand.to_dict(), "previous": previous, "reused": False}


def go_live(client: docker.DockerClient, target: Target, staged: dict, watch_s: float, max_error_rate_pct: float,
            drain_timeout_s: float, log: Log, min_failures: int = traffic.MIN_FAILURES) -> dict:
    """Switch to the staged candidate, watch it, retire the old backend; on a fault switch back and raise."""
    cand = BackendRef.from_dict(staged["candidate"])
    old = BackendRef.from_dict(staged.get("previous"))
    switch_s = switch(client, target, cand, old, log)
    if old is None:
        # Nothing to switch back to: the first backend of a deployment was proven by stage() alone.
        log(f"first backend of {target.name}: no watch window (nothing to return to)")
        return {"switched": True, "switch_s": round(switch_s, 4), "watch_s": 0.0, "watch_requests": 0,
                "watch_failures": 0, "live": cand.to_dict()}
    proxy = runtime_for(target, proxy_container(client, target.name))
    watched = watch(client, cand, watch_s, max_error_rate_pct, log, min_failures=min_failures, proxy=proxy)
    out = {"switched": True, "switch_s": round(switch_s, 4), "watch_s": round(watched.seconds, 2),
           "watch_requests": watched.requests, "watch_failures": watched.failures, "live": cand.to_dict()}
    if not watched.healthy:
        back, status = switch_back(client, target, cand, old, drain_timeout_s, log)
        raise PromotionFailed(f"{watched.cause}; {back}", status=status)
    if old is not None:
        out["retire_s"] = round(retire(client, target, old, drain_timeout_s, log, live=cand), 2)
    return out
