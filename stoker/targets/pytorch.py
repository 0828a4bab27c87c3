"""`pytorch`: TensorRT-LLM's LLM API (PyTorch backend) in one python model (`llmapi` layout).

It loads a Hugging Face checkpoint: no engine, and a build step only when there is something to quantize.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import target_traits
from ..protocol import LLMAPI
from .gpu import GpuTarget


class PyTorch(GpuTarget):
    traits = target_traits.PYTORCH
    name, runs_on, layout = traits.name, traits.runs_on, traits.layout
    interface = LLMAPI  # one python model, `tensorrt_llm`, with the LLM API's inputs

    def check_model(self, spec, facts) -> None:
        if not spec.runtime.decoupled:
            from ..errors import PlanRefused

            # The llmapi model answers a non-decoupled request only when streaming is false, and every stoker
            # client of this layout (smoke, watch, benchmark, OpenAI service) streams (protocol.LLMAPI).
            raise PlanRefused("runtime.decoupled: false with target pytorch: stoker's clients of TensorRT-LLM's llmapi "
                              "model stream, which needs a decoupled model; remove runtime.decoupled or set it true")
        super().check_model(spec, facts)

    def scores_perplexity(self, spec) -> bool:
        return False  # the LLM API's model returns no context logits: greedy agreement only (evaluation/endpoint.py)

    def adapters_refusal(self, spec, base_config: dict) -> str | None:
        # Read from the pinned model (upstream/llmapi_layout.json): its inputs are text_input, streaming, stop,
        # sampling_param_* and return_*; a request cannot name an adapter, so LoraConfig alone would serve none.
        return ("target pytorch serves through TensorRT-LLM 1.2.1's llmapi Triton model, whose config.pbtxt "
                "declares no adapter input (no lora_request or lora_task_id): no request could select an adapter; "
                "use target: tensorrt (engine LoRA) or target: reference")

    def check_built(self, ws, spec) -> dict:
        return {}  # the unified checkpoint, its only output, is checked for every GPU target

    def fill_repository(self, slot: Path, fetched, built, standin_ran: bool = False) -> None:
        # The quantized checkpoint when the build made one; format none serves the fetched weights as they are.
        # STAND-IN builds (stoker/gpu/standin.py) are the reference artifact itself: the stand-in's llmapi model
        # loads it from where the LLM API would load the checkpoint (which carries the tokenizer, as ModelOpt's
        # unified export does once stoker's worker copies it in).
        if standin_ran:
            source = built.path
        else:
            source = built.path / "unified" if (built.path / "unified").is_dir() else fetched.path
        shutil.copytree(source, slot / "checkpoint")


TARGET = PyTorch()
