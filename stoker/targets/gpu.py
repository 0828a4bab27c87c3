"""What the GPU targets share: one cached build step in the pinned serving image, one serving container.

Quantize, checkpoint and engine run as container steps of a single "build" (one cache key, so a hit
skips all GPU work); `stoker plan` runs the version matrix and GPU rules (stoker/gpu/rules.py) before
any GPU time. A subclass says what its build leaves behind and what goes into its repository.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path

from .base import StepRunner, Target


class GpuTarget(Target):
    runs_on = "gpu"
    # By contract (no TensorRT-LLM here): the baseline is the bf16 (`none`) build of the same weights,
    # scored through its own endpoint by the same code as any candidate and checked against transformers;
    # that run records it in S3 for the quantized builds (tasks/evaluate.py).
    evaluates = True
    baseline_source = "recorded"
    baseline_tolerance = 0.1  # a bf16 engine against float32 transformers

    def plan(self, spec, ctx) -> list:
        from ..gpu.planning import plan_gpu

        return plan_gpu(spec, ctx)

    def build(self, steps: StepRunner, spec, fetched, ctx):
        return steps.run("build", steps.tasks.build_gpu, spec, fetched, ctx)

    def package(self, steps: StepRunner, spec, fetched, built, ctx):
        return steps.run("package", steps.tasks.package_gpu, spec, fetched, built, ctx)

    def deploy(self, steps: StepRunner, spec, ctx, built, packaged, uploaded):
        """One container on the spec's GPUs (device requests, shm, ulimits, MPI launch for TP×PP > 1),
        serving the local repository; evaluated on its ports; no staged candidate."""
        deployed = steps.run("deploy", steps.tasks.deploy_gpu, spec, packaged, ctx)
        return self.evaluate(steps, spec, deployed, built, ctx, self.start_baseline(steps, spec, ctx))

    def start_baseline(self, steps: StepRunner, spec, ctx):
        if not spec.evaluation.enabled:
            return None
        return lambda: steps.tasks.baseline_recorded(spec, steps["fetch"], steps["eval-data"], ctx)

    @abstractmethod
    def check_built(self, ws, spec) -> dict:
        """Check what the container steps left in the workspace (stoker.gpu.trtllm.Workspace) beyond the
        unified checkpoint; returns what the build step records. Raises CheckpointError."""

    @abstractmethod
    def fill_repository(self, slot: Path, fetched, built) -> None:
        """Put the model files into the repository's `tensorrt_llm/1/` (`slot`)."""
