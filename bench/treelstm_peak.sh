#!/usr/bin/env bash
# TreeLSTM throughput against the machine's sgemm peak, both measured by this script, interleaved,
# so that a machine whose speed drifts (shared vCPUs) is compared with itself. Kernels issue:
# "TreeLSTM (hidden 256 and 512) on the first 512 SST test trees, batch 64, 2 threads: wall time
# and achieved GFLOP/s against the machine's sgemm peak (measured with the same harness)".
#
# Per round: the sgemm peak (gemm_bench: best of several 2048×1024×1024 products) on 1 and on 2
# threads, then every (model, threads, variant) run once. Variants: `default` (on 2 threads: two
# mini-batches at once, one kernel thread each), `no-epilogue` (--no-epilogue) and, on 2 threads,
# `workers 1` (--workers 1: one mini-batch at a time with both threads on its kernels); their order
# rotates from round to round. Reported: the best and the median of ROUNDS for each run, the best
# of each peak. GFLOP/s counts the dense stages' useful work (2·rows·K·N) over the whole run's wall
# time (`time (ms): total` of --profile: mini-batches, host side included; the
# weight loading before it excluded).
# Usage: bench/treelstm_peak.sh [TREES] [ROUNDS]   (from the repository root; defaults 512, 3)
set -euo pipefail
n=${1:-512}
rounds=${2:-3}
cargo build --release -q -p tumble-cli
cargo build --release -q -p tumble-kernels --example gemm_bench
# TUMBLE_BIN=path runs another build of tumble (e.g. an older commit's) against the same peak.
t=${TUMBLE_BIN:-target/release/tumble}
bench=target/release/examples/gemm_bench
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
$t data sst --split test --format tree --limit "$n" -o "$dir/trees.jsonl" 2>/dev/null
for m in treelstm_small treelstm_large; do
  $t run "models/$m.rly" --inputs "$dir/trees.jsonl" --random-params 0 --batch 64 \
    --save-params "$dir/$m.safetensors" -o "$dir/o.jsonl" >/dev/null 2>&1
done
declare -A best all
median() { tr ' ' '\n' <<<"$1" | grep . | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
variants() { if [[ $1 == 1 ]]; then echo default no-epilogue; else echo default no-epilogue workers1; fi; }
# The variants of round r, rotated by r: whichever runs first after the other thread count's runs
# (or after the peak measurement) starts on a cold machine state, so no variant always takes
# that place.
rotated() { local -a v=($(variants "$1")); local n=${#v[@]} i; for ((i = 0; i < n; i++)); do echo -n "${v[(i + $2) % n]} "; done; }
flags() { case $1 in no-epilogue) echo --no-epilogue ;; workers1) echo --workers 1 ;; esac; }
keep_min() { # key value
  local cur=${best[$1]:-}
  if [[ -z $cur ]] || awk "BEGIN{exit !($2 < $cur)}"; then best[$1]=$2; fi
}
keep_max() {
  local cur=${best[$1]:-}
  if [[ -z $cur ]] || awk "BEGIN{exit !($2 > $cur)}"; then best[$1]=$2; fi
}
for r in $(seq "$rounds"); do
  for th in 1 2; do
    p=$($bench --threads "$th" --shapes "8,8,8" --min-time 0.05 | sed -n 's/^peak sgemm .*: \([0-9.]*\) GFLOP\/s.*/\1/p')
    keep_max "peak$th" "$p"
  done
  for m in treelstm_small treelstm_large; do
    for th in 1 2; do
      for v in $(rotated "$th" "$r"); do
        prof=$($t run "models/$m.rly" --inputs "$dir/trees.jsonl" --params "$dir/$m.safetensors" \
          --batch 64 --threads "$th" $(flags "$v") --profile -o "$dir/o.jsonl" 2>&1)
        total=$(sed -n 's/^time (ms): total \([0-9.]*\) .*/\1/p' <<<"$prof")
        gflop=$(sed -n 's/^dense stages[^:]*: \([0-9.]*\) GFLOP .*/\1/p' <<<"$prof")
        keep_min "$m/$th/$v" "$total"
        all["$m/$th/$v"]+=" $total"
        best["gflop/$m"]=$gflop
      done
    done
  done
  echo "round $r done" >&2
done
kernel=$($bench --threads 1 --shapes 1,1,1 --no-peak --min-time 0.001 | sed -n 's/.*kernel \([^,]*\),.*/\1/p')
echo "# TreeLSTM, first $n SST test trees, batch 64, best of $rounds rounds; $(nproc) vCPUs, kernel $kernel"
echo "# sgemm peak: ${best[peak1]} GFLOP/s on 1 thread, ${best[peak2]} GFLOP/s on 2 threads"
printf '| %-15s | %7s | %11s | %9s | %13s | %9s | %9s | %15s |\n' model threads variant "best ms" "GFLOP/s (best)" "% of peak" "median ms" "% of peak (med)"
echo '|---|---:|---|---:|---:|---:|---:|---:|'
for m in treelstm_small treelstm_large; do
  for th in 1 2; do
    for v in $(variants "$th"); do
      ms=${best[$m/$th/$v]}
      med=$(median "${all[$m/$th/$v]}")
      g=${best[gflop/$m]}
      awk -v m="$m" -v th="$th" -v v="$v" -v ms="$ms" -v med="$med" -v g="$g" -v peak="${best[peak$th]}" \
        'BEGIN { rate = g / (ms / 1000); mrate = g / (med / 1000)
                 printf "| %-15s | %7s | %11s | %9.1f | %14.1f | %8.1f%% | %9.1f | %14.1f%% |\n", m, th, v, ms, rate, 100 * rate / peak, med, 100 * mrate / peak }'
    done
  done
done
