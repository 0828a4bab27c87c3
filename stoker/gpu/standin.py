"""The stand-in switch (``STOKER_STANDIN=1``): run a GPU target's pipeline on a machine with no GPU and no TensorRT-LLM.

STAND-IN, NOT TensorRT-LLM. It replaces exactly two things of a ``target: tensorrt`` or ``target: pytorch`` run:

- the build: the reference path's quantize + build (child processes, CPU) run instead of the container steps
  (ModelOpt export, trtllm-build), and their float32 artifact goes where the engine would go
  (``tensorrt_llm/1/engine/``) or where the LLM API's checkpoint would (``tensorrt_llm/1/checkpoint/``);
- the serving image: stoker/triton-standin (stoker/stack/standin_image.py), the CPU Triton image whose backend
  named ``tensorrtllm`` is stoker's reference model, and whose /app/all_models/llmapi holds a model with the
  contract of TensorRT-LLM's LLM-API model over the same runtime, so either repository rendered for a GPU host
  loads as is (the `llmapi` shim included).

Everything else is the GPU target's own code: the rendered repository, pre/postprocessing, ensemble, upload, the
deploy through stoker/serving, the gates, the switch. Device requests are rendered and recorded on the backend's
labels, and dropped only here (no GPU to give). It proves stoker around the engine, never the engine: plan, run
manifest, report and backend labels say so.

Refused by plan for a spec meant for production: one whose endpoint other machines reach (deploy.listen not
loopback), or a target without a stand-in, or a format the reference runtime cannot build.
"""

from __future__ import annotations

import ipaddress
import os

from .. import target_traits
from ..errors import PlanRefused

ENV = "STOKER_STANDIN"
# What the reference artifact holds and an engine folder never does (trtllm-build writes config.json and
# rank<i>.engine): left out where the stand-in's artifact goes in an engine's place.
NOT_IN_AN_ENGINE = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "chat_template.jinja", "chat_template.json")
NOTE = ("STAND-IN (STOKER_STANDIN=1): the build and the serving image are stoker's CPU reference runtime behind "
        "TensorRT-LLM's interfaces (the engine's tensors, the LLM API's model); this run proves stoker around "
        "TensorRT-LLM, never TensorRT-LLM")


def active() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes")


def decide(spec) -> bool:
    """Whether this run uses the stand-in: read from the environment once, at the run's start (or a plan's), and
    recorded in its RunContext, manifest and backend labels; everything that builds or serves reads that record,
    never the environment again (a worker or a rollback elsewhere must not change what the run is). Refuses a
    spec the stand-in must not touch (PlanRefused, one line)."""
    check(spec)
    return active() and covers(spec)


def covers(spec) -> bool:
    """The spec's target has a stand-in (its traits name the target standing in)."""
    return target_traits.of(spec.target).standin is not None


def applies(spec, recorded: bool) -> bool:
    """The stand-in replaces this run's build and serving image: recorded for the run, and a target it covers."""
    return bool(recorded) and covers(spec)


def check_recorded(spec, recorded: bool) -> None:
    """A recorded stand-in (a rollback, a routed worker) is refused for an endpoint other machines reach."""
    if applies(spec, recorded) and not ipaddress.ip_address(spec.deploy.listen).is_loopback:
        raise PlanRefused(f"the stand-in (recorded for this build) with deploy.listen {spec.deploy.listen}: an "
                          "endpoint other machines reach is meant for production; listen on 127.0.0.1")


def check(spec) -> None:
    """PlanRefused (one line) when the switch is on for a spec it must not touch."""
    traits = target_traits.of(spec.target)
    if not active() or traits.runs_on == "cpu":  # nothing to stand in for
        return
    if traits.standin is None:
        covered = ", ".join(t.name for t in target_traits.TRAITS.values() if t.standin)
        raise PlanRefused(f"{ENV}=1: target {spec.target!r} has no stand-in (only {covered}); unset {ENV}")
    if not ipaddress.ip_address(spec.deploy.listen).is_loopback:
        raise PlanRefused(f"{ENV}=1 with deploy.listen {spec.deploy.listen}: a stand-in serves no engine, and an "
                          "endpoint other machines reach is meant for production; unset it or listen on 127.0.0.1")
    from ..plan.model_checks import formats_for

    runs = ("none", *formats_for(traits.standin))
    if spec.quantization.format not in runs:
        raise PlanRefused(f"{ENV}=1: quantization.format {spec.quantization.format!r} is built only by TensorRT-LLM on "
                          f"a GPU; the stand-in builds {', '.join(runs)}")


def backend_admission(spec, repository, gpus: tuple[int, ...]):
    """The admission a stand-in backend passes before it starts (stoker/gpu/standin_ledger.py): its footprint on
    ``gpus`` from the model the repository serves (the config.json of the stand-in's artifact, where the engine or
    the LLM API's checkpoint goes) and the KV settings it carries, refused where they lack the room; None when the
    repository holds no model config (nothing to size it by; never a Hub read at start)."""
    from pathlib import Path

    from . import facts as facts_mod

    slot = Path(repository) / "tensorrt_llm" / "1"
    folder = next((slot / d for d in ("engine", "checkpoint") if (slot / d / "config.json").is_file()), None)
    if folder is None or not gpus:
        return None
    facts = facts_mod.from_folder(folder)

    def admit(client) -> dict[str, str]:
        from ..containers import engine
        from . import standin_ledger as ledger

        minimum, take = ledger.backend_take(spec, facts, repository)
        held = ledger.held_bytes(engine.containers(client, spec.deploy.name), gpus)
        taken = ledger.admit(f"the backend of {spec.deploy.name}", gpus, ledger.gpu_bytes(spec), held, minimum, take)
        return {ledger.LABEL_BYTES: str(taken)}

    return admit


def admit_build(spec, fetched_path, gpus: tuple[int, ...]) -> None:
    """A stand-in build (run on the CPU here) is admitted on the GPUs a GPU host would build on, as a backend is:
    its quantize/trtllm-build peak beside what running containers hold there; OutOfMemory otherwise."""
    from pathlib import Path

    from ..containers import engine
    from . import facts as facts_mod
    from . import placement, standin_ledger as ledger

    if not (Path(fetched_path) / "config.json").is_file() or not gpus:
        return
    need = placement.build_need_bytes(spec, facts_mod.from_folder(Path(fetched_path)))
    if need:
        held = ledger.held_bytes(engine.containers(engine.connect(spec.deploy.docker_host), spec.deploy.name),
                                 tuple(gpus))
        ledger.admit(f"the build ({', '.join(need)})", tuple(gpus), ledger.gpu_bytes(spec), held, max(need.values()))
