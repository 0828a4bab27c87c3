"""`pytorch`: TensorRT-LLM's LLM API (PyTorch backend) in one python model (`llmapi` layout).

It loads a Hugging Face checkpoint: no engine, and a build step only when there is something to quantize.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..protocol import LLMAPI
from .gpu import GpuTarget


class PyTorch(GpuTarget):
    name = "pytorch"
    layout = "llmapi"
    interface = LLMAPI  # one python model, `tensorrt_llm`, with the LLM API's inputs

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

    def fill_repository(self, slot: Path, fetched, built) -> None:
        # The quantized checkpoint when the build made one; format none serves the fetched weights as they are.
        # STAND-IN builds (stoker/gpu/standin.py) are the reference artifact itself: the stand-in's llmapi model
        # loads it from where the LLM API would load the checkpoint.
        if (built.path / "stoker_runtime.json").is_file():
            source = built.path
        else:
            source = built.path / "unified" if (built.path / "unified").is_dir() else fetched.path
        shutil.copytree(source, slot / "checkpoint")


TARGET = PyTorch()
