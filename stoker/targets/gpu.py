"""What the GPU targets share: one cached build step in the pinned serving image, and what a backend runs.

Quantize, checkpoint and engine run as container steps of a single "build" (one cache key, so a hit
skips all GPU work); `stoker plan` runs the version matrix and GPU rules (stoker/gpu/rules.py) before
any GPU time. Serving is stoker/serving's, as for every target: this module supplies only what differs (the
serving image, its command, the repository mounted from the package step, the device ids per backend).
A subclass says what its build leaves behind and what goes into its repository.

With the stand-in (STOKER_STANDIN=1 at the run's start, recorded in its RunContext: stoker/gpu/standin.py) two things
are replaced, nothing else: the build runs
the reference path's quantize + build and its artifact goes where the engine would, and backends run the
stand-in image with their device requests dropped (still rendered and labelled).
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import nullcontext
from pathlib import Path

from ..gpu import standin
from ..run import StepResult
from .base import StepRunner, Target

GPUS_LABEL = "ai.stoker.gpus"  # the device ids a backend was given (or, under the stand-in, would have been)


class GpuTarget(Target):
    # By contract (no TensorRT-LLM here): the baseline is the bf16 (`none`) build of the same weights,
    # scored through its own endpoint by the same code as any candidate and checked against transformers;
    # that run records it in S3 for the quantized builds (tasks/evaluate.py).
    evaluates = True
    baseline_source = "recorded"
    baseline_tolerance = 0.1  # a bf16 engine against float32 transformers
    # Whether every config.pbtxt of its layout is complete, so Triton runs it without auto-complete.
    complete_configs = False

    def plan(self, spec, ctx) -> list:
        from ..plan.gpu import plan_gpu

        standin.check(spec)
        rows = plan_gpu(spec, ctx)
        if standin.applies(spec, ctx.standin):
            from ..plan.rows import PlannedStep

            rows.insert(0, PlannedStep("standin", None, "ON", standin.NOTE + "; needs a GPU host for the real run: "
                                       "the build (ModelOpt export, trtllm-build) and the TensorRT-LLM backend"))
        return rows

    def check_model(self, spec, facts) -> None:
        standin.check(spec)  # before any download, like every refusal of the model
        if spec.deploy.rollout == "reload":
            from ..errors import PlanRefused

            raise PlanRefused("deploy.rollout: reload loads a new version from S3 into the live backend; a GPU backend "
                              "mounts its engine from the host: use deploy.rollout: replace with gpus.rollout "
                              "(surge, shared or reload)")
        super().check_model(spec, facts)

    def heavy_slot(self, spec=None, ctx=None):
        # STAND-IN: the build runs on the CPU, so no GPU slot is held.
        on_cpu = spec is not None and ctx is not None and standin.applies(spec, ctx.standin)
        return nullcontext() if on_cpu else super().heavy_slot(spec, ctx)

    def build(self, steps: StepRunner, spec, fetched, ctx):
        from ..gpu import decision

        if standin.applies(spec, ctx.standin):
            # STAND-IN: the reference path's quantize + build (CPU child processes) instead of ModelOpt's export
            # and trtllm-build; fill_repository puts the artifact where the engine goes.
            standin.admit_build(spec, fetched.path, decision.build_gpus(spec, ctx.gpu))
            quantized = steps.run("quantize", steps.tasks.quantize_weights, spec, fetched, ctx)
            return steps.run("build", steps.tasks.build_reference, spec, quantized, ctx)
        return steps.run("build", steps.tasks.build_gpu, spec, fetched, ctx)

    def package(self, steps: StepRunner, spec, fetched, built, ctx):
        return steps.run("package", steps.tasks.package_gpu, spec, fetched, built, ctx)

    def repository_of(self, packaged, uploaded) -> str:
        # The engine's backend reads gpt_model_path as an absolute path in the container: the repository is
        # mounted there from the package step's folder on the Docker host, not loaded from S3 (which Triton
        # copies to a temporary folder of its own).
        return str(packaged.path)

    def backend(self, spec, repository: str, gpus: tuple[int, ...], standin_ran: bool = False) -> dict:
        from ..gpu import trtllm

        labels = {GPUS_LABEL: ",".join(map(str, gpus))}
        # env {}: the repository is mounted, so the backend reads no S3 and is given no credentials (neither the
        # credentials file's mount nor its path); a backend that holds keys it never uses only widens a leak.
        fields = {"image": trtllm.serving_image(spec), "repository_uri": trtllm.C_MODELS, "env": {},
                  "mounts": {repository: trtllm.C_MODELS}, "device_ids": tuple(gpus),
                  "command": lambda ports, extra: trtllm.serve_command(spec, ports, extra, self.complete_configs)}
        if standin.applies(spec, standin_ran):
            from ..stack.standin_image import DEFAULT_STANDIN_IMAGE, STANDIN_LABEL

            # STAND-IN: the CPU image (its entrypoint is tritonserver itself: cleared, the command names it) and
            # no device requests; the labels still say which GPUs a GPU host would have given.
            fields.update(image=DEFAULT_STANDIN_IMAGE, entrypoint="", device_ids=(),
                          admit=standin.backend_admission(spec, Path(repository), tuple(gpus)))
            labels[STANDIN_LABEL] = "true"
        return fields | {"labels": labels}

    def openai_image(self, spec) -> str:
        # The serving image is NVIDIA's; the OpenAI service runs in stoker's CPU image (built on any host by
        # `stoker image`, no registry), in front of the GPU backend like any other.
        from ..stack.image import DEFAULT_IMAGE

        return DEFAULT_IMAGE

    def decide_gpus(self, steps: StepRunner, spec, fetched, ctx) -> dict:
        return steps.run("gpu-rollout", steps.tasks.decide_gpu_rollout, spec, fetched, ctx).detail

    def settle_gpus(self, steps: StepRunner, spec, ctx) -> dict:
        return steps.tasks.settle_gpu_rollout(spec, ctx) if ctx.gpu else ctx.gpu

    def gpu_sets(self, spec) -> tuple[tuple[int, ...], ...]:
        """A generation's GPUs (every replica's, in order); surge: two such sets. What `stoker plan` shows: a run
        decides once from its fetched files (decide_gpus) and uses that."""
        from ..gpu.decision import generation_sets

        return generation_sets(spec, self.gpu_rollout(spec))

    def gpu_rollout(self, spec):
        """The plan's rollout, from the facts `stoker plan` reads (stoker/gpu/planning.py)."""
        from ..gpu.planning import model_facts
        from ..gpu.rollout import plan_rollout

        return plan_rollout(spec, model_facts(spec))

    def record_baseline(self, steps: StepRunner, spec, ctx) -> None:
        """A quantized run whose weights have no recorded bf16 baseline records it first: the `none` build of the
        same weights on this target (cached by the weights' digest like any build), packaged, uploaded, staged as
        a candidate, scored through its endpoint against transformers, recorded in S3, then removed: it never
        serves. Its steps are in the manifest as bf16-<step>. evaluation.require_recorded_baseline refuses instead
        (at eval-data)."""
        if "eval-data" not in steps or steps["eval-data"].detail.get("baseline_record") != "missing":
            return
        from ..errors import StepError
        from ..gpu import decision

        placed = (ctx.gpu or {}).get("baseline") or {}
        if not placed.get("gpus"):
            raise StepError(f"evaluation: these weights have no recorded bf16 baseline and it cannot be made without "
                            f"touching what serves: {placed.get('why', 'no GPU decision')}; list spare device ids, or "
                            "record it from a run while nothing serves")
        fetched, eval_data = steps["fetch"], steps["eval-data"]
        ctx = ctx.model_copy(update={"gpu": decision.for_baseline(ctx.gpu)})  # its own GPUs, the live one untouched
        q = spec.quantization.model_copy(update={"format": "none", "kv_cache_dtype": "none"})
        bf16 = spec.model_copy(update={"quantization": q})
        sub = _Prefixed(steps, "bf16-")
        # Where the run's own build runs: routed to the GPU pool, or here inside the GPU slot.
        if spec.routing.heavy:
            routed = steps.tasks.route_heavy_steps(bf16, fetched, ctx)
            built = self.build(sub, bf16, fetched, ctx.model_copy(update={"routed_to": spec.routing.heavy}))
            for name in ("quantize", "build"):
                if name in sub:
                    steps.tasks.mark_routed(sub[name], routed)
        else:
            with self.heavy_slot(bf16, ctx):
                built = self.build(sub, bf16, fetched, ctx)
        packaged = self.package(sub, bf16, fetched, built, ctx)
        uploaded = sub.run("upload", steps.tasks.upload_repository, bf16, packaged, ctx)
        staged = sub.run("deploy", steps.tasks.stage_candidate, bf16, uploaded, ctx,
                         self.repository_of(packaged, uploaded))
        try:
            own = StepResult(name="baseline", detail={"self": True})
            sub.run("evaluate", steps.tasks.evaluate_candidate, bf16, staged, packaged, fetched, eval_data, own, ctx)
        finally:
            sub.run("remove", steps.tasks.remove_candidate, bf16, staged, ctx)

    def start_baseline(self, steps: StepRunner, spec, ctx):
        if not spec.evaluation.enabled:
            return None
        return lambda: steps.tasks.baseline_recorded(spec, steps["fetch"], steps["eval-data"], ctx)

    @abstractmethod
    def check_built(self, ws, spec) -> dict:
        """Check what the container steps left in the workspace (stoker.gpu.trtllm.Workspace) beyond the
        unified checkpoint; returns what the build step records. Raises CheckpointError."""

    @abstractmethod
    def fill_repository(self, slot: Path, fetched, built, standin_ran: bool = False) -> None:
        """Put the model files into the repository's `tensorrt_llm/1/` (`slot`); ``standin_ran``: the run's recorded
        stand-in decision (never read off the artifact)."""


class _Prefixed:
    """A step recorder whose steps are named with a prefix: a run inside the run (the bf16 baseline)."""

    def __init__(self, steps: StepRunner, prefix: str) -> None:
        self.steps, self.prefix, self.tasks = steps, prefix, steps.tasks
        self.metrics: list[dict] = []
        self.evaluation: dict | None = None

    # The outer run's steps the inner one uses as they are: the same weights, adapters and evaluation data.
    SHARED = ("fetch", "adapters", "eval-data")

    def __getitem__(self, name: str):
        return self.steps[name if name in self.SHARED else self.prefix + name]

    def __contains__(self, name: str) -> bool:
        return (name if name in self.SHARED else self.prefix + name) in self.steps

    def run(self, name: str, task, *args):
        return self.steps.run(self.prefix + name, task, *args)
