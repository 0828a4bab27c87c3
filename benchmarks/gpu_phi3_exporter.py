"""What ModelOpt 0.47's legacy TensorRT-LLM export answers for Phi-3 under each decoder name (GPU, no network).

Run after benchmarks/gpu_engine_architectures.sh on the same machine (it installs ModelOpt):
    python3 benchmarks/gpu_phi3_exporter.py build/tiny-phi3 >> $OUT/engine_architectures.log
stoker refuses Phi-3 on the engine target at plan time (stoker/gpu/decoders.py); this records why: ModelOpt's own
refusal under the Phi names, and under a name it does not refuse, what it writes — checked against the layout a
TensorRT-LLM Llama checkpoint has (separate mlp.gate and mlp.fc, intermediate_size the model's).
"""

from __future__ import annotations

import json
import sys
import tempfile

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_tensorrt_llm_checkpoint
from safetensors import safe_open
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).cuda().eval()
batch = torch.randint(4, 2000, (4, 64), device="cuda")
mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop=lambda m: m(batch))
for name in ("phi3", "phi", "llama", "gpt"):
    with tempfile.TemporaryDirectory() as out:
        try:
            export_tensorrt_llm_checkpoint(model, decoder_type=name, dtype=torch.bfloat16, export_dir=out,
                                           inference_tensor_parallel=1)
            cfg = json.load(open(f"{out}/config.json"))
            with safe_open(f"{out}/rank0.safetensors", "pt") as f:
                mlp = {k.rsplit(".", 2)[-2]: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                       if ".layers.0.mlp." in k and k.endswith(".weight")}
            inter = model.config.intermediate_size
            ok = cfg.get("intermediate_size") == inter and "gate" in mlp and mlp.get("fc", (0,))[0] == inter
            print(f"phi3-exporter: decoder_type={name}: written, {'well-formed' if ok else 'MALFORMED'}: "
                  f"architecture {cfg.get('architecture')}, intermediate_size {cfg.get('intermediate_size')} "
                  f"(model {inter}), layer 0 mlp {mlp}")
        except Exception as err:  # noqa: BLE001 - the message is what is recorded
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            print(f"phi3-exporter: decoder_type={name}: refused: {type(err).__name__}: {first}")
