#!/usr/bin/env bash
# Ablation of tumble's optimizations (ACROBAT Figure 6 style): every small model at batch 8 and 64,
# with all optimizations, then with each one switched off in turn; launches and ms per mini-batch.
# Usage: bench/ablation.sh [N_INSTANCES]   (run from the repository root; 1 kernel thread)
set -euo pipefail
n=${1:-64}
cargo build --release -q -p tumble-cli
t=target/release/tumble
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
$t data sst --split test --format tree --limit "$n" -o "$dir/tree.jsonl" 2>/dev/null
$t data sst --split test --format tokens --limit "$n" -o "$dir/tokens.jsonl" 2>/dev/null
$t data nested --count "$n" -o "$dir/nested.jsonl" 2>/dev/null
$t data drnn --count "$n" -o "$dir/drnn.jsonl" 2>/dev/null
configs=("all:" "no-fusion:--no-fusion" "no-coarsen:--no-coarsen" "no-phases:--no-phases" "no-hoist:--no-hoist" "no-dup:--no-dup" "no-hfuse:--no-hfuse" "no-gather-fusion:--no-gather-fusion" "no-row-cache:--no-row-cache" "eager:--scheduler eager")
printf '%-16s %5s' model batch
for c in "${configs[@]}"; do printf ' %22s' "${c%%:*}"; done
printf '\n'
for spec in treelstm_small:tree mvrnn_small:tree birnn_small:tokens stackrnn_small:tokens nestedrnn_small:nested drnn_small:drnn; do
  model=${spec%%:*}; input=$dir/${spec##*:}.jsonl
  $t run "models/$model.rly" --inputs "$input" --random-params 0 --save-params "$dir/w.safetensors" -o "$dir/o.jsonl" --batch 64 >/dev/null 2>&1
  for b in 8 64; do
    printf '%-16s %5s' "$model" "$b"
    for c in "${configs[@]}"; do
      flags=${c#*:}
      # shellcheck disable=SC2086
      prof=$($t run "models/$model.rly" --inputs "$input" --params "$dir/w.safetensors" --batch "$b" \
        --threads 1 --profile $flags -o "$dir/out.jsonl" 2>&1 >/dev/null)
      launches=$(sed -n 's/.*batched launches \([0-9]*\).*/\1/p' <<<"$prof")
      ms=$(sed -n 's/^time (ms): total \([0-9.]*\).*/\1/p' <<<"$prof")
      per=$(awk -v t="$ms" -v n="$n" -v b="$b" 'BEGIN { printf "%.2f", t / int((n + b - 1) / b) }' | tr -d '\n')
      printf ' %12s ms %6s L' "$per" "$launches"
    done
    printf '\n'
  done
done
