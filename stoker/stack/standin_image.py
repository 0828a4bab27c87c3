"""The stand-in serving image (infra/standin/Dockerfile): STAND-IN, NOT TensorRT-LLM.

The CPU Triton image plus a Python-based backend named ``tensorrtllm`` (Triton runs a ``model.py`` found at
``backends/<name>/`` for every model whose config says ``backend: "<name>"``): stoker's reference ``tensorrt_llm``
model and runtime. Built without a registry, FROM the CPU image this machine built; its recipe label covers the
Dockerfile, the model code and the base image's id, so a change to the runtime rebuilds it. Only runs with
``STOKER_STANDIN=1`` use it (stoker/standin.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..docker_engine import connect
from ..triton_models import RUNTIME_PACKAGE, install_step, runtime_sources
from .image import DEFAULT_IMAGE, RECIPE_LABEL, BASE_LABEL, ImageBuildFailed, _current, _docker_build, ensure_image
from .worker_image import context_digest

STANDIN_DIR = Path(__file__).resolve().parents[2] / "infra" / "standin"
DEFAULT_STANDIN_IMAGE = "stoker/triton-standin:2.51.0-cpu"
STANDIN_LABEL = "ai.stoker.standin"


def assemble_context(out: Path) -> None:
    shutil.copy(STANDIN_DIR / "Dockerfile", out / "Dockerfile")
    backend = out / "tensorrtllm"
    install_step("tensorrt_llm", backend)  # model.py + the stop-word helper it imports
    runtime = backend / RUNTIME_PACKAGE
    runtime.mkdir()
    for src in runtime_sources():
        shutil.copyfile(src, runtime / src.name)


def ensure_standin_image(image: str = DEFAULT_STANDIN_IMAGE, docker_host: str | None = None,
                         log: Callable[[str], None] = print, base: str = DEFAULT_IMAGE) -> str:
    """Return the id of the stand-in image, building it (and its base) when its recipe changed (seconds: one layer)."""
    base_id = ensure_image(base, docker_host, log)
    client = connect(docker_host)
    with tempfile.TemporaryDirectory(prefix="stoker-standin-image-") as tmp:
        ctx = Path(tmp)
        assemble_context(ctx)
        want = context_digest(ctx, base_id)
        current, old_id = _current(client, image, want, f"from {base}, one COPY layer, seconds", log)
        if current:
            return current
        log(f"[standin] docker build (base {base}): STAND-IN for the TensorRT-LLM backend, not TensorRT-LLM")
        _docker_build(client, image, {"BASE_IMAGE": base_id}, {RECIPE_LABEL: want, BASE_LABEL: base_id}, log, path=ctx)
    new = client.images.get(image)
    if (new.labels or {}).get(RECIPE_LABEL) != want or (new.labels or {}).get(STANDIN_LABEL) != "true":
        raise ImageBuildFailed(f"built {image} but its labels are not the stand-in recipe {want[:12]}")
    if old_id and old_id != new.id:
        try:  # best effort: a running container may still use it
            client.images.remove(old_id)
        except Exception:  # noqa: BLE001
            pass
    log(f"[standin] done: {image} {new.id[:19]}")
    return new.id
