"""Matrix builds, the pure part: which entries a matrix holds, the spec each one runs, the comparison of their
manifests and the rule that picks the one to promote. No Prefect, no Docker: flows/build_matrix.py runs them.

An entry is one (target, quantization format) of one spec. Entries are checked before any of them runs, so a
typo in the fifth entry does not surface after four builds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

from .. import targets
from ..errors import SpecError
from ..record.report import level_label
from ..spec.schema import Ports, QuantFormat, Spec
from ..spec.load import parse_spec

FORMATS = get_args(QuantFormat)


@dataclass(frozen=True)
class Entry:
    """One candidate of the matrix: the spec's model revision built as `format` for `target`."""

    format: str
    target: str
    deploy_name: str  # its own deployment, removed once the matrix is decided

    @property
    def label(self) -> str:
        return f"{self.format} on {self.target}"


def plan_entries(spec: Spec, formats: list[str], target_names: list[str] | None = None) -> list[Entry]:
    """The matrix's entries in order: every format for every target (default: the spec's own target).

    Raises SpecError with one line naming the first bad entry: an unknown format or target, a duplicate, a
    format the target cannot build, or a deployment name the spec rules refuse.
    """
    if not formats:
        raise SpecError("matrix: give at least one quantization format")
    names = target_names or [spec.target]
    seen: set[tuple[str, str]] = set()
    entries = []
    for target in names:
        try:
            targets.get(target)
        except ValueError as exc:
            raise SpecError(f"matrix target {target!r}: unknown ({exc})") from None
        for fmt in formats:
            if fmt not in FORMATS:
                raise SpecError(f"matrix entry {fmt!r}: unknown quantization format (one of {', '.join(FORMATS)})")
            if (target, fmt) in seen:
                raise SpecError(f"matrix entry {fmt} on {target}: duplicated")
            seen.add((target, fmt))
            entry = Entry(fmt, target, entry_name(spec, fmt, target))
            entry_spec(spec, entry, spec.deploy.ports)  # the target's own rules, as one line naming the entry
            entries.append(entry)
    return entries


def entry_name(spec: Spec, fmt: str, target: str) -> str:
    """`<name>-<format>`, plus the target when it is not the spec's: a valid deployment name (no '_')."""
    parts = [spec.deploy.name, *([target] if target != spec.target else []), fmt.replace("_", "-")]
    return "-".join(parts)


def entry_spec(spec: Spec, entry: Entry, ports: Ports, name: str | None = None) -> Spec:
    """The spec one entry runs: the matrix's spec with the entry's target, format, deployment name and ports.

    Validated from scratch (model_copy would skip the validators that ask the target what it can build).
    """
    data = spec.model_dump(mode="json")
    data["target"] = entry.target
    data["quantization"]["format"] = entry.format
    data["deploy"].update(name=name or entry.deploy_name, ports=ports.model_dump())
    return parse_spec(data, source=f"matrix entry {entry.label}")


def _top_level(manifest: dict) -> dict | None:
    """The benchmark's heaviest level: the highest concurrency (or request rate in rate mode)."""
    levels = (manifest.get("benchmark") or {}).get("levels") or []
    if not levels:
        return None
    return max(levels, key=lambda lv: lv.get("request_rate") or 0 if lv.get("mode") == "rate" else lv["concurrency"])


def _size_bytes(manifest: dict) -> int | None:
    # What a deployment downloads and serves: the packaged repository (reference), else the GPU build.
    steps = manifest.get("steps") or {}
    for name in ("package", "build"):
        st = steps.get(name)
        if st and st.get("status") == "completed":
            return sum(o["bytes"] for o in st.get("outputs", []))
    return None


def comparison_row(entry: Entry, manifest: dict | None, error: str | None = None) -> dict:
    """One row of the comparison, from an entry's run manifest (None when the run left none)."""
    m = manifest or {}
    ev = m.get("evaluation") or {}
    cand, base = ev.get("candidate") or {}, ev.get("baseline") or {}
    ppl, base_ppl = cand.get("perplexity"), base.get("perplexity")
    top = _top_level(m) or {}
    size = _size_bytes(m)
    status = m.get("status") or "failed"
    return {
        "format": entry.format, "target": entry.target, "deployment": entry.deploy_name, "status": status,
        "size_mb": None if size is None else round(size / 1e6, 3),
        "perplexity_delta_pct": (round((ppl - base_ppl) / base_ppl * 100.0, 3) if ppl is not None and base_ppl
                                 else None),
        "greedy_agreement": (cand.get("agreement") or {}).get("token_match_rate"),
        "evaluation": "off" if not ev else "passed" if ev.get("passed") else "failed",
        "level": level_label(top) if top else None,
        "output_tokens_per_s": top.get("output_tokens_per_s"),
        "ttft_ms_p50": (top.get("ttft_ms") or {}).get("p50"),
        "ttft_ms_p99": (top.get("ttft_ms") or {}).get("p99"),
        "cause": error or m.get("error"),
    }


def passed_every_gate(row: dict) -> bool:
    """A completed run passed every gate it had (evaluation, benchmark gate, smoke inference, rollout watch):
    build_and_deploy fails the run on any of them. It must also have a throughput to rank."""
    return row["status"] == "completed" and row["evaluation"] != "failed" and row["output_tokens_per_s"] is not None


def pick_best(rows: list[dict]) -> dict | None:
    """The candidate to promote: among those that passed every gate, the highest output tok/s at the top
    benchmark level; a tie goes to the lower TTFT p99, then to the earlier entry. None when none passed."""
    eligible = [(i, r) for i, r in enumerate(rows) if passed_every_gate(r)]
    if not eligible:
        return None
    p99 = lambda r: math.inf if r["ttft_ms_p99"] is None else r["ttft_ms_p99"]  # noqa: E731
    return min(eligible, key=lambda ir: (-ir[1]["output_tokens_per_s"], p99(ir[1]), ir[0]))[1]


def _cell(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def markdown(matrix_id: str, spec: Spec, rows: list[dict], best: dict | None, promoted: str | None) -> str:
    """The comparison as a markdown report: one row per entry, then the decision and its rule."""
    cols = ["format", "target", "status", "size_mb", "perplexity_delta_pct", "greedy_agreement", "level",
            "output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99"]
    lines = [f"# stoker matrix `{matrix_id}`: {spec.deploy.name}",
             "", f"- model: `{spec.model.repo_id or spec.model.local_path}` revision `{spec.model.revision}`",
             "- rule: among the entries that passed every gate, the highest output tok/s at the top benchmark "
             "level; ties go to the lower TTFT p99",
             f"- best: {'`' + best['format'] + '` on `' + best['target'] + '`' if best else 'none passed every gate'}",
             f"- promoted: {promoted or 'no'}", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in cols) + " |" for r in rows]
    failed = [r for r in rows if r["cause"]]
    if failed:
        lines += ["", "## Causes", ""] + [f"- {r['format']} on {r['target']}: {r['cause']}" for r in failed]
    return "\n".join(lines) + "\n"
