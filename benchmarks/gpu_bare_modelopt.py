"""ModelOpt alone, for the stoker/bare ratio: load, mtq.quantize, export_tensorrt_llm_checkpoint, nothing else.

The same work as `python3 -m stoker.gpu.quantize_worker --format F --kv-cache-dtype none --trtllm-out DIR` on one
GPU: the same from_pretrained, ModelOpt's own named config, the same calibration windows (the text tokenized
without special tokens, repeated, cut into calib-size windows of calib-seq-len tokens, batches of calib-batch-size),
the same export arguments. No stoker import, no checks, no logging beyond one JSON line:

    python3 benchmarks/gpu_bare_modelopt.py --model DIR --format fp8|int4_awq|nvfp4 --calib-file TXT \
        --calib-size 16 --calib-seq-len 128 --calib-batch-size 4 --out DIR

Run by benchmarks/gpu_quantize.py on the GPU machine (ModelOpt's wheels installed there).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

CONFIGS = {"fp8": "FP8_DEFAULT_CFG", "int4_awq": "INT4_AWQ_CFG", "nvfp4": "NVFP4_DEFAULT_CFG"}

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--format", required=True, choices=sorted(CONFIGS))
p.add_argument("--calib-file", required=True)
p.add_argument("--calib-size", type=int, default=16)
p.add_argument("--calib-seq-len", type=int, default=128)
p.add_argument("--calib-batch-size", type=int, default=4)
p.add_argument("--out", required=True)
p.add_argument("--device", default="cuda")  # cpu: to check this script without a GPU
a = p.parse_args()

import modelopt.torch.quantization as mtq  # noqa: E402
import torch  # noqa: E402
from modelopt.torch.export import export_tensorrt_llm_checkpoint  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

t0 = time.monotonic()
tokenizer = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).to(a.device).eval()
load_s = time.monotonic() - t0
ids = tokenizer(open(a.calib_file).read(), add_special_tokens=False)["input_ids"]
need = a.calib_size * a.calib_seq_len
stream = (ids * (need // len(ids) + 1))[:need]
windows = [stream[k * a.calib_seq_len:(k + 1) * a.calib_seq_len] for k in range(a.calib_size)]
batches = [windows[k:k + a.calib_batch_size] for k in range(0, a.calib_size, a.calib_batch_size)]


def forward_loop(m):
    with torch.no_grad():
        for batch in batches:
            m(torch.tensor(batch, device=a.device))


t1 = time.monotonic()
model = mtq.quantize(model, copy.deepcopy(getattr(mtq, CONFIGS[a.format])), forward_loop=forward_loop)
calibration_s = time.monotonic() - t1
t2 = time.monotonic()
export_tensorrt_llm_checkpoint(model, decoder_type="llama", dtype=torch.bfloat16, export_dir=a.out,
                               inference_tensor_parallel=1, inference_pipeline_parallel=1)
export_s = time.monotonic() - t2
peak = {"cuda:0": torch.cuda.max_memory_reserved(0) >> 20} if a.device == "cuda" else None
print(json.dumps({"load_s": round(load_s, 2), "calibration_s": round(calibration_s, 2), "export_s": round(export_s, 2),
                  "peak_reserved_mib": peak}), flush=True)
