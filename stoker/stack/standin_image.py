"""The stand-in serving image (infra/standin/Dockerfile): STAND-IN, NOT TensorRT-LLM.

The CPU Triton image plus a Python-based backend named ``tensorrtllm`` (Triton runs a ``model.py`` found at
``backends/<name>/`` for every model whose config says ``backend: "<name>"``): stoker's reference ``tensorrt_llm``
model and runtime; and, where stoker's ``llmapi`` shim looks for TensorRT-LLM's own LLM-API model
(/app/all_models/llmapi/tensorrt_llm/1), a model with that contract over the same runtime
(stoker/triton/models/llmapi.py). Each of the two is installed as ``stoker_reference_model.py`` behind
infra/standin/rank_model.py (the ``model.py``: under mpirun only rank 0 serves, the others wait in TensorRT-LLM's
worker loop), and infra/standin/mpirun.py is the image's ``mpirun`` (the one-host MPMD launch stoker's serve command
uses for tensor × pipeline > 1). Built without a registry, FROM the CPU image this machine built; its recipe label
covers the Dockerfile, the model code and the base image's id, so a change to the runtime rebuilds it. Only runs
with ``STOKER_STANDIN=1`` use it (stoker/gpu/standin.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from ..triton.models import RUNTIME_PACKAGE, install_step, model_source, runtime_sources
from .image import DEFAULT_IMAGE
from .worker_image import ensure_derived_image

STANDIN_DIR = Path(__file__).resolve().parents[2] / "infra" / "standin"
DEFAULT_STANDIN_IMAGE = "stoker/triton-standin:2.51.0-cpu"
STANDIN_LABEL = "ai.stoker.gpu.standin"
REFERENCE_MODEL = "stoker_reference_model.py"  # the name rank_model.py reads


def assemble_context(out: Path) -> None:
    shutil.copy(STANDIN_DIR / "Dockerfile", out / "Dockerfile")
    shutil.copy(STANDIN_DIR / "mpirun.py", out / "mpirun")  # copy keeps the executable bit; COPY keeps it too
    backend = out / "tensorrtllm"
    install_step("tensorrt_llm", backend)  # model.py + the stop-word helper it imports
    # The LLM-API model where stoker's llmapi shim looks for TensorRT-LLM's (LLMAPI_MODEL_DIR in the image).
    llmapi = out / "llmapi" / "tensorrt_llm" / "1"
    llmapi.mkdir(parents=True)
    shutil.copyfile(model_source("llmapi"), llmapi / "model.py")
    for folder in (backend, llmapi):
        # The reference model behind the rank rule (rank_model.py says how it runs it).
        (folder / "model.py").rename(folder / REFERENCE_MODEL)
        shutil.copyfile(STANDIN_DIR / "rank_model.py", folder / "model.py")
        runtime = folder / RUNTIME_PACKAGE
        runtime.mkdir()
        for src in runtime_sources():
            shutil.copyfile(src, runtime / src.name)


def ensure_standin_image(image: str = DEFAULT_STANDIN_IMAGE, docker_host: str | None = None,
                         log: Callable[[str], None] = print, base: str = DEFAULT_IMAGE) -> str:
    """Return the id of the stand-in image, building it (and its base) when its recipe changed (seconds: one layer).
    STAND-IN for the TensorRT-LLM backend, not TensorRT-LLM."""
    return ensure_derived_image(image, base, docker_host, log, assemble_context, "standin",
                                f"from {base}, one COPY layer, seconds", labels={STANDIN_LABEL: "true"})
