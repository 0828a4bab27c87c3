# Verify stoker.gpu.quantize_worker on a GPU machine without network (run from the repo root; writes to $OUT).
# Carry: build/gpu-wheels (nvidia-modelopt 0.47.0 + pulp 3.3.2, omegaconf, antlr4-python3-runtime, pydantic(-core),
# annotated-types, typing-inspection, typing-extensions, fetched with `pip download --python-version 3.12`) and
# build/tiny (python -m stoker.workers.tinymodel --out build/tiny). Result of one run: gpu_quantize_worker_h200.txt.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv | tee $OUT/gpu.txt
python3 -m pip install --quiet --no-index --no-deps --no-build-isolation build/gpu-wheels/* 2>&1 | tail -3
python3 -c "import torch, transformers, modelopt; print('torch', torch.__version__, 'transformers', transformers.__version__, 'modelopt', modelopt.__version__, 'cuda', torch.cuda.is_available())" | tee -a $OUT/gpu.txt
for spec in "fp8 fp8 1" "int4_awq none 1" "nvfp4 fp8 1" "int8_sq none 1" "fp8 none 2"; do
  set -- $spec
  d=/tmp/q-$1-$2-$3
  echo "== $1 kv $2 tp $3" | tee -a $OUT/gpu.txt
  ( time python3 -W ignore -m stoker.gpu.quantize_worker --model build/tiny --format $1 --kv-cache-dtype $2 --dtype bfloat16 \
    --calib-file stoker/data/calibration.txt --calib-size 16 --calib-seq-len 128 --calib-batch-size 4 --device cuda \
    --hf-out $d/hf --trtllm-out $d/trt --tp $3 ) > $d.log 2>&1
  echo "rc=$?" | tee -a $OUT/gpu.txt
  grep -E "^\{|quantize_worker:|real" $d.log | cut -c1-400 | tee -a $OUT/gpu.txt
  tail -3 $d.log | cut -c1-300 >> $OUT/gpu.txt
done
