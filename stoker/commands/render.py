"""`stoker render SPEC OUTDIR`: everything a GPU host would execute, written without running anything heavy.

OUTDIR/commands.json   the argv, image, mounts, GPUs, shm/ulimits of every container step (secrets by name only)
OUTDIR/model_repository/  the complete Triton repository except engine/checkpoint files

`stoker render SPEC OUTDIR --kubernetes --digest D [--colour C]`: instead, the serving objects of one colour for a
cluster (stoker/kubernetes/), and the Prefect Kubernetes work pool's base job template:

OUTDIR/kubernetes/<deploy.name>-<colour>.yaml   Deployment, both colours' Services, PodDisruptionBudget, [HPA],
                                                 the stable Service, [HTTPRoute]: one YAML stream
OUTDIR/kubernetes/work-pool.json                 `prefect work-pool create … --type kubernetes --base-job-template`
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..errors import StokerError


class RenderError(StokerError):
    """The output folder cannot be written."""


def render(spec_path: Path, outdir: Path) -> dict:
    """Write commands.json and model_repository/ for a GPU-target spec; returns commands.json's content."""
    from .. import target_traits
    from ..gpu import matrix, planning, repository, rollout, trtllm
    from ..cache.keys import calibration_file
    from ..spec.load import load_spec

    spec = load_spec(spec_path)
    outdir = outdir.resolve()
    repo = outdir / "model_repository"
    if repo.exists() and any(repo.iterdir()):
        raise RenderError(f"{repo} is not empty; render into a new folder")
    traits = target_traits.of(spec.target)
    if traits.runs_on != "gpu":
        return _render_reference(spec, spec_path, outdir, repo)
    facts, findings = planning.check_spec(spec)
    work = outdir / "work"
    slot = repo / "tensorrt_llm" / "1"
    ws = trtllm.Workspace(
        hf=work / "hf", calibration=calibration_file(spec),
        # The PyTorch backend serves the unified checkpoint from the repository; beside an engine it is a work file.
        unified=slot / "checkpoint" if traits.pytorch_backend else work / "unified",
        checkpoint=work / "trtllm_checkpoint", engine=slot / "engine", timing_cache=work / "timing",
        repository=repo, stoker_src=planning.stoker_src())
    packaged = repository.write_repository(spec, facts, repo)
    steps = trtllm.gpu_steps(spec, facts, ws)
    gpu = matrix.gpu_info(spec.gpus.type)
    doc = {
        "spec": str(spec_path), "target": spec.target,
        "image": planning.image_summary(spec),
        "gpus": {"type": spec.gpus.type, "sm": gpu.sm if gpu else None, "device_ids": spec.gpus.ids,
                 "tensor_parallel": spec.parallel.tensor, "pipeline_parallel": spec.parallel.pipeline},
        "model": {"repo_id": spec.model.repo_id, "revision": spec.model.revision,
                  "facts": asdict(facts) if facts else None},
        "workspace": {k: str(v) for k, v in asdict(ws).items()},
        "steps": [s.to_json() for s in steps],
        # Every backend gets its own loopback ports from stoker/serving; shown here on the spec's own ports.
        "serve_command": trtllm.serve_command(spec, spec.deploy.ports, ["<Triton's restricted admin APIs>"]),
        "repository": packaged,
        "notes": [f.line() for f in findings],
        "rollout": planned.to_dict() if (planned := rollout.plan_rollout(spec, facts)) else None,
        "not_run_here": "TensorRT-LLM is not installed on stoker's machines: these steps were rendered and "
                        "contract-tested, not executed.",
    }
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "commands.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def _render_reference(spec, spec_path: Path, outdir: Path, repo: Path) -> dict:
    """The CPU reference path has no container steps (its heavy work runs in child processes): configs and
    python models only; weights and tokenizer come from the build step."""
    from ..triton.config import render_all
    from ..triton.models import install_model_code
    from ..triton.repository import EMPTY_DIRS, settings_for

    for name, text in render_all(settings_for(spec.triton)).items():
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        (repo / name / "config.pbtxt").write_text(text)
    install_model_code(repo)
    doc = {"spec": str(spec_path), "target": spec.target, "image": {"image": spec.deploy.image}, "steps": [],
           "repository": {"layout": "ensemble (reference)", "empty_dirs": list(EMPTY_DIRS),
                          "pending": ["tensorrt_llm/1/weights/", "preprocessing/1/tokenizer/",
                                      "postprocessing/1/tokenizer/"]},
           "notes": ["target reference: no container steps; quantize/build run in child processes (stoker run)"]}
    (outdir / "commands.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def render_kubernetes(spec_path: Path, outdir: Path, digest: str, colour: str | None = None) -> dict:
    """Write one colour's objects and the work pool's template into OUTDIR/kubernetes/ (each file written to a temp
    name, then renamed); returns what was written. PlanRefused (one line) before anything is written."""
    import re

    import yaml

    from ..atomic import write_atomic
    from ..containers import argv_secret
    from ..kubernetes import objects, strategy, workpool
    from ..spec.kubernetes import Kubernetes
    from ..spec.load import load_spec

    if not re.fullmatch(r"[0-9a-f]{64}", digest or ""):
        raise RenderError(f"--digest {digest!r}: give the build's repository digest (64 hex digits; a run's manifest "
                          "and `stoker status` show it)")
    spec = load_spec(spec_path)
    if spec.kubernetes is None:  # a spec without the section renders with its defaults
        spec = spec.model_copy(update={"kubernetes": Kubernetes()})
    chosen = strategy.derive(spec, colour)
    colour = colour or spec.kubernetes.live
    objs = objects.render(spec, chosen, colour, digest)
    pool = workpool.base_job_template(spec)
    folder = outdir.resolve() / "kubernetes"
    manifest = folder / f"{objects.colour_name(spec, colour)}.yaml"
    write_atomic(manifest, yaml.safe_dump_all(objs, sort_keys=False))
    write_atomic(folder / "work-pool.json", json.dumps(pool, indent=2) + "\n")
    shim = folder / objects.SHIM_FILE  # the serving pods preload it from the ConfigMap argv_secret_configmap names
    tmp = shim.with_name(f".{shim.name}.tmp")
    tmp.write_bytes(argv_secret.build().read_bytes())
    tmp.replace(shim)
    return {"spec": str(spec_path), "colour": colour, "strategy": chosen, "objects": objs, "work_pool": pool,
            "files": [manifest, folder / "work-pool.json", shim]}


def _render_kubernetes(args) -> int:
    from ..kubernetes import validate, workpool

    out = render_kubernetes(args.spec, args.outdir, args.digest, args.colour)
    print(f"{out['colour']}: {out['strategy'].kind}: {out['strategy'].note}")
    shim, pod = out["files"][-1], out["objects"][0]["spec"]["template"]["spec"]
    configmap = next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "argv-secret")
    print(f"the serving pods preload {shim.name} (keeps Triton's admin token off the command line): "
          f"kubectl -n {out['objects'][0]['metadata']['namespace']} create configmap {configmap} "
          f"--from-file={shim.name}={shim}")
    try:
        checked = validate.validate_all([*out["objects"], workpool.filled_manifest(out["work_pool"])])
        print(f"validated {len(checked)} objects strictly ({', '.join(sorted({s for c in checked for s in c}))})")
    except ImportError:
        print("not validated: kubernetes-validate is not installed (pip install kubernetes-validate==1.37.0)")
    except validate.NotInstalled as err:
        print(f"not validated: {err}")
    for f in out["files"]:
        print(f"wrote {f}")
    return 0


def _render(args) -> int:
    if args.kubernetes:
        return _render_kubernetes(args)
    if args.digest or args.colour:
        raise RenderError("--digest and --colour go with --kubernetes")
    doc = render(args.spec, args.outdir)
    print(f"target {doc['target']} on {doc['image']['image']} (TRT-LLM {doc['image'].get('trtllm')})")
    for s in doc["steps"]:
        print(f"  {s['name']:<10} {' '.join(s['argv'])[:110]}")
    for n in doc["notes"]:
        print(f"  note: {n}")
    print(f"wrote {args.outdir / 'commands.json'} and {args.outdir / 'model_repository'}/")
    return 0


def register(sub) -> None:
    s = sub.add_parser("render", help="write a GPU spec's container commands and Triton repository, or with "
                       "--kubernetes its cluster objects (runs nothing)")
    s.add_argument("spec", type=Path)
    s.add_argument("outdir", type=Path)
    s.add_argument("--kubernetes", action="store_true", help="write OUTDIR/kubernetes/: one colour's Deployment, "
                   "Services, PodDisruptionBudget, HPA, HTTPRoute and the Prefect Kubernetes work pool")
    s.add_argument("--digest", default=None, help="with --kubernetes: the build's repository digest the pods sync")
    s.add_argument("--colour", choices=["blue", "green"], default=None,
                   help="with --kubernetes: the colour to render (default: kubernetes.live)")
    s.set_defaults(fn=_render)
