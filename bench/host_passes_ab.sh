#!/usr/bin/env bash
# A/B of the host passes: the same binary with and without them, alternating, warm medians.
# Usage: bench/host_passes_ab.sh > ab.txt   (needs bench/.data from bench/run; prints one line per run)
cd "$(dirname "$0")/.."
T=${TUMBLE_BIN:-target/release/tumble}
D=bench/.data
declare -A IN=( [treelstm]=sst_tree_128.first128.jsonl [mvrnn]=sst_tree_128.first128.jsonl [birnn]=sst_tokens_128.first128.jsonl [stackrnn]=sst_tokens_128.first128.jsonl [nestedrnn]=nested_128.first128.jsonl )
for m in treelstm birnn stackrnn nestedrnn mvrnn drnn; do for s in small large; do
  if [ $m = drnn ]; then h=256; [ $s = large ] && h=512; in=$D/drnn${h}_128.first128.jsonl; else in=$D/${IN[$m]}; fi
  for b in 64; do
    for r in 1 2 3; do
      for v in new old; do
        f=""; [ $v = old ] && f="--no-param-consts --no-specialize --no-leaf-inline"
        out=$(TUMBLE_NUM_THREADS=1 $T run models/${m}_$s.rly --inputs $in --params $D/weights/${m}_$s.seed0.safetensors --batch $b --threads 1 --profile --repeat 4 $f -o /dev/null 2>&1)
        w=$(sed -n 's/^repeats without decoding inputs.*warm median \([0-9.]*\)$/\1/p' <<<"$out")
        p=$(sed -n 's/^time (ms): total [0-9.]* = program \([0-9.]*\) .*/\1/p' <<<"$out")
        echo "$m $s b$b $v r$r warm $w program $p"
      done
    done
  done
done; done
