"""What reached a backend during the watch window, route by route, and whether the build is at fault. Pure.

A route is one way clients reach the new build: each Triton model they can call (the ensemble, ``tensorrt_llm``
directly, the pre/postprocessing models), the HTTP answers the proxy relayed from the new backend (``HTTP``), and
``/v1`` (the OpenAI service, which calls ``tensorrt_llm`` itself). Each route is judged on its own: an ensemble
request also counts on the models it composes, an HTTP request also on its model, a ``/v1`` request also on
``tensorrt_llm``, so a sum over routes would count one request two or three times.

Why both Triton's counters and the proxy's: Triton's do not see every failure. A python-backend model that answers
a request with an error response (``InferenceResponse(error=...)``, what the reference models do) is counted a
success; the client gets HTTP 500 (measured on tritonserver 2.51: three such answers, failure counters 0). The
proxy sees that 500. It cannot see a gRPC failure (gRPC answers HTTP 200 with the status in trailers) nor an
error event inside a 200 SSE stream; Triton's counters see those the backend reports as failures.

Which failures are the build's fault:

- Triton's ``nv_inference_request_failure`` carries a ``reason`` label: REJECTED, CANCELED, BACKEND, OTHER
  (triton-inference-server/core, src/metric_model_reporter.cc ``failure_reasons_map``; REJECTED is what the
  dynamic batcher gives a request whose queue timed out or was full, CANCELED one the client cancelled, in
  src/dynamic_batch_scheduler.cc). CANCELED is the client's doing; BACKEND (the model answered an error), OTHER
  and REJECTED (the build could not keep up with load the old build carried) are the build's.
- A request Triton refuses as malformed (a missing input, a wrong datatype or shape) is answered HTTP 400 and is
  not counted in those metrics at all (measured on tritonserver 2.51: five kinds of bad input, every failure
  counter stayed 0), so a client's bad input never reaches this judgement from Triton's side.
- ``/v1``: the proxy's per-server counters of answers by status class (HAProxy's ``show stat`` fields
  ``hrsp_1xx`` … ``hrsp_5xx``, ``hrsp_other``; HAProxy management guide, section 9.1 "CSV format"). 4xx is the
  client's (bad input, unknown model, a missing key); 5xx is the build's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Prometheus text: name{labels} value
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

# Triton's failure reasons (see the module docstring) that count against the build.
BUILD_FAULT_REASONS = frozenset({"BACKEND", "OTHER", "REJECTED"})
OPENAI_ROUTE = "/v1"
HTTP_ROUTE = "HTTP"  # /v2 inference over HTTP, as the proxy relayed it to the new backend's servers
# A single failure in a near-idle window is 1 of 1 = 100 %: evidence of nothing. A route fails the window only
# once it has at least this many build-fault failures and their rate is over the threshold (deploy.max_error_rate_pct).
MIN_FAILURES = 3


@dataclass(frozen=True)
class Tally:
    """Requests answered on one route, and of those the failures that are the build's and the client's fault."""

    requests: float = 0.0
    build_faults: float = 0.0
    client_faults: float = 0.0

    def __sub__(self, base: Tally) -> Tally:
        # A counter lower than its baseline means the server restarted: everything since counts.
        if self.requests < base.requests:
            return self
        return Tally(self.requests - base.requests, self.build_faults - base.build_faults,
                     self.client_faults - base.client_faults)

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.requests + other.requests, self.build_faults + other.build_faults,
                     self.client_faults + other.client_faults)


def triton_tallies(text: str) -> dict[str, Tally]:
    """Triton's Prometheus text → {model: Tally}, summed over versions."""
    ok: dict[str, float] = {}
    build: dict[str, float] = {}
    client: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line) if line and not line.startswith("#") else None
        if not m or m["name"] not in ("nv_inference_request_success", "nv_inference_request_failure"):
            continue
        labels = dict(_LABEL.findall(m["labels"] or ""))
        model = labels.get("model")
        try:
            value = float(m["value"])
        except ValueError:
            continue
        if not model:
            continue
        if m["name"] == "nv_inference_request_success":
            ok[model] = ok.get(model, 0.0) + value
        else:
            into = build if labels.get("reason", "OTHER") in BUILD_FAULT_REASONS else client
            into[model] = into.get(model, 0.0) + value
    return {model: Tally(ok.get(model, 0.0) + build.get(model, 0.0) + client.get(model, 0.0),
                         build.get(model, 0.0), client.get(model, 0.0))
            for model in sorted({*ok, *build, *client})}


def proxy_tally(show_stat: str, backend: str, server: str) -> Tally | None:
    """HAProxy's ``show stat`` CSV → the answers ``backend/server`` sent, by status class; None: no such server."""
    lines = show_stat.splitlines()
    if not lines or not lines[0].startswith("# "):
        return None
    cols = lines[0][2:].split(",")
    for line in lines[1:]:
        row = dict(zip(cols, line.split(",")))
        if row.get("pxname") == backend and row.get("svname") == server:
            def n(field: str) -> float:
                return float(row.get(field) or 0)
            total = sum(n(f) for f in ("hrsp_1xx", "hrsp_2xx", "hrsp_3xx", "hrsp_4xx", "hrsp_5xx", "hrsp_other"))
            return Tally(total, n("hrsp_5xx"), n("hrsp_4xx"))
    return None


def judge(routes: dict[str, Tally], max_error_rate_pct: float, min_failures: int = MIN_FAILURES) -> str | None:
    """None while every route is within the rule; else one line naming the worst route that broke it.

    A route breaks it with at least ``min_failures`` build-fault failures AND a build-fault rate above
    ``max_error_rate_pct`` of its requests. Client faults count as requests, never as failures.
    """
    broken = []
    for route, t in routes.items():
        if t.requests <= 0 or t.build_faults < max(1, min_failures):
            continue
        rate = 100.0 * t.build_faults / t.requests
        if rate > max_error_rate_pct:
            broken.append((rate, route, t))
    if not broken:
        return None
    rate, route, t = max(broken)
    client = f"; {t.client_faults:g} client error(s) not counted" if t.client_faults else ""
    return (f"{route} failed {t.build_faults:g} of {t.requests:g} requests ({rate:.1f} % > "
            f"{max_error_rate_pct:g} %, at least {min_failures} needed){client}")


def describe(routes: dict[str, Tally]) -> str:
    """``ensemble 12 (0 failed), /v1 3 (1 client error)``: the routes that saw requests."""
    parts = []
    for route, t in routes.items():
        if t.requests <= 0:
            continue
        extra = f", {t.client_faults:g} client error(s)" if t.client_faults else ""
        parts.append(f"{route} {t.requests:g} ({t.build_faults:g} failed{extra})")
    return ", ".join(parts) or "no requests"
