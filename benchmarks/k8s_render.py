"""benchmarks/results/k8s_render.json: per example spec (deployments/specs/), the Kubernetes objects
`stoker render --kubernetes` writes, how many validate strictly offline (stoker/kubernetes/validate.py), the rollout
strategy chosen, and whether the pod ran here (benchmarks/k8s_pod_here.py). No cluster is involved.

    python benchmarks/k8s_render.py [--no-pod]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure_spec(spec_path: Path, outdir: Path) -> dict:
    from stoker.commands.render import render_kubernetes
    from stoker.errors import StokerError
    from stoker.kubernetes import validate, workpool

    digest = hashlib.sha256(spec_path.name.encode()).hexdigest()  # any build: the objects' shape does not depend on it
    started = time.perf_counter()
    try:
        out = render_kubernetes(spec_path, outdir, digest)
    except StokerError as err:
        return {"spec": spec_path.name, "refused": str(err), "objects_rendered": 0, "validated_strictly": 0}
    objs = [*out["objects"], workpool.filled_manifest(out["work_pool"])]
    rows = [{"kind": obj["kind"], "name": obj["metadata"]["name"],
             **({"invalid": str(r)} if isinstance(r, validate.Invalid) else {"against": r})}
            for obj, r in zip(objs, validate.check_all(objs))]
    return {"spec": spec_path.name, "colour": out["colour"], "strategy": out["strategy"].kind,
            "gpus_per_pod": out["strategy"].gpus_per_pod,
            "deployment_strategy": out["strategy"].deployment_strategy, "note": out["strategy"].note,
            "objects_rendered": len(rows), "validated_strictly": sum("against" in r for r in rows),
            "kinds": sorted({r["kind"] for r in rows}), "objects": rows,
            "render_and_validate_s": round(time.perf_counter() - started, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-pod", action="store_true", help="skip the podman pod run")
    args = parser.parse_args()
    import kubernetes_validate

    from stoker.kubernetes import validate

    specs = sorted((ROOT / "deployments" / "specs").glob("*.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        per_spec = [measure_spec(p, Path(tmp) / p.stem) for p in specs]
    pod = {"ran_here": False, "why": "not attempted (--no-pod)"} if args.no_pod else __import__(
        "k8s_pod_here").run_pod()
    for s in per_spec:  # the one pod run is a CPU pod: a GPU spec's pod needs GPUs, which this machine lacks
        gpu = s.get("gpus_per_pod", 0) > 0
        s["pod_ran_here"] = bool(pod["ran_here"] and not gpu)
        s["pod_why"] = "needs GPUs (none here)" if gpu else pod.get("why", "ran (benchmarks/k8s_pod_here.py)")
    result = {
        "machine": "2 cores, no GPU, no Kubernetes API server (none obtainable here)",
        "kubernetes_validate": kubernetes_validate.__version__,
        "kubernetes_versions": list(validate.VERSIONS), "gateway_api": validate.GATEWAY_API,
        "httproute_validator": f"{validate.PACKAGE} {json.loads((validate.NODE_DIR / 'package.json').read_text())['dependencies'][validate.PACKAGE]}"
                               " (infra/kubernetes) after stoker's own HTTPRoute field list",
        "specs": len(per_spec), "objects_rendered": sum(s["objects_rendered"] for s in per_spec),
        "validated_strictly": sum(s["validated_strictly"] for s in per_spec),
        "refused": [s["spec"] for s in per_spec if "refused" in s],
        "pod": pod, "per_spec": per_spec,
    }
    out = ROOT / "benchmarks" / "results" / "k8s_render.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['specs']} specs: {result['validated_strictly']}/{result['objects_rendered']} objects valid; "
          f"pod ran here: {pod['ran_here']} ({pod.get('why', '')[:100]})")


if __name__ == "__main__":
    main()
