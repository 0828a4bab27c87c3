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
    # Not built yet, and it could not run here (no TensorRT-LLM): the baseline would be the bf16 build of
    # the same revision, served and scored by the same endpoint code (stoker/evaluation/endpoint.py).
    evaluation_note = "not available on GPU targets yet: the bf16 baseline is not built; evaluation skipped"

    def plan(self, spec, ctx) -> list:
        from ..gpu.planning import plan_gpu

        return plan_gpu(spec, ctx)

    def build(self, steps: StepRunner, spec, fetched, ctx):
        from tasks.trtllm import build_gpu

        return steps.run("build", build_gpu, spec, fetched, ctx)

    def package(self, steps: StepRunner, spec, fetched, built, ctx):
        from tasks.trtllm import package_gpu

        return steps.run("package", package_gpu, spec, fetched, built, ctx)

    def deploy(self, steps: StepRunner, spec, ctx, built, packaged, uploaded):
        """One container on the spec's GPUs (device requests, shm, ulimits, MPI launch for TP×PP > 1),
        serving the local repository; evaluated on its ports; no staged candidate."""
        from tasks.trtllm import deploy_gpu

        deployed = steps.run("deploy", deploy_gpu, spec, packaged, ctx)
        return self.evaluate(steps, spec, deployed, built, ctx)

    @abstractmethod
    def check_built(self, ws, spec) -> dict:
        """Check what the container steps left in the workspace (stoker.gpu.trtllm.Workspace) beyond the
        unified checkpoint; returns what the build step records. Raises CheckpointError."""

    @abstractmethod
    def fill_repository(self, slot: Path, fetched, built) -> None:
        """Put the model files into the repository's `tensorrt_llm/1/` (`slot`)."""
