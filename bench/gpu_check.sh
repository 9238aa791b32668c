#!/usr/bin/env bash
# The device check of issue 32 in one call (< 8 minutes on an H100/H200), most important first: the decode
# step vs the memory floor (graphs / Triton eager / torch eager side by side, every row sampled on the device
# (temperature 0.8, top-p 0.95) and, for SmolLM2, on the host, int8 pages, a verify step),
# where the host's time goes (cProfile) and the int8 step's kernels (torch.profiler), what sampling alone costs
# (device sampler eager / graphs vs argmax vs the CPU sampler), tests/gpu, Quest at
# 32k x 8 vs full attention, the Qwen3-30B-A3B shape's decode vs its touched experts (issue 35); with FULL=1 also the disaggregated handoff over gRPC on one GPU, the engine's GPU
# profile checked against its measured steps, and a torch.profiler table of bf16 b=128 steps. Each part is time-boxed; everything
# lands in $OUT/gpu_check.log and $OUT/results.tar.gz (the device tool returns at most 8 files).
#   on the device:  bash bench/gpu_check.sh
#   on CPU first:   TINY=1 bash bench/gpu_check.sh   (tiny shapes, Triton's interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
W=$(mktemp -d)
LOG="$OUT/gpu_check.log"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
# each part time-boxed; results re-packed after each, so a call cut short still brings back what ran
T0=$(date +%s)
run() {
  local t=$1; shift; local s=$(date +%s); echo "### [$((s - T0)) s] $*" | tee -a "$LOG"
  timeout "$t" "$@" 2>&1 | grep -v -i warn | tee -a "$LOG" | tail -25
  echo "### took $(($(date +%s) - s)) s" | tee -a "$LOG"
  rm -f "$W"/power_*.csv; tar -czf "$OUT/results.tar.gz" -C "$W" .
}
if [ "${TINY:-0}" = 1 ]; then
  export TRITON_INTERPRET=1 PDSERVE_ATTENTION=triton
  run 600 $PY bench/gpu/decode_floor.py --device cpu --model random:tiny --context 64 --batches 1,16 --steps 2 \
    --modes graphs,triton,torch,sampled,sampled_cpu --kv int8 --verify 4 --out "$W"
  run 300 $PY bench/gpu/decode_floor.py --device cpu --model random:tiny --context 96 --batches 2 --steps 2 \
    --modes graphs,triton --sparse 32 --out "$W/quest"
  run 300 $PY bench/gpu/decode_floor.py --device cpu --model random:tiny-moe --context 64 --batches 1,4 --steps 2 \
    --modes graphs,triton --out "$W/moe"
  run 120 $PY bench/gpu/int8_cells.py --device cpu --batch 2 --context 40 --heads 4,2,16 --reps 1
  run 60 $PY bench/gpu/sampler_cost.py --device cpu --vocab 4096 --batches 1,4 --reps 2 --out "$W"
  run 300 $PY bench/gpu/profile_step.py --device cpu --model random:tiny --context 64 --batch 4 --steps 2 \
    --modes graphs --kv int8 --host --out "$W"
  run 300 $PY bench/gpu/disagg_check.py --model tiny --dtype float32 --prompt-len 24 --tokens 8 --graphs static \
    --out "$W"
  run 300 env PDSERVE_ATTENTION=torch $PY -m cluster.cli profile --device cpu --model random:smollm2-135m --grid gpu-tiny --out "$W/profile.json"
  run 60 $PY bench/gpu/profile_check.py --profile "$W/profile.json" --steps "$W"/floor_random_tiny.json
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$LOG"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
HW=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -qi h200 && echo h200 || echo h100)
# int8 pages take the Triton kernel only when asked (engine/kv_cache/quantized.py): asked here, to measure it
export PDSERVE_ATTENTION=triton
run 190 $PY bench/gpu/decode_floor.py --model random:llama-3-8b --context 2048 --batches 1,16,64,128 --steps 20 \
  --modes graphs,triton,torch,sampled --kv int8 --verify 4 --out "$W"
run 90 $PY bench/gpu/decode_floor.py --model random:smollm2-135m --context 1024 --batches 1,64 --steps 30 \
  --modes graphs,triton,torch,sampled,sampled_cpu --out "$W"
run 45 $PY bench/gpu/profile_step.py --model random:smollm2-135m --context 1024 --batch 64 --steps 20 \
  --modes graphs --host --out "$W"
run 30 $PY bench/gpu/int8_cells.py --batch 128 --context 2048
run 45 $PY bench/gpu/sampler_cost.py --vocab 128256 --batches 1,16,64,128 --out "$W"
run 60 $PY bench/gpu/profile_step.py --model random:llama-3-8b --context 2048 --batch 128 --steps 3 \
  --modes graphs,triton --kv int8 --out "$W"
run 100 env -u PDSERVE_ATTENTION $PY -m pytest tests/gpu/test_cuda_graphs.py tests/gpu/test_cuda_attention.py \
  tests/gpu/test_cuda_sampling.py -q
run 90 env -u PDSERVE_ATTENTION $PY -m pytest tests/gpu/test_cuda_moe.py tests/gpu/test_cuda_gemma.py -q  # (the Triton MoE kernels compile here)
run 120 $PY bench/gpu/decode_floor.py --model random:llama-3-8b --context 32768 --batches 8 --steps 10 \
  --modes graphs,triton --sparse 2048 --out "$W/quest"
# issue 35: the Qwen3-30B-A3B shape (random weights, 61 GB; context 512 so that 128 rows of KV fit beside them on
# an H100) decode step vs the bytes of its touched experts
run 150 $PY bench/gpu/decode_floor.py --model random:qwen3-30b-a3b --context 512 --batches 1,16,64,128 --steps 10 \
  --modes graphs,triton --out "$W/moe"
# the same with the Triton grouped MoE kernel (engine/moe.py: CUDA's default once measured here)
run 120 env PDSERVE_MOE=triton $PY bench/gpu/decode_floor.py --model random:qwen3-30b-a3b --context 512 \
  --batches 1,16,64,128 --steps 10 --modes graphs,triton --out "$W/moe_triton"
if [ "${FULL:-0}" = 1 ]; then
  run 60 $PY -m pytest tests/gpu/test_cuda_kv_transfer.py -q  # (needs the gRPC wheels carried)
  run 120 $PY bench/gpu/disagg_check.py --device cuda --model random:smollm2-135m,random:llama-3-8b --prompt-len 512 \
    --out "$W"
  for m in llama-3-8b smollm2-135m; do
    run 110 $PY -m cluster.cli profile --device cuda --model random:$m --hardware $HW --repeats 3 --out "$W/profile_$m.json"
    run 40 $PY bench/gpu/step_power.py --model random:$m --prefill 512,2048,8064 --decode "" --seconds 1.5 --out "$W"
    run 30 $PY bench/gpu/profile_check.py --profile "$W/profile_$m.json" --steps "$W/floor_random_$m.json" \
      "$W/steps_random_$m.json"
  done
  run 90 $PY bench/gpu/profile_step.py --model random:llama-3-8b --context 2048 --batch 128 --steps 5 --out "$W"
fi
