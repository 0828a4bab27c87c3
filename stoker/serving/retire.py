"""Retire: the old backend of a promotion goes once its answers in flight are done, and a busy stream loses at most
one request, refused before any answer (``retire``'s docstring says how). Split from promote.py, which calls it
after a switch and on a switch back.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import docker
import docker.errors

from ..containers import engine
from . import haproxy, probe
from .deployment import BackendRef, Log, Target, proxy_container, runtime_for, write_config
from ..triton.config import ENSEMBLE_NAME

DRAIN_POLL_S = 0.2
# Reads of "nothing in flight" in a row, DRAIN_POLL_S apart, before idle streams are ended: the gauge drops when a
# model sends its last response, and the ensemble's postprocessing of that response can still be running.
IDLE_READS = 2
# Streams still open this long into retire with requests in flight are busy (a client sending request after request
# on one stream): the old backend then stops taking new requests (refuse_new) instead of waiting for a pause.
BUSY_GRACE_S = 2.0
# Once every answer has finished in Triton, its last bytes can still be on their way through the proxy: streams are
# ended only after the proxy has passed nothing more from the old backend for this long (a fixed 0.2 s was not enough
# on a loaded host: one answer of the paused-stream test was cut part-way in CI, ci68).
QUIET_S = 1.0
# Unloaded first: the model clients call, whose answers in flight still need the models it composes.
ENTRY_MODELS = (ENSEMBLE_NAME,)


def retire(client: docker.DockerClient, target: Target, old: BackendRef, drain_timeout_s: float, log: Log,
           live: BackendRef | None = None) -> float:
    """Wait until ``old`` answers no request (or the deadline), then remove it; the config file then names
    ``live`` alone, as the runtime does.

    Idle is read two ways: the proxy has no stream open to ``old``, or ``old`` itself reports no request in
    flight twice in a row while the proxy still holds streams (clients keep a gRPC bidi stream open between
    requests). Streams still open are never ended on that reading alone: a client that paused between requests
    can send its next one in the instant the streams are ended, and that answer would be cut part-way. Instead
    ``old`` first stops taking new requests (refuse_new: its models are unloaded; Triton finishes the answers in
    flight and refuses each new request with an error before any response), and its streams are ended only once
    nothing is loaded (every answer in flight has finished); their clients reconnect to the live backend (README,
    "Clients that keep a gRPC stream open"). The same happens after BUSY_GRACE_S to streams that are never idle
    (request after request, no pause), which would otherwise hold ``old`` until the deadline and be cut then.
    Each stream loses at most the one request it sent after the refusal began, before any answer: safe to resend.

    A backend that cannot unload its models (not started in explicit model-control mode: deploy.rollout
    backend_spec, TP×PP > 1) keeps the older behaviour: its streams are ended on the idle reading (between
    requests, barring that instant) or waited for until the deadline.
    """
    t0 = time.monotonic()
    rt = runtime_for(target, proxy_container(client, target.name))
    open_ = drain(client, rt, old, drain_timeout_s, log)
    if open_ > 0:
        log(f"{old.container} still had {open_} open request(s) after {drain_timeout_s:g} s; retiring it anyway")
    if live is not None:
        write_config(target, {live.slot: live.all_ports}, live.slot)
    try:
        rt.maint(old.slot)
    except haproxy.ProxyApiError:
        pass
    for member in old.members():
        try:
            engine.stop_and_remove(client.containers.get(member.container), log)
        except docker.errors.NotFound:
            pass
    log(f"retired {old.container}" + (f" and {len(old.replicas)} more replica(s)" if old.replicas else "")
        + f" after {time.monotonic() - t0:.1f} s of draining")
    return time.monotonic() - t0


def drain(client: docker.DockerClient, rt: haproxy.Runtime, old: BackendRef, drain_timeout_s: float, log: Log) -> int:
    """retire's wait (its docstring says how): until no stream is open to ``old``, or its answers in flight have all
    finished and its streams were ended, or the deadline. Returns the streams still open (0 but at the deadline).
    A GPU `reload` rollout drains its live backend this way too before stopping it (stop_first.stop)."""
    t0 = time.monotonic()
    open_, idle_reads = -1, 0
    refusing: bool | None = None  # None: not tried; True: old refuses new requests; False: it cannot
    while time.monotonic() - t0 < drain_timeout_s:
        try:
            open_ = rt.sessions(old.slot)
        except haproxy.ProxyApiError:
            break
        if open_ == 0:
            break
        if refusing:
            if _answers_finished(client, old):
                _wait_proxy_quiet(rt, old, t0 + drain_timeout_s)
                log(f"{old.container}: every answer in flight finished; ending its {open_} stream(s) (their "
                    f"clients reconnect to the live backend; a request sent meanwhile was refused before any answer)")
                end_sessions(rt, old, log)
                open_ = 0
                break
            time.sleep(DRAIN_POLL_S)
            continue
        idle_reads = idle_reads + 1 if _in_flight(old) == 0 else 0
        if idle_reads >= IDLE_READS and refusing is None:
            # Unload first even though nothing is in flight now: a paused stream may be sending its next request
            # this very instant, and ending the streams then would cut its answer part-way.
            refusing = refuse_new(client, old, log)
            if refusing:
                log(f"{old.container}: {open_} stream(s) still open with no request in flight; it now refuses new "
                    f"requests before any answer, and its streams end once nothing is loaded")
                continue
        if idle_reads >= IDLE_READS:
            log(f"{old.container}: {open_} stream(s) still open with no request in flight and it cannot refuse new "
                f"requests; ending them between requests (their clients reconnect to the live backend)")
            end_sessions(rt, old, log)
            open_ = 0
            break
        if refusing is None and time.monotonic() - t0 >= BUSY_GRACE_S:
            refusing = refuse_new(client, old, log)
            if refusing:
                log(f"{old.container}: {open_} stream(s) still busy after {BUSY_GRACE_S:g} s; it now refuses new "
                    f"requests before any answer and finishes those in flight")
                continue
        time.sleep(DRAIN_POLL_S)
    return max(open_, 0)


def _wait_proxy_quiet(rt: haproxy.Runtime, old: BackendRef, deadline: float) -> None:
    """Return once the proxy's byte count from ``old`` has not moved for QUIET_S (or at the deadline)."""
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        try:
            now = rt.bytes_out(old.slot)
        except haproxy.ProxyApiError:
            return
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= QUIET_S:
            return
        time.sleep(DRAIN_POLL_S)


def end_sessions(rt: haproxy.Runtime, old: BackendRef, log: Log) -> None:
    try:
        rt.end_sessions(old.slot)
    except haproxy.ProxyApiError as err:
        log(f"could not end the streams to {old.container}: {err}")


def _model_control(http: str, path: str, admin: dict[str, str], timeout_s: float = 10.0):
    """POST to Triton's model-repository API; returns the decoded JSON answer (None when empty)."""
    req = urllib.request.Request(f"{http}/v2/repository{path}", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json", **admin})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        body = r.read()
    return json.loads(body) if body.strip() else None


def _loaded(http: str, admin: dict[str, str]) -> dict[str, str]:
    """{model: state} of the models Triton serves or is still unloading (READY, UNLOADING, LOADING)."""
    index = _model_control(http, "/index", admin) or []
    return {m["name"]: m.get("state", "") for m in index if m.get("state") in ("READY", "UNLOADING", "LOADING")}


def refuse_new(client: docker.DockerClient, backend: BackendRef, log: Log) -> bool:
    """Make every replica of ``backend`` refuse new inference while its answers in flight finish.

    The entry models (the ensemble; in a layout without one, every model, as the `llmapi` layout's `tensorrt_llm`)
    are unloaded: Triton takes them out of service at once (a new request is
    answered with an error, before any response: "has no available versions") and unloads each when its requests
    in flight have finished; the models they compose stay loaded until then (_answers_finished unloads them next).
    False when a replica cannot (Triton refuses unloads outside explicit model-control mode); nothing changed then
    on the replicas before it either, since every replica of a backend is started alike.
    """
    for member in backend.members():
        try:
            admin = engine.admin_headers(client.containers.get(member.container))
            loaded = _loaded(member.http, admin)
            # The ensemble's layout: the ensemble first. A layout without one (the LLM API's `llmapi`: one
            # `tensorrt_llm` that clients call directly): every model it serves.
            entry = [m for m in loaded if m in ENTRY_MODELS] or list(loaded)
            for model in entry:
                _model_control(member.http, f"/models/{model}/unload", admin)
        except urllib.error.HTTPError as err:
            try:
                reason = json.loads(err.read() or b"{}").get("error", "")
            except ValueError:
                reason = ""
            log(f"{member.container} cannot refuse new requests (HTTP {err.code}: {reason or err.reason}); "
                f"waiting for its streams to pause")
            return False
        except (OSError, ValueError, docker.errors.NotFound) as err:
            log(f"{member.container} cannot refuse new requests ({err}); waiting for its streams to pause")
            return False
    return True


def _answers_finished(client: docker.DockerClient, backend: BackendRef) -> bool:
    """After refuse_new: True once no model of any replica is loaded or unloading (every answer has finished).

    Entry models gone, the remaining ones (preprocessing, tensorrt_llm, postprocessing, or whatever a client called
    directly) are unloaded in turn: each finishes its own requests in flight first.
    """
    done = True
    for member in backend.members():
        try:
            admin = engine.admin_headers(client.containers.get(member.container))
            loaded = _loaded(member.http, admin)
        except (OSError, ValueError, docker.errors.NotFound):
            continue  # the replica no longer answers: nothing of it can finish
        if any(m in ENTRY_MODELS for m in loaded):
            done = False
            continue
        for model, state in loaded.items():
            done = False
            if state == "READY":
                try:
                    _model_control(member.http, f"/models/{model}/unload", admin)
                except (OSError, ValueError):
                    pass
    return done


def _in_flight(backend: BackendRef) -> int | None:
    """What the backend (every replica) reports in flight; None when it cannot tell (no gauge, metrics down)."""
    total = 0
    for member in backend.members():
        try:
            n = probe.requests_in_flight(member.metrics)
        except OSError:
            return None
        if n is None:
            return None
        total += n
    return total
