"""Bounds at the stable endpoint under attack (issue 51): for each limit, an attack from one client address while a
well-behaved client (127.0.0.1) streams generations and measures its time to first token; the attack's answers
(status counts), and the live backend's TTFT p50 and memory before vs during it.

    python benchmarks/edge_limits.py        # -> benchmarks/results/edge_limits.json  (needs Docker; ~3 min)

The deployment is the reference target's real Triton serving the scripted test model (a token every INTERVAL_S)
behind the real proxy, with deploy.limits as LIMITS (the defaults but a 5 s request timeout, so a trickle ends
within the window, and a request rate of 10/s per client, which is off by default). Each attack runs in its own
process (raw sockets): the connection and request floods from one loopback address each (127.0.0.4, .5), the
others from a new address per connection (127.N.x.y), so each meets its own bound, not the rate bound.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from operate_run import Run  # noqa: E402 -- puts the repository and tests/integration on sys.path

OUT = ROOT / "benchmarks" / "results" / "edge_limits.json"
LIMITS = {"request_timeout_s": 5, "max_requests_per_client_per_s": 10}
INTERVAL_S = 0.02  # the scripted model's time per token
TTFT_REQUESTS = 60  # per window (before, during)
TTFT_EVERY_S = 0.125  # the well-behaved client asks 8 times a second: under the rate bound
GOAL_RATIO = 1.2
GENERATE = "/v2/models/ensemble/generate_stream"


# ----------------------------------------------------------------------------- the well-behaved client


def ttfts_ms(port: int, n: int) -> list[float]:
    """``n`` streamed generations on one keep-alive connection, TTFT_EVERY_S apart: ms from sending to the first SSE
    event."""
    body = json.dumps({"text_input": "hi", "max_tokens": 4})
    conn, out = http.client.HTTPConnection("127.0.0.1", port, timeout=30), []
    for _ in range(n):
        time.sleep(TTFT_EVERY_S)
        t0 = time.perf_counter()
        conn.request("POST", GENERATE, body, {"content-type": "application/json"})
        resp = conn.getresponse()
        first = resp.readline()
        while first and not first.startswith(b"data:"):
            first = resp.readline()
        out.append((time.perf_counter() - t0) * 1000)
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"the well-behaved client got HTTP {resp.status}")
    conn.close()
    return out


# ----------------------------------------------------------------------------- attacks (each in a child process)


def _status(s: socket.socket) -> str:
    try:
        raw = b""
        while b"\r\n" not in raw:
            chunk = s.recv(4096)
            if not chunk:
                return "closed without an answer"
            raw += chunk
        head = raw.split(b"\r\n\r\n", 1)[0]
        if b"\r\n\r\n" in raw:
            length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(
                b"content-length:")), 0)
            body = raw.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                chunk = s.recv(65536)
                if not chunk:
                    break
                body += chunk
        return raw.split(b" ", 2)[1].decode()
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    except TimeoutError:
        return "no answer in 30 s"


_next = [0]


def _fresh(net: int) -> str:
    """A new loopback address in 127.<net>.x.y: an attack that is not about one client's bounds comes from many,
    so the per-client rate bound does not answer in its place."""
    _next[0] += 1
    return f"127.{net}.{_next[0] // 250 % 250}.{_next[0] % 250 + 1}"


def _connect(port: int, source: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    return s


def _tally(counts: dict, key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def oversized_body(port: int, stop, counts: dict) -> None:
    """Bodies declared at 20 MiB (the bound: 16 MiB), 64 KiB of each sent; a new connection each."""
    while not stop.is_set():
        with _connect(port, _fresh(2)) as s:
            try:
                s.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nhost: a\r\ncontent-type: application/json"
                          b"\r\ncontent-length: %d\r\n\r\n" % (20 << 20) + b"x" * (64 << 10))
            except OSError:
                pass
            _tally(counts, _status(s))


def _trickle(port: int, stop, counts: dict, source: int, head: bytes, drip: bytes, clients: int = 50) -> None:
    """``clients`` connections each sending ``head``, then ``drip`` a byte a second, until the proxy answers."""
    import selectors

    sel = selectors.DefaultSelector()

    def open_one() -> None:
        s = _connect(port, _fresh(source))
        s.sendall(head)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, [0])

    for _ in range(clients):
        open_one()
    while not stop.is_set():
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            sel.unregister(s)
            s.setblocking(True)
            s.settimeout(5)
            _tally(counts, _status(s))
            s.close()
            if not stop.is_set():
                open_one()
        for key in list(sel.get_map().values()):
            i = key.data[0]
            if i < len(drip):
                try:
                    key.fileobj.send(drip[i:i + 1])
                except OSError:
                    pass
                key.data[0] = i + 1
    for key in list(sel.get_map().values()):
        key.fileobj.close()


def trickled_body(port: int, stop, counts: dict) -> None:
    body = b'{"text_input": "hi", "max_tokens": 3}' + b" " * 200
    head = (b"POST /v2/models/ensemble/generate HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    _trickle(port, stop, counts, 3, head, body)


def trickled_headers(port: int, stop, counts: dict) -> None:
    _trickle(port, stop, counts, 6, b"GET /v2/health/ready HTTP/1.1\r\n", b"x-slow: " + b"a" * 200)


def oversized_headers(port: int, stop, counts: dict) -> None:
    """Request heads of 20 KiB (the bound: 15 KiB), one connection each."""
    while not stop.is_set():
        with _connect(port, _fresh(7)) as s:
            s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nhost: a\r\nx-pad: " + b"a" * (20 << 10) + b"\r\n\r\n")
            _tally(counts, _status(s))


def connection_flood(port: int, stop, counts: dict) -> None:
    """1,500 connections held open from one address (the bound: 1,024), a request on each, again and again."""
    def fill(held: list) -> list:
        while len(held) < 1500:
            try:
                held.append(_connect(port, "127.0.0.4"))
            except OSError as err:
                _tally(counts, f"connect failed: {err.strerror}")
                break
        return held

    held = fill([])
    while not stop.is_set():
        alive = []
        for s in held:
            try:
                s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nhost: a\r\n\r\n")
                got = _status(s)
            except OSError:
                got = "reset"
            _tally(counts, got)
            if got in ("200",):
                alive.append(s)
            else:
                s.close()
        held = fill(alive)
        time.sleep(0.5)
    for s in held:
        s.close()


def request_flood(port: int, stop, counts: dict) -> None:
    """Generations as fast as one keep-alive connection allows (the bound: 10 a second per client)."""
    body = b'{"text_input": "hi", "max_tokens": 1}'
    req = (b"POST /v2/models/ensemble/generate HTTP/1.1\r\nhost: a\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(body) + body)
    s = _connect(port, "127.0.0.5")
    while not stop.is_set():
        try:
            s.sendall(req)
            got = _status(s)
        except OSError:
            got = "reset"
        _tally(counts, got)
        if got not in ("200", "429"):
            s.close()
            s = _connect(port, "127.0.0.5")
    s.close()


ATTACKS = {
    "max_body_bytes": ("bodies declared at 20 MiB, 64 KiB of each sent, one connection each, back to back",
                       oversized_body),
    "request_timeout_s (body)": ("50 connections trickling a generate body a byte a second, replaced as answered",
                                 trickled_body),
    "request_timeout_s (headers)": ("50 connections trickling headers a byte a second, replaced as answered",
                                    trickled_headers),
    "header size": ("20 KiB request heads, one connection each, back to back", oversized_headers),
    "max_connections_per_client": ("1,500 connections held from one address, a request on each every 0.5 s",
                                   connection_flood),
    "max_requests_per_client_per_s": ("generate requests back to back on one keep-alive connection",
                                      request_flood),
}


def _attack(name: str, port: int, stop, out) -> None:
    counts: dict = {}
    try:
        ATTACKS[name][1](port, stop, counts)
    except Exception as exc:  # noqa: BLE001 - the attacker's own failure is part of what it got
        _tally(counts, f"attacker error: {type(exc).__name__}: {exc}"[:120])
    out.put(counts)


# ----------------------------------------------------------------------------- the backend's memory


def backend_memory_mib(container) -> dict:
    """The backend container's memory (its cgroup's usage) and tritonserver's own resident set, MiB."""
    stats = container.stats(stream=False)
    out = {"cgroup_mib": round(stats["memory_stats"].get("usage", 0) / 2**20, 1)}
    # PID 1 of the container is Docker's init: tritonserver is the process of that cgroup whose command it is.
    for proc in Path("/proc").iterdir():
        try:
            if (proc.name.isdigit() and container.id in (proc / "cgroup").read_text()
                    and (proc / "cmdline").read_bytes().split(b"\0")[0].endswith(b"tritonserver")):
                rss = next(ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("VmRSS"))
                out["tritonserver_rss_mib"] = round(int(rss.split()[1]) / 1024, 1)
                break
        except (OSError, StopIteration):
            continue
    return out


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def main() -> None:
    from stoker.containers import engine
    from stoker.spec.load import parse_spec

    state = Path(tempfile.mkdtemp(prefix="edge-limits-"))
    run = Run(state)
    run.data["deploy"]["limits"] = LIMITS
    run.spec = parse_spec(run.data, "edge_limits")
    client = engine.connect()
    results, t_start = [], time.time()
    try:
        run.deploy("a", interval_s=INTERVAL_S)
        port = run.spec.deploy.ports.http
        backend = next(c for c in engine.containers(client, run.spec.deploy.name, role=engine.ROLE_BACKEND)
                       if c.status == "running")
        ttfts_ms(port, 20)  # warm-up
        for name, (what, _) in ATTACKS.items():
            before = ttfts_ms(port, TTFT_REQUESTS)
            mem_before = backend_memory_mib(backend)
            stop, out = mp.Event(), mp.Queue()
            proc = mp.Process(target=_attack, args=(name, port, stop, out))
            proc.start()
            time.sleep(LIMITS["request_timeout_s"] + 1.0)  # past the first timeouts: the attack in full
            during = ttfts_ms(port, TTFT_REQUESTS)
            mem_during = backend_memory_mib(backend)
            stop.set()
            counts = out.get(timeout=60)
            proc.join(timeout=30)
            ratio = round(p50(during) / p50(before), 3)
            row = {"limit": name, "attack": what, "got": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
                   "ttft_p50_ms_before": p50(before), "ttft_p50_ms_during": p50(during),
                   "ttft_requests_before": len(before), "ttft_requests_during": len(during),
                   "ttft_ratio": ratio, "goal_ratio_max": GOAL_RATIO, "met": ratio <= GOAL_RATIO,
                   "backend_memory_before": mem_before, "backend_memory_during": mem_during}
            print(json.dumps(row), flush=True)
            results.append(row)
    finally:
        engine.remove_deployment(client, run.spec.deploy.name, lambda _l: None)
    doc = {
        "benchmark": "edge_limits",
        "machine": "this machine, 2 cores, no GPU (CPU reference target); the attacker, the measuring client, "
                   "HAProxy and Triton share the 2 cores",
        "commit": os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip(),
        "deploy_limits": {**{k: v for k, v in __import__("stoker.serving.edge", fromlist=["x"]).EdgeLimits(
            **LIMITS).__dict__.items()}},
        "backend": f"Triton (stoker/triton-cpu) serving the scripted test model, a token every {INTERVAL_S} s, "
                   "2 instances; the measuring client streams generate_stream (4 tokens) on one keep-alive "
                   "connection from 127.0.0.1",
        "ttft": "ms from sending the request to the first SSE event, p50 of each window; one request every "
                f"{TTFT_EVERY_S} s",
        "wall_s": round(time.time() - t_start, 1),
        "limits": results,
        "all_met": all(r["met"] for r in results),
    }
    OUT.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
