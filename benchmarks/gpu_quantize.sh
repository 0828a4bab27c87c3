# The quantize worker on two H100s (device tool, kind nvidia-h100-x2) or one (ONE_GPU=1, kind nvidia-h100-x1): run from the repo root; writes to $OUT.
# Carry .whl (nvidia-modelopt 0.47.0, pulp 3.3.2, omegaconf, pydantic, pydantic-core, annotated-types,
# typing-inspection, typing-extensions, setuptools; `pip download --python-version 3.12 ...`, see
# /work/.library/device/README.md) and build/tok (tokenizer.json, tokenizer_config.json, special_tokens_map.json of
# `python -m stoker.workers.tinymodel --out build/tiny`). Then, here: python3 benchmarks/gpu_quantize.py report RAW.
# STEPS picks steps of benchmarks/gpu_quantize.py plan() (e.g. STEPS=4,5 to finish a run cut short).
# ONE_GPU=1: a machine of one GPU (kind nvidia-h100-x1): stoker's worker and the bare script one after the other on
# GPU 0, fp8, int4_awq, nvfp4 (SWAP=1: each pair's other process first); then, here: python3 benchmarks/gpu_quantize.py report --section h100_one_gpu RAW.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
python3 benchmarks/gpu_quantize.py device --out "$OUT" --tokenizer build/tok --budget-s "${BUDGET_S:-530}" \
  ${STEPS:+--steps "$STEPS"} ${ONE_GPU:+--one-gpu} ${SWAP:+--swap}
