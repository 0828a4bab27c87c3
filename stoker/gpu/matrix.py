"""The version matrix (matrix.json): serving image → TRT-LLM/TensorRT/CUDA/Python/ModelOpt, GPUs, formats.

Pure lookups over data kept in the repo, so `stoker plan` can refuse a bad
image/GPU/format combination on a laptop, before any GPU time is spent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .. import target_traits

MATRIX_FILE = Path(__file__).resolve().parent / "matrix.json"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@lru_cache(maxsize=1)
def data() -> dict:
    return json.loads(MATRIX_FILE.read_text())


@dataclass(frozen=True)
class ImageInfo:
    """What a serving image carries, as the matrix records it."""

    ref: str  # repository:tag as the spec names it (no digest)
    tag: str | None  # the NGC release tag (e.g. "26.07") or None for a non-NGC image
    trtllm: str | None
    tensorrt: str | None
    cuda: str | None
    python: str | None
    modelopt: str | None
    trtllm_build: bool
    targets: tuple[str, ...]
    supported: bool


@dataclass(frozen=True)
class GpuInfo:
    key: str
    name: str
    sm: int
    memory_mib: int

    @property
    def arch(self) -> str:
        """Engines are tied to this: 'sm90' built on an H100 does not load on an L4 ('sm89')."""
        return f"sm{self.sm}"


def image_ref(tag: str) -> str:
    d = data()
    return f"{d['repository']}:{tag}{d['suffix']}"


def current_image() -> str:
    """The image stoker pins for GPU targets today."""
    return image_ref(data()["current"])


def split_ref(image: str) -> tuple[str, str | None]:
    """'repo:tag@sha256:…' → ('repo:tag', 'sha256:…')."""
    if "@" in image:
        ref, digest = image.split("@", 1)
        return ref, digest
    return image, None


def is_digest(value: str) -> bool:
    return bool(_DIGEST.match(value))


def image_info(image: str) -> ImageInfo | None:
    """The matrix entry for an image reference (tag form; a digest suffix is ignored), or None."""
    ref, _ = split_ref(image)
    d = data()
    if ref in d["other_images"]:
        e = d["other_images"][ref]
        return ImageInfo(ref, None, e["trtllm"], e["tensorrt"], e["cuda"], e["python"], e["modelopt"],
                         e["trtllm_build"], tuple(e["targets"]), e["supported"])
    prefix, suffix = f"{d['repository']}:", d["suffix"]
    if not (ref.startswith(prefix) and ref.endswith(suffix)):
        return None
    tag = ref[len(prefix):-len(suffix)]
    e = d["images"].get(tag)
    if e is None:
        return None
    # The LLM API's runtime is in every TRT-LLM of the table; trtllm-build and the C++ backend only up to the 1.2 line.
    build = has_engine_backend(e["trtllm"])
    served = tuple(t.name for t in target_traits.TRAITS.values()
                   if t.runs_on == "gpu" and (build or not t.builds_engine))
    return ImageInfo(ref, tag, e["trtllm"], e["tensorrt"], e["cuda"], e["python"], e["modelopt"], build, served,
                     bool(e.get("supported", False)))


def has_engine_backend(trtllm: str | None) -> bool:
    """Whether a TRT-LLM release still ships trtllm-build and the C++ backend (the 1.2 line was the last)."""
    if trtllm is None:
        return False
    last = tuple(int(x) for x in data()["engine_backend_last_line"].split("."))
    parts = re.match(r"(\d+)\.(\d+)", trtllm)
    return parts is not None and (int(parts.group(1)), int(parts.group(2))) <= last


def gpu_info(key: str) -> GpuInfo | None:
    e = data()["gpus"].get(key)
    return GpuInfo(key, e["name"], e["sm"], e["memory_mib"]) if e else None


def gpu_keys() -> list[str]:
    return sorted(data()["gpus"])


def format_info(fmt: str) -> dict:
    return data()["formats"][fmt]


def kv_info(kv: str) -> dict:
    return data()["kv_cache"][kv]
