"""Model code for the Triton repository of the CPU reference path.

The three modules here are Triton python-backend `model.py` files (they import
`triton_python_backend_utils`, so they load only inside Triton). This package only knows where
they go: `install_model_code` copies them, and the reference runtime the `tensorrt_llm` model
imports as `stoker_runtime`, into a repository whose config.pbtxt files are rendered elsewhere.
`stop_words.py` is plain Python shared by stoker and two of the models: it travels beside their
model.py as `stoker_stop_words.py`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

_HERE = Path(__file__).resolve().parent
RUNTIME_SOURCE_DIR = _HERE.parents[1] / "runtime"
# The runtime's package name inside Triton: the version directory is on sys.path there.
RUNTIME_PACKAGE = "stoker_runtime"
# Triton model name -> source file in this package.
MODEL_SOURCES: dict[str, str] = {
    "preprocessing": "preprocessing.py",
    "tensorrt_llm": "tensorrt_llm.py",
    "postprocessing": "postprocessing.py",
    # STAND-IN for TensorRT-LLM's llmapi model (target pytorch): installed in the stand-in image only.
    "llmapi": "llmapi.py",
}


ENSEMBLE_MODELS = ("preprocessing", "tensorrt_llm", "postprocessing")  # the reference repository's python models

# Beside model.py of the models that import it; a name no PyPI package takes.
STOP_WORDS_FILE = "stoker_stop_words.py"
_USES_STOP_WORDS = ("preprocessing", "tensorrt_llm")


def install_step(model_name: str, version_dir: Path) -> list[Path]:
    """Copy one model's model.py (and the stop-word helper it imports) into `version_dir`."""
    version_dir = Path(version_dir)
    version_dir.mkdir(parents=True, exist_ok=True)
    written = [version_dir / "model.py"]
    shutil.copyfile(model_source(model_name), written[0])
    if model_name in _USES_STOP_WORDS:
        written.append(version_dir / STOP_WORDS_FILE)
        shutil.copyfile(_HERE / "stop_words.py", written[-1])
    return written


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
    for name in ENSEMBLE_MODELS:
        written += install_step(name, Path(repo_dir) / name / version)
    package = Path(repo_dir) / "tensorrt_llm" / version / RUNTIME_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    for source in runtime_sources():
        shutil.copyfile(source, package / source.name)
        written.append(package / source.name)
    return written
