"""`reference`: stoker's own CPU runtime in Triton's python backend, in TensorRT-LLM's ensemble layout.

Quantization (ModelOpt PTQ) and the build (dequantize with the checkpoint's scales) run in child
processes on the orchestrator's machine. A new build is staged as a candidate behind the deployment's
stable endpoint and evaluated on its own ports; only then does traffic switch to it (tasks/rollout.py).
"""

from __future__ import annotations

from .. import target_traits
from .base import StepRunner, Target

# The CPU image's tritonserver is a GPU build: unasked, it tries pinned memory and GPU metrics at every start and
# logs each failure as a warning. Every config.pbtxt stoker renders for this layout is complete, so auto-complete
# would only start one more python stub per model at each load (an interpreter and the model's imports: about 3 s
# of a backend's start on 2 cores).
CPU_ARGS = ("--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", "--disable-auto-complete-config")
# export_hf_checkpoint asserts "Invalid KV cache quantization format" for int8 KV (CPU, nvidia-modelopt 0.47).
_KV_UNEXPORTABLE = {"int8": "kv_cache_dtype 'int8' cannot be exported by nvidia-modelopt 0.47; use 'fp8'"}


class Reference(Target):
    traits = target_traits.REFERENCE
    name, runs_on, layout = traits.name, traits.runs_on, traits.layout
    evaluates = True
    serves_adapters = True

    def check_quantization(self, q) -> None:
        runs = ("none", *self.formats())
        if q.format not in runs:
            from . import get, names

            gpu = " or ".join(n for n in names() if get(n).runs_on == "gpu")
            raise ValueError(f"format {q.format!r} needs a GPU target ({gpu}); "
                             f"the reference path runs {', '.join(runs)}")
        if q.kv_cache_dtype in _KV_UNEXPORTABLE:
            raise ValueError(_KV_UNEXPORTABLE[q.kv_cache_dtype])

    def plan(self, spec, ctx) -> list:
        from ..gpu.planning import model_facts
        from ..cache.keys import build_key, fetch_key, package_key, quantize_key
        from ..plan.rows import PlannedStep, benchmark_step, cached_row, package_row, serving_step, upload_step
        from ..storage.source import resolve_source

        self.check_model(spec, model_facts(spec))
        out: list[PlannedStep] = []
        source_id, source = resolve_source(spec)
        row, digest = cached_row(spec, ctx, "fetch", fetch_key(spec, source_id), f"sha {source.get('sha')}")
        out.append(row)
        weights = digest
        for name, keyfn in (("quantize", quantize_key), ("build", build_key), ("package", package_key)):
            if digest is None:
                out.append(PlannedStep(name, None, "pending", "key known once the previous step has run"))
                continue
            row, digest = (package_row(spec, ctx, keyfn, digest, weights) if name == "package"
                           else cached_row(spec, ctx, name, keyfn(spec, digest)))
            out.append(row)
        out.append(upload_step(spec, digest))
        deploy = serving_step(spec, digest)
        out += [deploy, benchmark_step(spec, ctx, deploy.backend)]
        return out

    def build(self, steps: StepRunner, spec, fetched, ctx):
        quantized = steps.run("quantize", steps.tasks.quantize_weights, spec, fetched, ctx)
        return steps.run("build", steps.tasks.build_reference, spec, quantized, ctx)

    def package(self, steps: StepRunner, spec, fetched, built, ctx):
        lora = steps["adapters"] if "adapters" in steps else None
        return steps.run("package", steps.tasks.package_repository, spec, built, ctx, lora)

    def start_baseline(self, steps: StepRunner, spec, ctx):
        """The `none` build of the same revision, scored by the runtime in a child process (Prefect task
        future: it runs while the candidate container starts)."""
        if not spec.evaluation.enabled:
            return None
        lora = steps["adapters"] if "adapters" in steps else None  # each adapter scored on the same build
        return steps.tasks.baseline_reference.submit(spec, steps["fetch"], steps["eval-data"], ctx, lora).result

    def repository_of(self, packaged, uploaded) -> str:
        return uploaded.detail.get("repository_uri", "")  # Triton loads the repository straight from S3

    def backend(self, spec, repository: str, gpus: tuple[int, ...], standin_ran: bool = False) -> dict:
        return {"image": spec.deploy.image, "repository_uri": repository, "extra_args": list(CPU_ARGS)}


TARGET = Reference()
