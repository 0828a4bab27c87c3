"""What a target is: the one interface that the flow, `stoker plan` and spec validation ask.

Each target answers, in its own module, what the code used to decide by `if spec.target == …`:
which formats and architectures it takes, where its heavy steps run, which tasks build and package
it, how it deploys, and how a deployed build is evaluated before it is promoted. The rules behind
"which formats and architectures" stay in stoker/plan/model_checks.py and stoker/gpu/rules.py; targets
call them, so there is one place per rule.

A target never imports a Prefect task: tasks/ sits above stoker, so the flow hands them over as `steps.tasks`
(flows/target_tasks.py), and spec validation and `stoker plan`, which reach this module too, never pay for
importing Prefect and the task modules.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Callable, ClassVar, Literal, Protocol

from ..plan import model_checks
from ..protocol import ENSEMBLE, Interface
from ..errors import EvaluationFailed, one_line

if TYPE_CHECKING:
    from ..target_traits import Traits
    from ..gpu.facts import ModelFacts
    from ..gpu.sections import Gpus
    from ..plan.rows import PlannedStep
    from ..run import RunContext, StepResult
    from ..spec.schema import Quantization, Spec

RunsOn = Literal["cpu", "gpu"]


class Submittable(Protocol):
    """A Prefect task: called in this thread, or submitted to run alongside (a future with .result)."""

    def __call__(self, *args) -> StepResult: ...

    def submit(self, *args): ...


class Tasks(Protocol):
    """The Prefect tasks (tasks/) the targets run, as the flow supplies them (flows/target_tasks.py)."""

    quantize_weights: Callable[..., StepResult]
    build_reference: Callable[..., StepResult]
    package_repository: Callable[..., StepResult]
    stage_candidate: Callable[..., StepResult]
    switch_traffic: Callable[..., StepResult]
    abandon_candidate: Callable[..., None]
    scrape_metrics: Callable[..., list[dict]]
    benchmark_endpoint: Callable[..., StepResult]
    gate_benchmark: Callable[..., StepResult]
    evaluate_candidate: Callable[..., StepResult]
    baseline_reference: Submittable
    baseline_recorded: Callable[..., StepResult]
    build_gpu: Callable[..., StepResult]
    package_gpu: Callable[..., StepResult]
    upload_repository: Callable[..., StepResult]
    remove_candidate: Callable[..., StepResult]
    decide_gpu_rollout: Callable[..., StepResult]
    settle_gpu_rollout: Callable[..., dict]
    route_heavy_steps: Callable[..., dict]
    mark_routed: Callable[..., None]


class StepRunner(Protocol):
    """The flow's step recorder (flows/build_and_deploy.Steps): results and failures by step name."""

    tasks: Tasks
    metrics: list[dict]  # Triton's counters of the served build, for the report even when a later step fails
    evaluation: dict | None  # the accuracy evaluation, kept when its gate fails

    def __getitem__(self, name: str) -> StepResult: ...

    def run(self, name: str, task: Callable[..., StepResult], *args) -> StepResult: ...


class Target(ABC):
    # What code outside the targets reads of a target, it reads from its traits (stoker/target_traits.py), never
    # from its name; each of stoker's targets takes its name, place and layout from there too.
    traits: ClassVar[Traits]
    name: ClassVar[str]
    runs_on: ClassVar[RunsOn]  # where the heavy steps run: a GPU slot today, a work pool to route to later
    layout: ClassVar[str]  # the Triton repository layout its package step writes
    # How clients talk to what it serves (stoker.protocol): the smoke, the watch's counts, the benchmark, the
    # evaluation and the OpenAI service address this interface, never a layout by name.
    interface: ClassVar[Interface] = ENSEMBLE
    evaluates: ClassVar[bool] = False  # runs the accuracy evaluation (spec `evaluation`) before promoting
    evaluation_note: ClassVar[str] = "no accuracy evaluation for this target"
    baseline_tolerance: ClassVar[float] = 1e-3  # nats; spec evaluation.baseline_tolerance overrides
    # runtime: the `none` build scored in a child process; recorded: the bf16 build's own measurement, in S3
    baseline_source: ClassVar[Literal["runtime", "recorded"]] = "runtime"
    # stoker's OpenAI service behind the proxy's /v1/, for every target: a container of stoker's CPU image (its
    # Python carries the service) speaking the target's interface to the live backend. Triton's own frontend is not
    # used: its KServe endpoints cannot restrict Triton's admin APIs (stoker/gpu/openai_frontend.py).
    openai_service: ClassVar[bool] = True
    # Serves the spec's LoRA adapters per request (stoker/adapters.py); a target that does not refuses them at plan.
    serves_adapters: ClassVar[bool] = False

    def adapters_refusal(self, spec: Spec, base_config: dict) -> str | None:
        """Why this target cannot serve the spec's adapters on this base (one line), or None: it can."""
        if self.serves_adapters:
            return None
        return (f"target {self.name} does not serve LoRA adapters in this version (target: reference and target: "
                "tensorrt do); remove adapters or change the target")

    def openai_image(self, spec: Spec) -> str:
        """The image the OpenAI service runs in: the serving image where it is stoker's CPU image."""
        return spec.deploy.image

    def scores_perplexity(self, spec: Spec) -> bool:
        """Whether the served build returns context logits (the perplexity windows need them)."""
        return True

    def tolerance(self, spec: Spec) -> float:
        return spec.evaluation.baseline_tolerance or self.baseline_tolerance

    # Spec validation and plan: pure or light reads, no Prefect.

    def formats(self, gpu_sm: int | None = None) -> list[str]:
        """Quantized formats it serves (on a GPU of that SM, when known), in stoker's order."""
        return model_checks.formats_for(self.name, gpu_sm)

    def check_quantization(self, q: Quantization) -> None:
        """Raise ValueError (one line) for a quantization section it can never take; run by the spec."""

    def check_gpus(self, gpus: Gpus | None) -> None:
        """Raise ValueError (one line) when the spec's `gpus` section does not fit where it runs."""
        if gpus is None and self.runs_on == "gpu":
            raise ValueError(f"required for target {self.name!r} (e.g. gpus: {{type: h100-80gb, count: 1}})")

    def check_model(self, spec: Spec, facts: ModelFacts | None) -> None:
        """Raise PlanRefused (one line) for a model whose shapes or architecture it cannot build or serve
        exactly, from config.json alone: before download or calibration."""
        model_checks.enforce(spec, facts)

    @abstractmethod
    def plan(self, spec: Spec, ctx: RunContext) -> list[PlannedStep]:
        """Each step's cache key and whether it would hit, without heavy work."""

    # The flow's steps: each runs its Prefect tasks through `steps`, which records them by name.

    def heavy_slot(self, spec: Spec | None = None, ctx: RunContext | None = None) -> AbstractContextManager:
        """Held around the build: one GPU step per GPU at a time (stoker/orchestration/gpu_slot.py); CPU needs none."""
        if self.runs_on == "gpu":
            from ..orchestration.gpu_slot import gpu_slot

            return gpu_slot()
        return nullcontext()

    @abstractmethod
    def build(self, steps: StepRunner, spec: Spec, fetched: StepResult, ctx: RunContext) -> StepResult:
        """Quantize and build from the fetched weights; returns the build step's result."""

    @abstractmethod
    def package(self, steps: StepRunner, spec: Spec, fetched: StepResult, built: StepResult,
                ctx: RunContext) -> StepResult:
        """Write the Triton model repository (`layout`) that the upload step sends to S3."""

    # Serving: what differs per target; stoker/serving does the rest for every target (reconcile, stage, gates,
    # switch, watch, retire or switch back, rollback, status, down).

    @abstractmethod
    def backend(self, spec: Spec, repository: str, gpus: tuple[int, ...], standin_ran: bool = False) -> dict:
        """What one backend of this target runs: BackendSpec fields (image, command, entrypoint, mounts,
        device_ids, extra_args, env, ready_timeout_s, labels) for the repository at ``repository`` (what
        `repository_of` returned), on the GPUs ``gpus`` (stoker/serving picks them per slot; () on CPU)."""

    @abstractmethod
    def repository_of(self, packaged: StepResult, uploaded: StepResult) -> str:
        """Where a backend loads the build's repository from (an S3 URI, or a folder on the Docker host)."""

    def gpu_sets(self, spec: Spec) -> tuple[tuple[int, ...], ...]:
        """The device-id sets backends take turns on (surge: two; shared/reload: one); () on CPU."""
        return ()

    def decide_gpus(self, steps: StepRunner, spec: Spec, fetched: StepResult, ctx: RunContext) -> dict | None:
        """The run's GPU decision (stoker/gpu/decision.py), made once after the fetch; None on CPU."""
        return None

    def settle_gpus(self, steps: StepRunner, spec: Spec, ctx: RunContext) -> dict | None:
        """Under the deploy lock: the run's GPU decision as staging will use it (None on CPU)."""
        return ctx.gpu

    def gpu_rollout(self, spec: Spec):
        """The plan's GPU rollout (stoker.gpu.rollout.Rollout: surge, shared or reload); None on CPU or unknown."""
        return None

    def deploy(self, steps: StepRunner, spec: Spec, ctx: RunContext, built: StepResult, packaged: StepResult,
               uploaded: StepResult) -> StepResult:
        """stage → evaluate on the candidate → switch, for every target; returns the benchmark that the promote
        step records. A failure before the switch abandons the candidate: the old backend never stopped serving
        (a GPU `reload` rollout, which stops it first, starts it again)."""
        baseline = self.start_baseline(steps, spec, ctx)
        staged = steps.run("deploy", steps.tasks.stage_candidate, spec, uploaded, ctx,
                           self.repository_of(packaged, uploaded))  # proven, no traffic yet
        try:
            benchmarked = self.evaluate(steps, spec, staged, built, ctx, baseline)
        except BaseException as exc:  # a cancelled run too: an unjudged candidate never stays up
            steps.tasks.abandon_candidate(spec, staged, ctx, one_line(exc) or f"run {type(exc).__name__}")
            raise
        steps.run("switch", steps.tasks.switch_traffic, spec, staged, ctx)  # switch, watch, retire (or switch back)
        return benchmarked

    def record_baseline(self, steps: StepRunner, spec: Spec, ctx: RunContext) -> None:
        """Before the candidate: record what its evaluation needs and cannot find (GPU targets: the bf16 baseline of
        these weights). Nothing for a target that makes its baseline itself."""

    def start_baseline(self, steps: StepRunner, spec: Spec, ctx: RunContext) -> Callable[[], StepResult] | None:
        """Start the accuracy baseline in the background; returns what joins it (None: no evaluation).

        Started before the candidate's deploy and joined before its benchmark, so it overlaps the
        container start and never the measurement."""
        return None

    def evaluate(self, steps: StepRunner, spec: Spec, served: StepResult, built: StepResult,
                 ctx: RunContext, baseline: Callable[[], StepResult] | None = None) -> StepResult:
        """What a served build must pass before it is promoted: the benchmark, the accuracy evaluation
        against the unquantized build of the same revision (when `baseline` was started), then the
        benchmark's regression gate.

        Every target runs it on the staged candidate, on its own ports, before traffic switches to it.
        """
        joined = steps.run("baseline", baseline) if baseline is not None else None
        benchmarked = steps.run("benchmark", steps.tasks.benchmark_endpoint, spec, served, built, ctx)
        steps.metrics = steps.tasks.scrape_metrics(served)  # before the gates: a failed run's report shows them too
        if joined is not None:
            self.evaluate_accuracy(steps, spec, served, built, joined, ctx)
        # A failed gate fails the run with a table of what regressed; the build is not promoted.
        steps.run("gate", steps.tasks.gate_benchmark, spec, benchmarked, ctx)
        return benchmarked

    def evaluate_accuracy(self, steps: StepRunner, spec: Spec, served: StepResult, built: StepResult,
                          baseline: StepResult, ctx: RunContext) -> StepResult:
        """The candidate through its endpoint, judged against the baseline; kept for the manifest even
        when it fails."""
        try:
            evaluated = steps.run("evaluate", steps.tasks.evaluate_candidate, spec, served, steps["package"], steps["fetch"],
                                  steps["eval-data"], baseline, ctx)
        except EvaluationFailed as exc:
            steps.evaluation = exc.detail
            raise
        steps.evaluation = evaluated.detail
        return evaluated
