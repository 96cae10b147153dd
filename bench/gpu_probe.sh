#!/usr/bin/env bash
# The short GPU run (after `bench/gpu_check.sh --prepare`, on the GPU machine, from the
# repository root): tumble-cuda's unit tests, cuda_bench's latencies of copies, waits and products
# for each GEMM kernel, and the device profile of a few models with each kernel.
#   bench/gpu_probe.sh [OUTDIR]     MODELS='treelstm_small:64 ...' to choose the points
set -u
OUTDIR=${1:-/tmp/gpu_probe}
mkdir -p "$OUTDIR"
nvidia-smi -L
NVRTC=$(find /usr/local /usr/lib /opt -name 'libnvrtc.so.13*' 2>/dev/null | grep -v builtins | head -1)
export LD_LIBRARY_PATH=$(dirname "$NVRTC"):${LD_LIBRARY_PATH:-}
echo "== tumble-cuda unit tests"
timeout 120 .gpu/cuda-test --nocapture 2>&1 | tail -8
echo "== cuda_bench"
timeout 120 .gpu/cuda-bench --reps ${REPS:-30} 2>&1 | tee "$OUTDIR/cuda-bench.log"
declare -A INPUT=([treelstm]=sst_tree_128 [mvrnn]=sst_tree_128 [birnn]=sst_tokens_128
  [stackrnn]=sst_tokens_128 [nestedrnn]=nested_128 [drnn]=drnn256_128)
for point in ${MODELS:-treelstm_small:64 treelstm_large:8 birnn_small:64 stackrnn_small:8 mvrnn_large:64}; do
  model=${point%:*}; b=${point#*:}; kind=${model%%_*}
  n=$([ "$b" -le 8 ] && echo 32 || echo 128)
  for gemm in split plain; do
    echo "== $model b$b TUMBLE_GPU_GEMM=$gemm"
    TUMBLE_GPU_GEMM=$gemm timeout 120 .gpu/tumble run models/$model.rly \
      --inputs .gpu/data/${INPUT[$kind]}.first$n.jsonl --random-params 0 --batch $b \
      --device cuda --profile --repeat 4 -o "$OUTDIR/$model.b$b.$gemm.jsonl" 2>&1 \
      | grep -E "^(device|time|repeats|block|[a-z_:.]+ +[0-9]+ +[0-9]+)" | head -14
  done
  cmp -s "$OUTDIR/$model.b$b.split.jsonl" "$OUTDIR/$model.b$b.plain.jsonl" \
    && echo "outputs: identical" || echo "outputs: differ (float rounding of split depths)"
done
