#!/usr/bin/env bash
# The whole device check of issue 32 in one script (< 8 minutes on an H100/H200): tests/gpu, the decode step vs
# the memory floor (graphs / triton eager / torch eager, side by side), prefill steps, a torch.profiler table
# of b=128 decode steps. Writes under $OUT (or ./gpu_out) and prints the tables.
#   on the device:  bash bench/gpu_check.sh
#   on CPU first:   TINY=1 bash bench/gpu_check.sh   (tiny shapes, Triton's interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
if [ "${TINY:-0}" = 1 ]; then
  export TRITON_INTERPRET=1 PDSERVE_ATTENTION=triton
  $PY bench/gpu_decode_floor.py --device cpu --model random:tiny --context 64 --batches 1,4 --steps 2 --kv int8 --out "$OUT" \
    2>&1 | tee "$OUT/floor_tiny.log"
  $PY bench/gpu_profile_step.py --device cpu --model random:tiny --context 64 --batch 4 --steps 2 --out "$OUT" \
    2>&1 | tail -5
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 150 $PY -m pytest tests/gpu/test_cuda_graphs.py tests/gpu/test_cuda_attention.py -q -x 2>&1 | tail -15 | tee "$OUT/tests_gpu.txt"
timeout 200 $PY bench/gpu_decode_floor.py --model random:llama-3-8b --context 2048 --batches 1,16,64,128 \
  --steps 25 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/floor_8b.log" | tail -16
timeout 90 $PY bench/gpu_decode_floor.py --model random:smollm2-135m --context 1024 --batches 1,64 \
  --steps 40 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/floor_smollm2.log" | tail -8
timeout 60 $PY bench/gpu_profile_step.py --model random:llama-3-8b --context 2048 --batch 128 --steps 5 --out "$OUT" \
  2>&1 | tail -40
