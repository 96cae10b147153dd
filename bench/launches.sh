#!/usr/bin/env bash
# Batching structure of the runtime per model and scheduler: DFG nodes, batched launches, mean batch
# size and wall time (reference kernels, so times show overhead and batching, not kernel speed).
# Usage: bench/launches.sh [N_INSTANCES] [BATCH]   (run from the repository root)
set -euo pipefail
n=${1:-64}
batch=${2:-64}
cargo build --release -q -p tumble-cli
t=target/release/tumble
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
$t data sst --split test --format tree --limit "$n" -o "$dir/tree.jsonl" 2>/dev/null
$t data sst --split test --format tokens --limit "$n" -o "$dir/tokens.jsonl" 2>/dev/null
$t data nested --count "$n" -o "$dir/nested.jsonl" 2>/dev/null
$t data drnn --count "$n" -o "$dir/drnn.jsonl" 2>/dev/null
printf '%-16s %-8s %8s %9s %8s %10s\n' model scheduler nodes launches "mean B" "time ms"
for spec in treelstm_small:tree mvrnn_small:tree birnn_small:tokens stackrnn_small:tokens nestedrnn_small:nested drnn_small:drnn; do
  model=${spec%%:*}; input=$dir/${spec##*:}.jsonl
  for s in inline depth agenda eager; do
    prof=$($t run "models/$model.rly" --inputs "$input" --random-params 0 --batch "$batch" \
      --scheduler "$s" --profile -o "$dir/out.jsonl" 2>&1 >/dev/null)
    nodes=$(sed -n 's/.*DFG nodes \([0-9]*\).*/\1/p' <<<"$prof")
    launches=$(sed -n 's/.*batched launches \([0-9]*\).*/\1/p' <<<"$prof")
    mean=$(sed -n 's/^mean batch size \([0-9.]*\)/\1/p' <<<"$prof")
    ms=$(sed -n 's/^time (ms): total \([0-9.]*\).*/\1/p' <<<"$prof")
    printf '%-16s %-8s %8s %9s %8s %10s\n' "$model" "$s" "$nodes" "$launches" "$mean" "$ms"
  done
done
