# Engine-path architectures on a real GPU (issue 24): stoker's quantize worker exports each tiny model to a
# TensorRT-LLM checkpoint under the decoder type stoker/gpu/decoders.py maps it to, in fp8 and int4_awq — or
# refuses it. No TensorRT-LLM is involved (none is obtainable here): this is ModelOpt's legacy export on CUDA.
# Run from the repo root on a GPU machine without network (writes to $OUT):
#   carry build/gpu-wheels (nvidia-modelopt 0.47.0, pulp 3.3.2, omegaconf, antlr4-python3-runtime 4.9.3 sdist,
#   pydantic + pydantic-core cp312, annotated-types, typing-inspection, typing-extensions, requests, setuptools,
#   PyYAML; `pip download --python-version 3.12 --only-binary=:all: --no-deps`) and build/tiny-<arch>
#   (`python -m stoker.workers.tinymodel --out build/tiny-<arch> --seed 0 --architecture <arch>`).
# benchmarks/engine_architectures.py turns $OUT/engine_architectures.log into the committed JSON.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader | sed 's/^/gpu: /' | tee $OUT/engine_architectures.log
python3 -m pip install --quiet --no-index --no-deps --no-build-isolation build/gpu-wheels/* 2>&1 | tail -3
python3 -c "import torch, transformers, modelopt; print('versions: torch', torch.__version__, 'transformers', transformers.__version__, 'modelopt', modelopt.__version__, 'cuda', torch.cuda.is_available())" | tee -a $OUT/engine_architectures.log
for arch in ${ARCHS:-llama qwen2 mistral gemma phi3}; do
  for fmt in fp8 int4_awq; do
    d=/tmp/eng-$arch-$fmt
    python3 -W ignore -m stoker.gpu.quantize_worker --model build/tiny-$arch --format $fmt --kv-cache-dtype none \
      --dtype bfloat16 --calib-file stoker/data/calibration.txt --calib-size 16 --calib-seq-len 128 \
      --calib-batch-size 4 --device cuda --trtllm-out $d/trt --tp 1 > $d.log 2>&1
    rc=$?
    echo "== arch=$arch format=$fmt rc=$rc" | tee -a $OUT/engine_architectures.log
    # The worker's JSON summary on success; its one-line error (or the exporter's last line) on failure.
    grep -E '^\{' $d.log | tail -1 | cut -c1-600 | sed 's/^/result: /' | tee -a $OUT/engine_architectures.log
    [ $rc -ne 0 ] && grep -v '^\s*$' $d.log | tail -1 | cut -c1-600 | sed 's/^/error: /' | tee -a $OUT/engine_architectures.log
    ls $d/trt 2>/dev/null | tr '\n' ' ' | sed 's/^/files: /' | tee -a $OUT/engine_architectures.log; echo | tee -a $OUT/engine_architectures.log
  done
done
