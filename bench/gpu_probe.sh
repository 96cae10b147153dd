#!/usr/bin/env bash
# The short GPU run (after `bench/gpu_check.sh --prepare`, on the GPU machine, from the
# repository root): tumble-cuda's unit tests, cuda_bench's latencies of copies, waits and products
# for each GEMM kernel, optionally the device test for some models, and the device profile of a
# few models with the default workers and with one.
#   bench/gpu_probe.sh [OUTDIR]
#   MODELS='treelstm_small:64 ...'   the points profiled
#   DEVICE_MODELS=mvrnn,treelstm     also run crates/cli/tests/device.rs for these models
set -u
OUTDIR=${1:-/tmp/gpu_probe}
mkdir -p "$OUTDIR"
. bench/gpu_env.sh
echo "== tumble-cuda unit tests"
timeout 120 .gpu/cuda-test --nocapture 2>&1 | tail -8
echo "== cuda_bench"
timeout 120 .gpu/cuda-bench --reps ${REPS:-30} 2>&1 | tee "$OUTDIR/cuda-bench.log"
if [ -n "${DEVICE_MODELS:-}" ]; then
  echo "== device test: $DEVICE_MODELS"
  TUMBLE_DEVICE_TEST_MODELS=$DEVICE_MODELS timeout ${DEVICE_TEST_TIMEOUT:-200} .gpu/device-test --nocapture 2>&1 \
    | tee "$OUTDIR/device-test.log" | tail -30
fi
declare -A INPUT=([treelstm]=sst_tree_128 [mvrnn]=sst_tree_128 [birnn]=sst_tokens_128
  [stackrnn]=sst_tokens_128 [nestedrnn]=nested_128 [drnn]=drnn256_128)
for point in ${MODELS:-treelstm_small:64 mvrnn_large:64 stackrnn_small:8}; do
  model=${point%:*}; b=${point#*:}; kind=${model%%_*}
  n=$([ "$b" -le 8 ] && echo 32 || echo 128)
  for workers in 4 1; do
    echo "== $model b$b --workers $workers"
    timeout 120 target/release/tumble run models/$model.rly \
      --inputs .gpu/data/${INPUT[$kind]}.first$n.jsonl --random-params 0 --batch $b \
      --device cuda --workers $workers --profile --repeat 4 -o "$OUTDIR/$model.b$b.w$workers.jsonl" 2>&1 \
      | grep -E "^(device|time|repeats|[a-z_:.]+ +[0-9]+ +[0-9]+)" | head -14
  done
  cmp -s "$OUTDIR/$model.b$b.w4.jsonl" "$OUTDIR/$model.b$b.w1.jsonl" \
    && echo "outputs: identical" || echo "outputs: DIFFER between worker counts"
done
