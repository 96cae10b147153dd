#!/usr/bin/env bash
# A/B of two tumble binaries (e.g. before and after a restructuring), alternating per round,
# warm medians of `--repeat 4` (decoding excluded), every zoo model small and large at batch 64,
# 1 thread. Outputs of the two binaries are compared with `cmp` on the first round.
# Usage: OLD=path/to/old/tumble NEW=target/release/tumble bench/binary_ab.sh [ROUNDS] > ab.txt
# (needs bench/.data from bench/run; prints one line per run, then a summary).
cd "$(dirname "$0")/.."
OLD=${OLD:?set OLD to the baseline binary}; NEW=${NEW:-target/release/tumble}
ROUNDS=${1:-3}
D=bench/.data
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
. bench/ab_inputs.sh
for m in treelstm birnn stackrnn nestedrnn mvrnn drnn; do for s in small large; do
  in=$(ab_input "${m}_$s" 64)
  for r in $(seq "$ROUNDS"); do
    for v in new old; do
      bin=$NEW; [ $v = old ] && bin=$OLD
      out=$(TUMBLE_NUM_THREADS=1 $bin run models/${m}_$s.rly --inputs $in --params $D/weights/${m}_$s.seed0.safetensors --batch 64 --threads 1 --profile --repeat 4 -o $TMP/$v.jsonl 2>&1)
      w=$(sed -n 's/^repeats without decoding inputs.*warm median \([0-9.]*\)$/\1/p' <<<"$out")
      same=""; [ $r = 1 ] && [ $v = old ] && { cmp -s $TMP/new.jsonl $TMP/old.jsonl && same=" outputs-identical" || same=" OUTPUTS-DIFFER"; }
      echo "$m $s $v r$r warm $w$same"
    done
  done
done; done
