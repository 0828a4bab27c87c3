"""Triton's Prometheus metrics endpoint, reduced to what the run report shows per model.

Counters are cumulative since the server (or the model version) started, so the
report states them as "since start"; the means divide a duration counter by the
request counter: queue time is waiting for a model instance, compute time is
input + infer + output.
"""

from __future__ import annotations

import re
import urllib.request

# name{labels} value   (comments and untyped lines are skipped)
_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
WANTED = {
    "nv_inference_request_success": "success",
    "nv_inference_request_failure": "failure",
    "nv_inference_count": "inferences",
    "nv_inference_exec_count": "executions",
    "nv_inference_request_duration_us": "request_us",
    "nv_inference_queue_duration_us": "queue_us",
    "nv_inference_compute_input_duration_us": "compute_input_us",
    "nv_inference_compute_infer_duration_us": "compute_infer_us",
    "nv_inference_compute_output_duration_us": "compute_output_us",
}


def parse(text: str) -> dict[str, dict[str, float]]:
    """Sum the wanted counters per model over versions: {model: {success, failure, queue_us, …}}."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m or m["name"] not in WANTED:
            continue
        labels = dict(_LABEL.findall(m["labels"] or ""))
        model = labels.get("model")
        if not model:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        row = out.setdefault(model, {})
        key = WANTED[m["name"]]
        row[key] = row.get(key, 0.0) + value
    return out


def summarize(raw: dict[str, dict[str, float]]) -> list[dict]:
    """Per-model rows with units in the names; means are per successful request."""
    rows = []
    for model in sorted(raw):
        r = raw[model]
        n = r.get("success", 0.0) + r.get("failure", 0.0)
        compute = r.get("compute_input_us", 0.0) + r.get("compute_infer_us", 0.0) + r.get("compute_output_us", 0.0)
        rows.append({
            "model": model,
            "requests": int(n),
            "failed": int(r.get("failure", 0.0)),
            "executions": int(r.get("executions", 0.0)),
            "mean_queue_ms": round(r.get("queue_us", 0.0) / n / 1000, 3) if n else None,
            "mean_compute_ms": round(compute / n / 1000, 3) if n else None,
            "mean_request_ms": round(r.get("request_us", 0.0) / n / 1000, 3) if n else None,
        })
    return rows


def scrape(url: str, timeout_s: float = 5.0) -> list[dict]:
    """GET the metrics endpoint (http://host:metrics_port/metrics) and summarize it."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return summarize(parse(resp.read().decode("utf-8", "replace")))


# Gauges of requests a backend has begun and not yet answered: stoker's reference model (and the stand-in) and
# TensorRT-LLM's backend. Requests still queued for a model are Triton's own pending gauge.
IN_FLIGHT_GAUGES = {"stoker_requests_in_flight": None, "nv_trt_llm_request_metrics": ("request_type", "active")}
PENDING_GAUGE = "nv_inference_pending_request_count"


def in_flight(text: str) -> int | None:
    """Requests begun or queued and not yet answered, over every model; None when no model reports a gauge of
    requests in flight (then only the proxy's open streams can tell, and an idle stream looks busy). Pure."""
    seen, total = False, 0.0
    for line in text.splitlines():
        m = _LINE.match(line) if line and not line.startswith("#") else None
        if not m or (m["name"] not in IN_FLIGHT_GAUGES and m["name"] != PENDING_GAUGE):
            continue
        want = IN_FLIGHT_GAUGES.get(m["name"])
        if want and dict(_LABEL.findall(m["labels"] or "")).get(want[0]) != want[1]:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        seen = seen or m["name"] in IN_FLIGHT_GAUGES
        total += value
    return round(total) if seen else None
