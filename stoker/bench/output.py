"""What a benchmark leaves behind: raw records (JSONL) first, then the summary (JSON + CSV), a markdown
table and a latency–throughput plot (PNG). Field names carry their units (`ttft_ms`, `output_tokens_per_s`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .metrics import LevelSummary, RequestRecord

RECORDS = "records.jsonl"
SUMMARY_JSON = "summary.json"
SUMMARY_CSV = "summary.csv"
TABLE_MD = "table.md"
PLOT_PNG = "latency_throughput.png"
STAT_METRICS = ("ttft_ms", "itl_ms", "inter_chunk_ms", "e2e_ms", "input_tokens", "output_tokens")
STATS = ("mean", "min", "max", "std", "p50", "p90", "p95", "p99")


def write_records(path: Path, records: Iterable[RequestRecord]) -> Path:
    with open(path, "w") as f:
        f.writelines(json.dumps(asdict(r)) + "\n" for r in records)
    return path


def flat_row(level: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: `ttft_ms_p99`-style columns, None where a metric had no sample."""
    row: dict[str, Any] = {k: level.get(k) for k in ("mode", "concurrency", "request_rate", "requests", "completed",
                                                       "errors", "short_outputs", "duration_s",
                                                       "output_tokens_per_s", "requests_per_s")}
    for metric in STAT_METRICS:
        stats = level.get(metric) or {}
        for s in STATS:
            row[f"{metric}_{s}"] = stats.get(s)
    client = level.get("client") or {}
    row["client_cpu_percent"] = client.get("cpu_percent")
    row["client_loop_lag_ms_p90"] = client.get("loop_lag_ms_p90")
    row["client_loop_lag_ms_p99"] = client.get("loop_lag_ms_p99")
    row["client_send_lag_ms_p99"] = client.get("send_lag_ms_p99")
    row["client_saturated"] = level.get("client_saturated")
    return row


def summary_dict(levels: Sequence[LevelSummary], meta: dict[str, Any] | None = None,
                 warnings: Sequence[str] = ()) -> dict[str, Any]:
    return {**(meta or {}), "levels": [lv.to_dict() for lv in levels], "warnings": list(warnings)}


def write_summary(out: Path, summary: dict[str, Any]) -> list[Path]:
    """summary.json and summary.csv (one row per level)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_JSON).write_text(json.dumps(summary, indent=1))
    rows = [flat_row(lv) for lv in summary["levels"]]
    with open(out / SUMMARY_CSV, "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return [out / SUMMARY_JSON, out / SUMMARY_CSV]


def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _stat(level: dict[str, Any], metric: str, stat: str) -> float | None:
    return (level.get(metric) or {}).get(stat)


def level_label(level: dict[str, Any]) -> str:
    if level.get("mode") == "rate":
        return f"rate {level['request_rate']:g}/s"
    return f"concurrency {level['concurrency']}"


def cost_lines(constrained: dict, free: dict) -> list[str]:
    """Per level: the constrained run's output tok/s and TTFT p50 as a share of the free run's (the same workload)."""
    out = []
    for c, f in zip(constrained["levels"], free["levels"]):
        ratio = c["output_tokens_per_s"] / f["output_tokens_per_s"] if f["output_tokens_per_s"] else float("nan")
        ttft = [lv.get("ttft_ms", {}) or {} for lv in (c, f)]
        p50 = [t.get("p50") for t in ttft]
        ttft_text = f"; TTFT p50 {p50[0]:.1f} ms vs {p50[1]:.1f} ms" if None not in p50 else ""
        out.append(f"{level_label(c)}: constrained {ratio:.3f}x the free output tok/s "
                   f"({c['output_tokens_per_s']:.1f} vs {f['output_tokens_per_s']:.1f}){ttft_text}")
    return out


def markdown_table(levels: Sequence[dict[str, Any]], output_unit: str = "tokens") -> str:
    """One row per level; `output_unit` "chunks" (no tokenizer) puts CHUNKS in every header that is not tokens."""
    if output_unit == "chunks":
        caption = ("**Counted in stream CHUNKS, not tokens** (--count-chunks): a chunk may hold several tokens "
                   "or none.\n\n")
        head = ("| level | requests | errors | output CHUNKS/s | req/s | TTFT p50 ms | TTFT p99 ms | "
                "ms/CHUNK p50 | ms/CHUNK p99 | e2e p50 ms | e2e p99 ms | CHUNKS mean | client |")
    else:
        caption = ""
        head = ("| level | requests | errors | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
                "ITL p99 ms | e2e p50 ms | e2e p99 ms | OSL mean | client |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for lv in levels:
        lines.append(
            f"| {level_label(lv)} | {lv['requests']} | {lv['errors']} | {_f(lv['output_tokens_per_s'])} | "
            f"{_f(lv['requests_per_s'], 2)} | {_f(_stat(lv, 'ttft_ms', 'p50'))} | {_f(_stat(lv, 'ttft_ms', 'p99'))} | "
            f"{_f(_stat(lv, 'itl_ms', 'p50'), 2)} | {_f(_stat(lv, 'itl_ms', 'p99'), 2)} | "
            f"{_f(_stat(lv, 'e2e_ms', 'p50'))} | {_f(_stat(lv, 'e2e_ms', 'p99'))} | "
            f"{_f(_stat(lv, 'output_tokens', 'mean'))} | "
            f"{'**saturated**: ' + lv['client_saturated'] if lv.get('client_saturated') else 'ok'} |"
        )
    return caption + "\n".join(lines) + "\n"


def plot_latency_throughput(levels: Sequence[dict[str, Any]], path: Path, title: str = "",
                            output_unit: str = "tokens") -> Path:
    """Output tokens/s (x) against TTFT and ITL p50/p99 (y), one point per level, labelled."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the orchestrator renders to a file
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [lv["output_tokens_per_s"] for lv in levels]
    for ax, metric, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            ys = [_stat(lv, metric, stat) for lv in levels]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{name} {stat}")
        for lv, x in zip(levels, xs):
            y = _stat(lv, metric, "p50")
            if y is not None:
                ax.annotate(level_label(lv).replace("concurrency ", "c="), (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)
        ax.set_xlabel(f"output {output_unit.upper() if output_unit == 'chunks' else output_unit}/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(out: Path, records: Sequence[RequestRecord], summary: dict[str, Any], title: str = "") -> list[Path]:
    """Records first (the raw truth), then everything derived from them; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    files = [write_records(out / RECORDS, records)]
    files += write_summary(out, summary)
    unit = (summary.get("units") or {}).get("output", "tokens")
    (out / TABLE_MD).write_text(markdown_table(summary["levels"], unit))
    files.append(out / TABLE_MD)
    if summary["levels"]:
        files.append(plot_latency_throughput(summary["levels"], out / PLOT_PNG, title, unit))
    return files
