"""Tool versions that go into cache keys and the manifest.

Read from package metadata, never by importing: the orchestrator must not
import torch just to learn its version.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import metadata
from pathlib import Path

_PACKAGES = (
    "stoker", "prefect", "torch", "transformers", "nvidia-modelopt", "safetensors", "tokenizers",
    "huggingface_hub", "boto3", "docker", "tritonclient", "nvidia-pytriton", "lm-eval",
)

# Triton in the CPU image: the binary shipped by nvidia-pytriton 0.7.0.
TRITON_SERVER_VERSION = "2.51.0"


@lru_cache(maxsize=None)
def tool_versions() -> dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    out["tritonserver"] = TRITON_SERVER_VERSION
    return out


def pick(*names: str) -> dict[str, str]:
    versions = tool_versions()
    return {n: versions[n] for n in names}


@lru_cache(maxsize=None)
def code_digest(*relpaths: str) -> str:
    """Digest of stoker source files whose behaviour a cached artifact depends on."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for rel in sorted(relpaths):
        for p in sorted((root / rel).rglob("*.py")) if (root / rel).is_dir() else [root / rel]:
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]
