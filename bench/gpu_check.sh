#!/usr/bin/env bash
# The GPU checks, run on a machine with an NVIDIA GPU from the repository root (the development
# workplace's device tool runs it on a copy of the working tree). Prepare on the build machine:
#
#   bench/gpu_check.sh --prepare     # builds and strips into .gpu/ (git-ignored): the release
#                                    # binary, the device test of crates/cli/tests/device.rs,
#                                    # tumble-cuda's unit tests, and the suite's instances
#
# then on the GPU machine (with .gpu carried): bench/gpu_check.sh [OUTDIR]
#   1. tumble-cuda's unit tests (the fixed kernels at odd sizes against the host),
#   2. bench/gpu_suite.py: tumble on the GPU against PyTorch eager and by hand on the same GPU,
#   3. crates/cli/tests/device.rs: every zoo model at mini-batches 8 and 64, --device cuda
#      against --device cpu within 1e-4.
# bench/gpu_probe.sh (same preparation) is the short run: the unit tests, the latencies of the
# device's basic operations and products (cuda_bench), and a few models' device profiles.
set -u
if [ "${1:-}" = "--prepare" ]; then
  set -e
  cargo build --release -p tumble-cli
  mkdir -p .gpu/data
  grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
  strip -o .gpu/tumble target/release/tumble
  bin=$(cargo test --release -p tumble-cli --test device --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"]=="device"]')
  strip -o .gpu/device-test "$bin"
  bin=$(cargo test --release -p tumble-cuda --lib --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys; [print(m["executable"]) for m in map(json.loads, sys.stdin) if m.get("executable")]')
  strip -o .gpu/cuda-test "$bin"
  cargo build --release -p tumble-cuda --example cuda_bench
  strip -o .gpu/cuda-bench target/release/examples/cuda_bench
  for f in sst_tree_128 sst_tokens_128 nested_128 drnn256_128 drnn512_128; do
    cp bench/.data/$f.first32.jsonl bench/.data/$f.first128.jsonl .gpu/data/
  done
  cp bench/.data/one.*.jsonl .gpu/data/
  du -sh .gpu
  exit 0
fi
OUTDIR=${1:-/tmp/gpu_check}
mkdir -p "$OUTDIR"
. bench/gpu_env.sh
echo "== tumble-cuda unit tests"
timeout 120 .gpu/cuda-test --nocapture 2>&1 | tee "$OUTDIR/cuda-test.log" | tail -15
echo "== suite against PyTorch on the GPU"
PYTHONUNBUFFERED=1 timeout "${SUITE_TIMEOUT:-400}" python3 bench/gpu_suite.py --tumble target/release/tumble \
  --data .gpu/data --repeat "${SUITE_REPEAT:-4}" --json "$OUTDIR/gpu_suite.json" ${SUITE_ARGS:-} 2>&1 \
  | tee "$OUTDIR/gpu_suite.log"
echo "== zoo: --device cuda against --device cpu"
[ "${DEVICE_TEST_TIMEOUT:-300}" = 0 ] || timeout "${DEVICE_TEST_TIMEOUT:-300}" .gpu/device-test --nocapture 2>&1 | tee "$OUTDIR/device-test.log" | tail -40
