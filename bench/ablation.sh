#!/usr/bin/env bash
# Ablation of tumble's optimizations (ACROBAT Figure 6 style): every small model at batch 8 and 64.
# Table 1: all optimizations, then each one switched off in turn. Table 2: cumulative, in ACROBAT's
# order, from an operator-level DyNet-like baseline (dataflow-depth scheduling, nothing else):
# + kernel fusion (plans, horizontal fusion, parameter reuse by duplication) → + grain coarsening,
# inline depth and hoisting → + phases and ghosts → + gather and epilogue fusion (= everything on).
# Cells: ms per mini-batch and launches (L). Berxit is left out (see bench/RESULTS.md).
# Usage: bench/ablation.sh [N_INSTANCES] [REPEATS]   (from the repository root; 1 kernel thread;
# each cell is the best of REPEATS runs, default 3)
set -euo pipefail
n=${1:-64}
reps=${2:-3}
cargo build --release -q -p tumble-cli
t=target/release/tumble
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
$t data sst --split test --format tree --limit "$n" -o "$dir/tree.jsonl" 2>/dev/null
$t data sst --split test --format tokens --limit "$n" -o "$dir/tokens.jsonl" 2>/dev/null
$t data nested --count "$n" -o "$dir/nested.jsonl" 2>/dev/null
$t data drnn --count "$n" -o "$dir/drnn.jsonl" 2>/dev/null
off_each=("all:" "no-fusion:--no-fusion" "no-hfuse:--no-hfuse" "no-gather-fusion:--no-gather-fusion"
  "no-coarsen:--no-coarsen" "no-phases:--no-phases" "no-ghosts:--no-ghosts" "no-hoist:--no-hoist"
  "no-dup:--no-dup" "no-row-cache:--no-row-cache" "no-epilogue:--no-epilogue" "eager:--scheduler eager")
late="--no-phases --no-ghosts --no-gather-fusion --no-epilogue"
cumulative=("baseline:--scheduler depth --no-fusion --no-hfuse --no-dup --no-coarsen --no-hoist $late"
  "+fusion:--scheduler depth --no-coarsen --no-hoist $late"
  "+coarsen+inline+hoist:$late"
  "+phases+ghosts:--no-gather-fusion --no-epilogue"
  "+gather+epilogue:")
table() {
  local -n configs=$1
  printf '%-16s %5s' model batch
  for c in "${configs[@]}"; do printf ' %24s' "${c%%:*}"; done
  printf '\n'
  for spec in treelstm_small:tree mvrnn_small:tree birnn_small:tokens stackrnn_small:tokens nestedrnn_small:nested drnn_small:drnn; do
  model=${spec%%:*}; input=$dir/${spec##*:}.jsonl
  $t run "models/$model.rly" --inputs "$input" --random-params 0 --save-params "$dir/w.safetensors" -o "$dir/o.jsonl" --batch 64 >/dev/null 2>&1
  for b in 8 64; do
    printf '%-16s %5s' "$model" "$b"
    for c in "${configs[@]}"; do
      flags=${c#*:}
      # Best of $reps runs: the machine is shared, and the minimum is the stable statistic.
      ms=""
      for _ in $(seq "$reps"); do
        # shellcheck disable=SC2086
        prof=$($t run "models/$model.rly" --inputs "$input" --params "$dir/w.safetensors" --batch "$b" \
          --threads 1 --profile $flags -o "$dir/out.jsonl" 2>&1 >/dev/null)
        launches=$(sed -n 's/.*batched launches \([0-9]*\).*/\1/p' <<<"$prof")
        one=$(sed -n 's/^time (ms): total \([0-9.]*\).*/\1/p' <<<"$prof")
        ms=$(awk -v a="$ms" -v b="$one" 'BEGIN { print (a == "" || b < a) ? b : a }')
      done
      per=$(awk -v t="$ms" -v n="$n" -v b="$b" 'BEGIN { printf "%.2f", t / int((n + b - 1) / b) }' | tr -d '\n')
      printf ' %14s ms %6s L' "$per" "$launches"
    done
    printf '\n'
  done
  done
}
echo "## Each optimization off in turn"
table off_each
echo
echo "## Cumulative (ACROBAT's order)"
table cumulative
