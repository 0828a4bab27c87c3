"""Assemble a Triton model repository in TensorRT-LLM's ensemble layout.

  preprocessing/  config.pbtxt, 1/model.py, 1/stoker_stop_words.py, 1/tokenizer/
  tensorrt_llm/   config.pbtxt, 1/model.py, 1/stoker_stop_words.py, 1/stoker_runtime/ (our model code),
                  1/weights/ (the build)
  postprocessing/ config.pbtxt, 1/model.py, 1/tokenizer/
  ensemble/       config.pbtxt, 1/ (empty, as Triton requires)

Everything the server needs travels inside the repository, so the image only
has to provide Python, torch, transformers, numpy, safetensors and tokenizers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import config as triton_config
from .config import RepoSettings
from .models import install_step

_PKG = Path(__file__).resolve().parents[1]  # stoker/
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "stoker_runtime.json")
# Runtime modules the model step imports inside Triton (dequantization happened at build time).
RUNTIME_MODULES = ("__init__.py", "model.py", "generate.py", "kvquant.py", "batch.py", "lora.py", "lora_config.py", "lora_trtllm.py",
                   "guided.py")
EMPTY_DIRS = ("ensemble/1",)


def assemble(artifact: Path, out: Path, settings: RepoSettings) -> list[str]:
    """Write the repository for a reference build into `out`; returns the empty folders."""
    for name, text in triton_config.render_all(settings).items():
        (out / name / "1").mkdir(parents=True, exist_ok=True)
        (out / name / "config.pbtxt").write_text(text)
    for step in ("preprocessing", "postprocessing"):
        install_step(step, out / step / "1")
        tok = out / step / "1" / settings.tokenizer_dir
        tok.mkdir()
        for f in TOKENIZER_FILES:
            if (artifact / f).exists():
                shutil.copyfile(artifact / f, tok / f)
    model_dir = out / triton_config.MODEL_NAME / "1"
    install_step(triton_config.MODEL_NAME, model_dir)
    runtime = model_dir / "stoker_runtime"
    runtime.mkdir()
    for f in RUNTIME_MODULES:
        if (_PKG / "runtime" / f).exists():
            shutil.copyfile(_PKG / "runtime" / f, runtime / f)
    shutil.copytree(artifact, model_dir / settings.weights_dir)
    return list(EMPTY_DIRS)


def settings_for(triton) -> RepoSettings:
    """RepoSettings from the spec's `triton` section."""
    return RepoSettings(max_batch_size=triton.max_batch_size,
                        preprocessing_instances=triton.instances.preprocessing,
                        model_instances=triton.instances.model,
                        postprocessing_instances=triton.instances.postprocessing,
                        model_threads=triton.model_threads)
