"""`stoker status NAME --watch`: poll one deployment and print a line per change (a backend down or exited, the
proxy gone, a rollback, the live build changing, the poll itself failing), each also a Prefect event when a Prefect
API is configured, so an automation can notify someone between runs.

diff() is the pure core: two observations (plain dicts, as observe() builds them) → the lines to print.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

ALERT, OK, INFO = "ALERT", "ok", "info"
EVENT = "stoker.deployment.watch"  # + ".alert" / ".ok" / ".info": one event name per level for automations
EXIT_ALERT = 3  # --exit-on-alert: the first ALERT ends the watch with this status
DEFAULT_INTERVAL_S = 5.0
_HEALTHY = ("UP", "no check")  # show stat's status for a server taking requests; "UP 1/3" etc. are turning


# ---------------------------------------------------------------- the pure part


def _signal_note(code) -> str:
    # A process killed by signal N exits 128+N (137: SIGKILL, e.g. `docker kill` or the OOM killer).
    return f", signal {code - 128}" if isinstance(code, int) and 128 < code < 160 else ""


def _exit_line(name: str, b: dict) -> str:
    why = f"exit code {b.get('exit_code')}{_signal_note(b.get('exit_code'))}"
    if b.get("oom"):
        why += ", out of memory"
    if b.get("error"):
        why += f", {b['error']}"
    line = f"backend {name} {b.get('state')} ({why}; restarts {b.get('restarts', 0)})"
    return line + (f": {b['refused']}" if b.get("refused") else "")


def _down(b: dict) -> bool:
    return b.get("check") is not None and not str(b["check"]).startswith(_HEALTHY) and b["check"] not in ("MAINT",
                                                                                                       "DRAIN")


def diff(prev: dict | None, cur: dict) -> list[tuple[str, str]]:
    """(level, text) for each change from ``prev`` to ``cur``; ``prev`` None: the watch's first look, which reports
    what is wrong now (not history: no rollback or build change). Pure.

    An observation: {"error": one line or None, "proxy": running|down|missing, "backends": {container: {"state",
    "exit_code", "oom", "error", "restarts", "check" (the proxy's status of its server, None: not routed),
    "check_reason", "refused" (credentials.refused_line or None)}}, "live": {"digest", "run_id", "from_run"} or None,
    "rollbacks": {record id: {"from", "to", "reason"}}}. A failed poll is {"error": ...} alone: the next good one
    is compared with the last good one."""
    out: list[tuple[str, str]] = []
    if cur.get("error"):
        if prev is None or not prev.get("error"):
            out.append((ALERT, f"watcher error: {cur['error']}"))
        return out
    if prev is not None and prev.get("error"):
        out.append((OK, "watcher recovered: polling again"))
        prev = prev.get("last_good")
    first = prev is None
    prev = prev or {}

    proxy, was = cur.get("proxy"), prev.get("proxy", "running")
    if proxy != "running" and (first or was == "running"):
        out.append((ALERT, f"proxy not running ({proxy})"))
    elif proxy == "running" and was != "running":
        out.append((OK, "proxy running again"))

    old_b, new_b = prev.get("backends") or {}, cur.get("backends") or {}
    for name in sorted(new_b):
        b, o = new_b[name], old_b.get(name)
        running, was_running = b.get("state") == "running", (o or {}).get("state", "running") == "running"
        if not running and (first or o is None or was_running or b.get("restarts", 0) != o.get("restarts", 0)):
            out.append((ALERT, _exit_line(name, b)))
        elif running and o is not None and b.get("restarts", 0) > o.get("restarts", 0):
            out.append((ALERT, f"backend {name} restarted (restarts {b['restarts']})"
                        + (f": {b['refused']}" if b.get("refused") else "")))
        elif running and o is not None and not was_running:
            out.append((OK, f"backend {name} running again"))
        down, was_down = _down(b), o is not None and _down(o)
        if down and (first or not was_down):
            reason = b.get("check_reason") or "no reason given"
            out.append((ALERT, f"backend {name} {b['check']} (proxy check: {reason})"))
        elif was_down and not down and str(b.get("check") or "").startswith("UP"):
            out.append((OK, f"backend {name} UP again"))
    for name in sorted(set(old_b) - set(new_b)):
        out.append((INFO, f"backend {name} removed"))
    if first:
        # The baseline the changes that follow are read against (and a sign the watch works).
        live = cur.get("live") or {}
        up = sum(1 for b in new_b.values() if b.get("state") == "running")
        out.append((INFO, f"first look: proxy {proxy}, {up} of {len(new_b)} backend(s) running, live build "
                          f"{str(live.get('digest') or 'none')[:12]} (run {live.get('run_id') or '-'})"))

    if not first:
        for rid in sorted(set(cur.get("rollbacks") or {}) - set(prev.get("rollbacks") or {})):
            r = cur["rollbacks"][rid]
            out.append((ALERT, f"rollback: {rid} rolled back {str(r.get('from') or '?')[:12]} "
                               f"to {str(r.get('to') or '?')[:12]} ({r.get('reason') or 'no reason given'})"))
        old_live, new_live = prev.get("live") or {}, cur.get("live") or {}
        if old_live.get("digest") and new_live.get("digest") and old_live["digest"] != new_live["digest"]:
            # A completed run switching traffic is the pipeline working; anything else moved it behind its back.
            level = INFO if new_live.get("from_run") else ALERT
            out.append((level, f"live build changed {old_live['digest'][:12]} -> {new_live['digest'][:12]} "
                               f"(run {new_live.get('run_id') or '?'}"
                               + (", completed)" if new_live.get("from_run") else ", no completed run switched to it)")))
    return out


def carry(prev: dict | None, cur: dict) -> dict:
    """What the next diff compares with: a failed poll keeps the last good observation inside it. Pure."""
    if cur.get("error"):
        good = prev.get("last_good") if prev is not None and prev.get("error") else prev
        return {**cur, "last_good": good}
    return cur


def stamp(level: str, text: str, now: float | None = None) -> str:
    at = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc).isoformat(timespec="seconds")
    return f"{at.replace('+00:00', 'Z')} {level} {text}"


def parse_stat_checks(text: str) -> dict[str, tuple[str, str]]:
    """``show stat`` CSV → {server: (status, check reason)}, the worst over the proxy's sections (a server is DOWN
    when any section's check fails). Pure."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        return {}
    cols = lines[0][2:].split(",")
    idx = {k: cols.index(k) for k in ("svname", "status", "check_status", "last_chk") if k in cols}
    if "svname" not in idx or "status" not in idx:
        return {}
    out: dict[str, tuple[str, str]] = {}
    for f in (ln.split(",") for ln in lines[1:]):
        if len(f) <= max(idx.values()) or f[idx["svname"]] in ("FRONTEND", "BACKEND"):
            continue
        status = f[idx["status"]]
        reason = " ".join(x for x in (f[idx["check_status"]] if "check_status" in idx else "",
                                      f[idx["last_chk"]] if "last_chk" in idx else "") if x)
        seen = out.get(f[idx["svname"]])
        if seen is None or (seen[0].startswith(_HEALTHY) and not status.startswith(_HEALTHY)):
            out[f[idx["svname"]]] = (status, reason)
    return out


# ---------------------------------------------------------------- observing (Docker, the proxy, $STOKER_HOME)


def observe(client, name: str, home) -> dict:
    """One look at deployment ``name``. Raises what Docker or the proxy's socket raise; the loop reports it."""
    from ..containers import engine
    from ..record import manifest, rollbacks
    from ..serving import deployment, haproxy
    from ..storage import credentials

    proxy_c = deployment.proxy_container(client, name)
    checks: dict[str, tuple[str, str]] = {}
    proxy = "missing" if proxy_c is None else "down" if proxy_c.status != "running" else "running"
    if proxy == "running":
        sock = (engine.state_mount(proxy_c, haproxy.MOUNT) or home / "proxy" / name) / haproxy.SOCKET_NAME
        try:
            checks = parse_stat_checks(haproxy.command(sock, "show stat"))
        except haproxy.ProxyApiError:
            proxy = "not answering on its runtime socket"
    backends, live = {}, None
    runs = [m for m in manifest.read_manifests(home)
            if ((m.get("spec") or {}).get("deploy") or {}).get("name") == name]
    for c in engine.containers(client, name, role=engine.ROLE_BACKEND):
        st = c.attrs.get("State") or {}
        server = haproxy.server_name(c.labels.get(engine.LABEL_SLOT, ""),
                                     int(c.labels.get(engine.LABEL_REPLICA, "0") or 0))
        check = checks.get(server)
        restarts = int(c.attrs.get("RestartCount") or 0)
        b = {"state": c.status, "exit_code": st.get("ExitCode"), "oom": bool(st.get("OOMKilled")),
             "error": str(st.get("Error") or "").splitlines()[0] if st.get("Error") else "",
             "restarts": restarts, "check": check[0] if check else None, "check_reason": check[1] if check else "",
             "refused": None}
        if c.status != "running" or restarts:
            # Only then is its log worth reading: S3 refusing the keys is the one exit with a known fix.
            b["refused"] = credentials.refused_line(c.name, engine.log_tail(c, 200))
        backends[c.name] = b
        if check and check[0].startswith("UP") and c.status == "running" and live is None:
            digest, run_id = c.labels.get(engine.LABEL_DIGEST, ""), c.labels.get(engine.LABEL_RUN, "")
            live = {"digest": digest, "run_id": run_id,
                    "from_run": any(rollbacks.switched_to(m) == digest for m in runs)}
    return {"error": None, "proxy": proxy, "backends": backends, "live": live,
            "rollbacks": {m["run_id"]: {"from": (m.get("from") or {}).get("digest"),
                                        "to": (m.get("to") or {}).get("digest"), "reason": m.get("reason")}
                          for m in runs if rollbacks.is_rollback(m) and m.get("status") == "completed"}}


def emit(name: str, level: str, text: str, log=print) -> None:
    """The line as a Prefect event (when a Prefect API is configured); one warning line if that fails."""
    import os

    if not os.environ.get("PREFECT_API_URL"):
        return
    try:
        from prefect.events import emit_event

        emit_event(f"{EVENT}.{level.lower()}", resource={"prefect.resource.id": f"stoker.deployment.{name}",
                                                         "prefect.resource.name": name},
                   payload={"level": level, "message": text})
    except Exception as err:  # noqa: BLE001 - the line was printed; the event is a notification
        log(stamp("warning", f"event not emitted: {type(err).__name__}"))


def _say(line: str) -> None:
    print(line, flush=True)  # a watch is read live, often through a pipe: no line may wait in a buffer


def watch(name: str, interval_s: float = DEFAULT_INTERVAL_S, exit_on_alert: bool = False, log=_say,
          client_factory=None, home=None, polls: int | None = None) -> int:
    """Poll until Ctrl-C (0) or, with ``exit_on_alert``, the first ALERT (EXIT_ALERT). ``polls``: stop after that
    many (tests)."""
    from ..containers import engine
    from ..home import stoker_home

    home = home if home is not None else stoker_home()
    connect = client_factory or (lambda: engine.connect(None, timeout_s=10))
    client, prev, n = None, None, 0
    log(stamp(INFO, f"watching {name} every {interval_s:g} s (Ctrl-C stops)"))
    try:
        while polls is None or n < polls:
            n += 1
            try:
                client = client or connect()
                cur = observe(client, name, home)
            except Exception as err:  # noqa: BLE001 - any failed poll is reported and retried, never fatal
                client = None
                cur = {"error": f"{type(err).__name__}: {engine.one_line(err)}"}
            lines = diff(prev, cur)
            for level, text in lines:
                log(stamp(level, text))
                emit(name, level, text, log)
            prev = carry(prev, cur)
            if exit_on_alert and any(level == ALERT for level, _ in lines):
                return EXIT_ALERT
            if polls is None or n < polls:
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
    return 0
