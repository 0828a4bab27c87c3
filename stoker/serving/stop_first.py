"""A GPU `reload` rollout: neither backend fits next to the other, so the live one stops before the candidate starts.

The plan chose it (stoker/gpu/rollout.py) and stated the expected gap; these steps make it happen and keep the
way back: the old backend drains (no new requests, its open ones finish, up to drain_timeout_s), then its
container is *stopped, not removed*, so its GPUs are free and it can start again as it was. The candidate is
staged and gated as usual; after the switch the stopped backend is removed. A candidate that fails before or
during the watch window is removed and the stopped backend starts again (a second gap) and takes traffic back.
"""

from __future__ import annotations

import time

import docker
import docker.errors

from ..containers import engine
from . import probe, promote, retire, triton_log
from .deployment import BackendRef, Log, Target, proxy_container, runtime_for, write_config


def stop(client: docker.DockerClient, target: Target, live: BackendRef, drain_timeout_s: float, log: Log) -> float:
    """Drain ``live`` and stop its container (kept); returns the time.time() the gap began (traffic stopped)."""
    rt = runtime_for(target, proxy_container(client, target.name))
    began = time.time()
    rt.maint(live.slot)  # no new request goes anywhere until the candidate is switched in: the gap begins
    # A stream already open (a gRPC bidi stream carries request after request) still reaches the backend: drain it as
    # a retire does, so that no answer is cut part-way (its streams end once every answer in flight has finished;
    # a request sent meanwhile is refused before any answer). Waiting for no open stream alone cut 2 answers of a
    # busy stream in benchmarks/results/operate_busy_streams_tensorrt_standin_reload.json.
    left = retire.drain(client, rt, live, drain_timeout_s, log)
    write_config(target, {}, None)
    if left:
        # Streams still open at the deadline would hold Triton's exit for its exit timeout, and the gap with it;
        # their clients reconnect and meet the 503 until the switch.
        retire.end_sessions(rt, live, log)
    for member in live.members():
        client.containers.get(member.container).stop(timeout=engine.STOP_TIMEOUT_S)
    log(f"GPU rollout reload: {live.container}" + (f" and {len(live.replicas)} more replica(s)" if live.replicas else "")
        + " stopped (kept, to start again on a failure); its GPUs are free for "
        "the candidate; the endpoint answers 503 until the switch")
    return began


def restart(client: docker.DockerClient, target: Target, old: BackendRef, ready_timeout_s: float, log: Log) -> None:
    """Start the stopped backend again and route traffic to it (the way back of a failed reload rollout)."""
    waited = 0.0
    for member in old.members():
        try:
            c = client.containers.get(member.container)
        except docker.errors.NotFound:
            log(f"GPU rollout reload: {member.container} is gone; nothing serves until the next deploy")
            return
        waited = max(waited, _start_ready(c, member.http, ready_timeout_s, log))
        engine.keep_running(c)
    write_config(target, {old.slot: old.all_ports}, old.slot)
    runtime_for(target, proxy_container(client, target.name)).switch(old.slot, old.all_ports, drain=None)
    log(f"GPU rollout reload: {old.container} started again (ready after {waited:.1f} s) and serves")


def _start_ready(c, http: str, ready_timeout_s: float, log: Log) -> float:
    """Start the stopped container and wait for it; a start that dies of the python backend's IPC abort (this
    start's output only: the container's log keeps its earlier runs) is tried again, as a candidate's would be."""
    for attempt in range(1, promote.START_ATTEMPTS + 1):
        began = time.time()  # docker's log filter takes fractions of a second
        c.start()
        try:
            return probe.wait_ready(f"{http}/v2/health/ready", ready_timeout_s,
                                    exit_reason=lambda: engine.exit_reason(c))
        except probe.ProbeFailed:
            output = c.logs(since=began).decode("utf-8", "replace")
            if attempt == promote.START_ATTEMPTS or not triton_log.ipc_abort(output):
                raise
            log(f"GPU rollout reload: {c.name}: Triton's python backend aborted at start ({triton_log.IPC_ABORT}, "
                f"a transient upstream crash); starting it again")
    raise AssertionError("unreachable")


def remove(client: docker.DockerClient, old: BackendRef, log: Log) -> None:
    for member in old.members():
        try:
            engine.stop_and_remove(client.containers.get(member.container), log)
        except docker.errors.NotFound:
            pass
