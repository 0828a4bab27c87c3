"""The GPU quantize worker's own code path, run for real on CPU (ModelOpt 0.47 here; the image has ~0.37).

On a GPU host the same module runs inside the serving image with --device cuda; here it proves
the calibration, both exports and the structural checks with the tiny Llama.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from stoker.gpu.checkpoint_check import CheckpointError, check_trtllm_checkpoint, check_unified_checkpoint
from stoker.cache.keys import DEFAULT_CALIBRATION

pytestmark = pytest.mark.slow  # ~20-60 s: ModelOpt import + calibration on 2 shared cores


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from stoker.workers.tinymodel import make_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(out)
    return out


def test_fp8_with_fp8_kv_exports_both_checkpoints(tiny, tmp_path):
    hf, trt = tmp_path / "unified", tmp_path / "trtllm"
    argv = [sys.executable, "-W", "ignore", "-m", "stoker.gpu.quantize_worker", "--model", str(tiny),
            "--format", "fp8", "--kv-cache-dtype", "fp8", "--dtype", "bfloat16", "--calib-file",
            str(DEFAULT_CALIBRATION), "--calib-size", "8", "--calib-seq-len", "64", "--calib-batch-size", "4",
            "--device", "cpu", "--hf-out", str(hf), "--trtllm-out", str(trt), "--tp", "1", "--pp", "1"]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["trtllm_checkpoint"]["quant_algo"] == "FP8"
    assert summary["trtllm_checkpoint"]["kv_cache_quant_algo"] == "FP8"
    assert "F8_E4M3" in summary["unified_checkpoint"]["dtypes"]
    assert (hf / "tokenizer.json").is_file() and (trt / "rank0.safetensors").is_file()
    # The checks refuse what the next step could not use.
    with pytest.raises(CheckpointError, match="quant_algo 'FP8', expected"):
        check_trtllm_checkpoint(trt, "int4_awq", "fp8", 1)
    with pytest.raises(CheckpointError, match="mapping.world_size 1, expected 2"):
        check_trtllm_checkpoint(trt, "fp8", "fp8", 2)
    with pytest.raises(CheckpointError, match="kv_cache_quant_algo 'FP8', expected 'none'"):
        check_unified_checkpoint(hf, "fp8", "none")
