"""Running build_and_deploy from the command line (`stoker run`, `stoker demo`) and printing what it did.

The one module of stoker that imports a flow: the commands start flows, every other module of stoker sits below
them (the layers in pyproject.toml's [tool.importlinter]).
"""

from __future__ import annotations

import json


def run_flow(spec, before=None, force: bool = False) -> tuple[dict, str | None]:
    """Run build_and_deploy on whatever Prefect API is configured (ephemeral when none); returns the manifest and
    the flow run's id. ``before(flow)`` runs once the flow is imported, before it starts; ``force``: the flow's
    (deploy even a build `stoker rollback` rolled back)."""
    from .stack.prefect_ephemeral import prepare_temporary_api, stop_ephemeral_api

    prepare_temporary_api()  # before the flow's import starts anything of Prefect's
    from flows.build_and_deploy import build_and_deploy

    from .run import RunContext

    try:
        if before is not None:
            before(build_and_deploy)
        state = build_and_deploy(spec, home=str(RunContext.new().home), force=force, return_state=True)
        return state.result(), state.state_details.flow_run_id and str(state.state_details.flow_run_id)
    finally:
        stop_ephemeral_api()  # before our summary, so 'manifest: <path>' really is the last line


def run_fleet_rollback(spec, to_run: str | None, reason: str) -> dict:
    """rollback_fleet (flows/rollback_fleet.py) on the configured Prefect API, the one the hosts' workers poll."""
    from flows.rollback_fleet import rollback_fleet

    return rollback_fleet(spec, to_run=to_run, reason=reason)


def print_summary(manifest: dict, ui: str | None = None) -> None:
    from .record.report import level_label
    from .run import RunContext

    ctx = RunContext(run_id=manifest["run_id"], home=RunContext.new().home)
    for name, st in manifest["steps"].items():
        print(f"  {name:<10} {st['status']:<9} {'cache hit' if st['cache_hit'] else 'ran':<9} {st['duration_s']:8.2f} s")
    measured = [("", manifest["benchmark"]["levels"]),
                 *((f"adapter {name}, ", lvs) for name, lvs in manifest["benchmark"].get("adapters", {}).items())]
    for who, levels in measured:
        for lv in levels:
            ttft, itl = lv["ttft_ms"]["p50"], lv["itl_ms"]["p50"]
            print(f"  {who}{level_label(lv)}: {lv['output_tokens_per_s']:.1f} output tok/s, "
                  f"TTFT p50 {_ms(ttft)}, ITL p50 {_ms(itl)}, errors {lv['errors']}/{lv['requests']}")
    ep = manifest["endpoint"]
    if ep:
        body = json.dumps({"text_input": "The quick brown fox", "max_tokens": 16, "stream": True})
        print(f"endpoint: {ep['http']} (gRPC {ep['grpc']})")
        print(f"try it:   curl -sN -X POST {ep['http']}/v2/models/ensemble/generate_stream -d '{body}'")
        if ep.get("openai"):
            adapters = [a["name"] for a in manifest["spec"].get("adapters", [])]
            also = f"; LoRA adapters: {', '.join(map(repr, adapters))}" if adapters else ""
            print(f"OpenAI:   {ep['openai']} (model \"{manifest['spec']['deploy']['name']}\"{also})")
    if ui:
        print(f"Prefect:  {ui} (the run, its logs and artifacts; `stoker down` stops the server)")
    print(f"report: {ctx.run_dir / 'report.md'}")
    print(f"manifest: {ctx.run_dir / 'manifest.json'}")


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.2f} ms"
