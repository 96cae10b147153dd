#!/usr/bin/env bash
# Cold A/B of two tumble binaries: the first run of a fresh process (the `--profile` total less
# decoding), the binaries alternating per round, 128 inputs at batch 64, 1 thread; prints one
# line per run, then per model the medians [min-max] and new/old.
# Usage: OLD=path/to/old/tumble NEW=target/release/tumble [MODELS="mvrnn_large ..."] \
#          bench/cold_ab.sh [ROUNDS] > cold.txt      (needs bench/.data from bench/run)
cd "$(dirname "$0")/.."
OLD=${OLD:?set OLD to the baseline binary}; NEW=${NEW:-target/release/tumble}
ROUNDS=${1:-5}
D=bench/.data
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
. bench/ab_inputs.sh
for ms in ${MODELS:-mvrnn_large mvrnn_small treelstm_small nestedrnn_small birnn_small}; do
  in=$(ab_input "$ms" 64)
  for r in $(seq "$ROUNDS"); do
    for v in old new; do
      bin=$OLD; [ $v = new ] && bin=$NEW
      t=$($bin run models/$ms.rly --inputs "$in" --params $D/weights/$ms.seed0.safetensors --batch 64 --threads 1 --profile -o $TMP/out.jsonl 2>&1 |
        awk '/^time \(ms\)/{for(i=1;i<=NF;i++){if($i=="total")t=$(i+1); if($i=="decode")d=$(i+1)}; printf "%.3f", t-d}')
      echo "$ms $v $t"
    done
  done
done | tee "$TMP/runs.txt"
python3 - "$TMP/runs.txt" <<'PY'
import sys, collections, statistics as st
d = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) == 3 and p[2]:
        d[p[0]][p[1]].append(float(p[2]))
for m, v in d.items():
    o, n = st.median(v["old"]), st.median(v["new"])
    print(f"{m:16s} old {o:8.2f} [{min(v['old']):.1f}-{max(v['old']):.1f}]  "
          f"new {n:8.2f} [{min(v['new']):.1f}-{max(v['new']):.1f}]  new/old {n / o:.3f}")
PY
