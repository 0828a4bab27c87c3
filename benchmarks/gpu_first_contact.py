"""Every example GPU spec under deployments/specs, first run and a rebuild while serving, under each rollout its GPUs
allow (surge, shared, reload; as written and with one more backend's worth of GPUs): whether stoker plans it, where
each container would run (build, bf16 baseline, candidate) and the peak each GPU's memory reaches on the stand-in's
ledger (stoker/gpu/standin_ledger.py: TensorRT-LLM's KV sizing from the memory free at start, the build's estimated
peak from stoker/gpu/placement.py). Arithmetic with each spec's own model shapes (known_models.json), the same code a
run and the stand-in use; no GPU and no TensorRT-LLM ran. Writes benchmarks/results/gpu_first_contact.json.

    python3 benchmarks/gpu_first_contact.py [OUT.json]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stoker.errors import PlanRefused  # noqa: E402
from stoker.gpu import decision, placement, planning, rollout  # noqa: E402
from stoker.gpu import standin_ledger as ledger  # noqa: E402
from stoker.spec.load import parse_spec  # noqa: E402

GIB = 1 << 30


def _gib(n: int) -> float:
    return round(n / GIB, 2)


def backend_on(spec, facts, planned, held: dict[int, int], gpus: tuple[int, ...], cap: int | None) -> int:
    """Admit one backend on ``gpus`` as the stand-in's ledger does; returns what it takes per GPU."""
    minimum, take = ledger.backend_sizing(spec, facts, None, cap)
    return ledger.admit("backend", gpus, planned.gpu_bytes, held, minimum, take)


def load_through_rollouts(results: Path) -> dict:
    """The operate benchmark's load through each GPU rollout on the stand-in (`benchmarks/operate.py --target
    tensorrt --gpu-rollout R --rollouts-only`, run separately: containers, minutes), summarised from its JSON."""
    out: dict = {}
    for choice in ("surge", "shared", "reload"):
        f = results / f"operate_tensorrt_standin_{choice}.json"
        if not f.is_file():
            out[choice] = "not run (benchmarks/operate.py --target tensorrt --gpu-rollout " + choice + ")"
            continue
        d = json.loads(f.read_text())
        rollouts = [p for p in d["phases"] if p["phase"].startswith(("replace", "stoker rollback"))]
        out[choice] = {"file": f.name, "date": d["meta"]["date"], "requests": d["load"]["requests"],
                       "failed": d["load"]["failed"], "truncated": d["load"]["truncated"],
                       "per_rollout": [{"phase": p["phase"], "requests": p["requests"], "failed": p["failed"],
                                        "truncated": p["truncated"], "gpus_after": p.get("gpus_after"),
                                        "endpoint_503_s": (p.get("result") or {}).get("gap_s")
                                        if isinstance(p.get("result"), dict) else None,
                                        "errors": [e.splitlines()[0][:100] for e in p["errors"][:2]]}
                                       for p in rollouts]}
    return out


def scenario(spec, facts) -> dict:
    """First run, then a rebuild of another revision while the first serves (its baseline missing too)."""
    planned = rollout.plan_rollout(spec, facts)
    out: dict = {"rollout": planned.choice, "gpu": planned.gpu, "gpus": list(spec.gpus.ids), "steps": []}
    cap = planned.max_tokens_in_paged_kv_cache if planned.choice == "shared" else None
    peak = {g: 0 for g in spec.gpus.ids}
    held = {g: 0 for g in spec.gpus.ids}

    def note(step: str, gpus, taken: int) -> None:
        for g in gpus:
            peak[g] = max(peak[g], held[g] + taken)
        out["steps"].append({"step": step, "gpus": list(gpus), "gib_per_gpu": _gib(taken)})

    def hold(gpus, taken):
        for g in gpus:
            held[g] += taken

    for phase, serving in (("first run", ()), ("rebuild while serving", tuple(planned.blue))):
        d = decision.decide(spec, facts, serving)  # PlanRefused: the run refuses here, before any heavy step
        build = d["build"]
        need = max(build["need_bytes"].values())
        ledger.admit(f"{phase}: build", tuple(build["gpus"]), planned.gpu_bytes, held, need)
        note(f"{phase}: build ({build['where']})", build["gpus"], need)
        base = d["baseline"]
        if spec.quantization.format != "none":
            if base["gpus"] is None:
                out["steps"].append({"step": f"{phase}: bf16 baseline", "refused": base["why"]})
            else:
                bf16 = spec.model_copy(update={"quantization": spec.quantization.model_copy(
                    update={"format": "none", "kv_cache_dtype": "none"})})
                taken = backend_on(bf16, facts, planned, held, tuple(base["gpus"]), None)
                note(f"{phase}: bf16 baseline (staged, scored, removed)", base["gpus"], taken)
        cand = tuple(d["candidate"])
        if serving and planned.choice == "reload":
            hold(serving, -held[serving[0]])  # the live backend drains and stops first
        taken = backend_on(spec, facts, planned, held, cand, cap)
        note(f"{phase}: candidate", cand, taken)
        hold(cand, taken)
        if serving and planned.choice != "reload":
            hold(serving, -(held[serving[0]] - (taken if set(serving) == set(cand) else 0)))  # the old one retires
    out["peak_gib_per_gpu"] = {str(g): _gib(v) for g, v in peak.items()}
    out["gpu_gib"] = _gib(planned.gpu_bytes)
    return out


def main(argv: list[str]) -> int:
    out_path = Path(argv[0]) if argv else ROOT / "benchmarks" / "results" / "gpu_first_contact.json"
    rows = []
    for path in sorted((ROOT / "deployments" / "specs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if data.get("target", "reference") == "reference":
            continue
        world = (data.get("parallel") or {}).get("tensor", 1) * (data.get("parallel") or {}).get("pipeline", 1)
        count = data["gpus"].get("count", 1)
        for choice in ("auto", "surge", "shared", "reload"):
            for n in sorted({count, count + world}):
                variant = json.loads(json.dumps(data))
                variant["gpus"].update(count=n, rollout=choice)
                spec = parse_spec(variant)
                facts = planning.model_facts(spec)
                row = {"spec": path.name, "gpus.rollout": choice, "gpus.count": n}
                try:
                    rollout.plan_rollout(spec, facts)
                    placement.plan_rebuild(spec, facts, rollout.plan_rollout(spec, facts))
                    row |= {"plan": "ok"} | scenario(spec, facts)
                except (PlanRefused, ledger.OutOfMemory) as err:
                    row |= {"plan": "refused", "why": str(err)}
                rows.append(row)
    result = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": len(rows),
                       "what": "arithmetic: stoker's placement and the stand-in ledger's formulas with each spec's "
                               "own model shapes; no GPU, no TensorRT-LLM, no container ran",
                       "not_measured": "the example specs' own models under load: the load below is the operate "
                                       "deployment's (a scripted ensemble on the stand-in image), one spec shape"},
              "rows": rows, "load_through_rollouts": load_through_rollouts(out_path.parent)}
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    ok = sum(r["plan"] == "ok" for r in rows)
    print(f"{len(rows)} cases, {ok} planned, {len(rows) - ok} refused at plan -> {out_path}")
    for r in rows:
        print(f"{r['spec']:42} {r['gpus.rollout']:7} x{r['gpus.count']}: "
              + (f"{r['rollout']:7} peak GiB/GPU {r['peak_gib_per_gpu']} of {r['gpu_gib']}" if r["plan"] == "ok"
                 else f"REFUSED {r['why'][:110]}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
