"""Pure rendering of the run report (markdown) and the benchmark table."""

from __future__ import annotations


def _fmt(v, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def level_label(lv: dict) -> str:
    """'concurrency 4' or 'rate 2.5/s': what a level held fixed."""
    if lv.get("mode") == "rate":
        return f"rate {lv.get('request_rate'):g}/s"
    return f"concurrency {lv['concurrency']}"


def benchmark_rows(manifest: dict) -> list[dict]:
    """One row per level: the base's, then each LoRA adapter's (its name before the level)."""
    rows = []
    bench = manifest["benchmark"]
    for adapter, levels in [(None, bench["levels"]), *sorted((bench.get("adapters") or {}).items())]:
        rows += [_row(lv, f"{adapter}: " if adapter else "") for lv in levels]
    return rows


def _row(lv: dict, prefix: str) -> dict:
    return {
        "level": prefix + level_label(lv), "requests": lv["requests"], "errors": lv["errors"],
        "ttft_ms_p50": lv["ttft_ms"]["p50"], "ttft_ms_p99": lv["ttft_ms"]["p99"],
        "itl_ms_p50": lv["itl_ms"]["p50"], "itl_ms_p99": lv["itl_ms"]["p99"],
        "e2e_ms_p50": lv["e2e_ms"]["p50"], "e2e_ms_p99": lv["e2e_ms"]["p99"],
        "output_tokens_per_s": lv["output_tokens_per_s"], "requests_per_s": lv["requests_per_s"],
    }


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return ["(none)"]
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    return lines


def markdown(manifest: dict, manifest_uris: list[str]) -> str:
    spec, model = manifest["spec"], manifest["model"]
    q = spec["quantization"]
    lines = [
        f"# stoker run `{manifest['run_id']}`: {manifest['status']}",
        "",
        f"- model: `{model['repo_id'] or model['local_path']}` revision `{model['revision']}` → sha `{model['sha']}`",
        f"- quantization: `{q['format']}` (kv cache `{q['kv_cache_dtype']}`), target `{spec['target']}`",
        f"- spec digest: `{manifest['spec_digest'][:16]}`",
        f"- endpoint: {manifest['endpoint'] or 'not deployed'}",
        f"- serving backend: {_backend(manifest.get('backend'))}",
        f"- wall {manifest['wall_s']:.1f} s, flow overhead {manifest['overhead_s']:.1f} s",
    ]
    if manifest.get("error"):
        lines.append(f"- **error:** {manifest['error']}")
    lines += ["", "## Steps", "", "| step | status | cache hit | duration s | outputs | digest |", "|---|---|---|---|---|---|"]
    for name, st in manifest["steps"].items():
        size = sum(o["bytes"] for o in st["outputs"])
        lines.append(f"| {name} | {st['status']} | {'yes' if st['cache_hit'] else 'no'} | {st['duration_s']:.2f} | "
                     f"{len(st['outputs'])} files, {size / 1e6:.2f} MB | `{(st.get('digest') or '-')[:16]}` |")
    lines += ["", "## Benchmark", ""] + _table(benchmark_rows(manifest))
    if manifest.get("evaluation"):
        ev = manifest["evaluation"]
        check = ev["baseline"]["check"]
        lines += ["", "## Evaluation (against the unquantized build)", "",
                  f"- **{'passed' if ev['passed'] else 'FAILED'}**" + (f": {ev['cause']}" if ev.get("cause") else "")
                  + (" (measurement reused: same served digest, data and code)" if ev.get("cache_hit") else ""),
                  f"- data: {ev['data']['source']}: {ev['data']['windows']} windows, {ev['data']['prompts']} "
                  f"prompts × {ev['data']['greedy_tokens']} tokens",
                  (f"- baseline checked against {check['against']}: max |Δ log prob| "
                   f"{check['max_abs_log_prob_diff']:.2e} over {check['positions']} positions (tolerance "
                   f"{check['tolerance']:g})" if check.get("passed") is not None
                   else f"- baseline not checked: {check['against']}"), "",
                  ev["table"].rstrip("\n")]
    if manifest.get("rollout"):
        ro = manifest["rollout"]
        prev = (ro.get("previous") or {}).get("digest")
        lines += ["", "## Rollout", "", f"- strategy `{ro.get('strategy')}`"
                  + (f", live version {ro['version']}" if ro.get("version") else "")
                  + f", previous `{(prev or 'nothing')[:16]}`"
                  + (", reused (the digest already served)" if ro.get("reused") else "")]
        sw = ro.get("switch") or {}
        if sw.get("switched"):
            lines.append(f"- switched in {sw['switch_s'] * 1000:.0f} ms; watched {sw['watch_s']:.0f} s: "
                         f"{sw['watch_requests']:g} requests, {sw['watch_failures']:g} failed"
                         + (f"; old backend retired after {sw['retire_s']:.1f} s" if "retire_s" in sw else ""))
    if manifest.get("rollback"):
        rb = manifest["rollback"]
        lines += ["", "## Rollback", "", f"- **{rb.get('status')}**: {rb.get('action')}"
                  + (f" ({rb['duration_s']:.1f} s)" if rb.get("duration_s") else "")]
        if rb.get("error"):
            lines.append(f"- error: {rb['error']}")
    if manifest.get("triton_metrics"):
        lines += ["", "## Triton metrics (since server start)", ""] + _table(manifest["triton_metrics"])
    lines += ["", "## Versions", ""] + [f"- {k}: {v}" for k, v in manifest["versions"].items()]
    lines += ["", "## Manifest", ""] + [f"- {u}" for u in manifest_uris]
    return "\n".join(lines) + "\n"


def _backend(b: dict | None) -> str:
    if not b:
        return "none"
    return (f"{b.get('container')} (slot {b.get('slot', '?')}, digest `{str(b.get('digest') or '')[:16]}`, "
            f"{b.get('http')})")
