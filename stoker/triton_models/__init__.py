"""Model code for the Triton repository of the CPU reference path.

The three modules here are Triton python-backend `model.py` files (they import
`triton_python_backend_utils`, so they load only inside Triton). This package only knows where
they go: `install_model_code` copies them, and the reference runtime the `tensorrt_llm` model
imports as `stoker_runtime`, into a repository whose config.pbtxt files are rendered elsewhere.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_HERE = Path(__file__).resolve().parent
RUNTIME_SOURCE_DIR = _HERE.parent / "runtime"
# The runtime's package name inside Triton: the version directory is on sys.path there.
RUNTIME_PACKAGE = "stoker_runtime"
# Triton model name -> source file in this package.
MODEL_SOURCES: dict[str, str] = {
    "preprocessing": "preprocessing.py",
    "tensorrt_llm": "tensorrt_llm.py",
    "postprocessing": "postprocessing.py",
}


def model_source(model_name: str) -> Path:
    """The file to install as `<repo>/<model_name>/<version>/model.py`."""
    try:
        return _HERE / MODEL_SOURCES[model_name]
    except KeyError:
        raise ValueError(f"no model code for {model_name!r}; known: {', '.join(MODEL_SOURCES)}") from None


def runtime_sources() -> list[Path]:
    """The reference runtime's modules (relative imports only, so they work under any package name)."""
    return sorted(RUNTIME_SOURCE_DIR.glob("*.py"))


def install_model_code(repo_dir: Path, version: str = "1") -> list[Path]:
    """Copy the three model.py files and the `stoker_runtime` package into `repo_dir`; return what was written.

    Weights, tokenizers and config.pbtxt files are not touched.
    """
    written: list[Path] = []
    for name in MODEL_SOURCES:
        target = Path(repo_dir) / name / version / "model.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_source(name), target)
        written.append(target)
    package = Path(repo_dir) / "tensorrt_llm" / version / RUNTIME_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    for source in runtime_sources():
        shutil.copyfile(source, package / source.name)
        written.append(package / source.name)
    return written
