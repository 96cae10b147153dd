#!/usr/bin/env bash
# Interleaved A/B of two tumble commands on a few points: warm medians (decoding excluded) and
# first runs of `--repeat 4`, 1 thread. OLD and NEW are commands (a binary, or `env VAR=1 binary`
# to toggle a switch on one binary). Outputs of the two are compared with `cmp` on round 1.
# OLD_ARGS and NEW_ARGS (optional) are flags of `tumble run` added to that side's command line,
# for switches that are flags rather than environment variables (`NEW_ARGS=--no-locality-chunks`).
# Usage: OLD=... NEW=... bench/pair_ab.sh ROUNDS MODEL BATCH [MODEL BATCH ...]
#   e.g. OLD="env TUMBLE_NO_DIRECT_A=1 target/release/tumble" NEW=target/release/tumble \
#        bench/pair_ab.sh 6 stackrnn_small 8 nestedrnn_small 8
# (needs bench/.data from bench/run).
cd "$(dirname "$0")/.."
OLD=${OLD:?set OLD to the baseline command}; NEW=${NEW:?set NEW to the command to compare}
ROUNDS=${1:?rounds}; shift
D=bench/.data
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
. bench/ab_inputs.sh
while [ $# -ge 2 ]; do
  m=$1; b=$2; shift 2; in=$(ab_input "$m" "$b")
  for r in $(seq "$ROUNDS"); do
    for v in old new; do
      cmd=$NEW; args=${NEW_ARGS:-}; [ $v = old ] && { cmd=$OLD; args=${OLD_ARGS:-}; }
      # shellcheck disable=SC2086 # $cmd and $args are word lists
      out=$($cmd run "models/$m.rly" --inputs "$in" --params "$D/weights/$m.seed0.safetensors" \
        --batch "$b" --threads 1 --profile --repeat 4 $args -o "$TMP/$v.jsonl" 2>&1)
      line=$(sed -n 's/^repeats without decoding inputs (ms per run): //p' <<<"$out")
      echo "$m b$b $v first ${line%% *} warm ${line##* }"
    done
    [ "$r" = 1 ] && { cmp -s "$TMP/old.jsonl" "$TMP/new.jsonl" && echo "$m b$b outputs-identical" || echo "$m b$b OUTPUTS-DIFFER"; }
  done
done | python3 -c '
import sys, statistics as st, collections
d = collections.defaultdict(list)
for l in sys.stdin:
    p = l.split()
    if len(p) == 3: print(" ".join(p)); continue
    d[(p[0], p[1], p[2])].append((float(p[4]), float(p[6])))
for (m, b) in dict.fromkeys((k[0], k[1]) for k in d):
    o, n = d[(m, b, "old")], d[(m, b, "new")]
    wo, wn = st.median(x[1] for x in o), st.median(x[1] for x in n)
    fo, fn = st.median(x[0] for x in o), st.median(x[0] for x in n)
    print(f"{m} {b}: warm median {wo:.2f} -> {wn:.2f} ms ({wn/wo:.3f}); first run {fo:.2f} -> {fn:.2f} ({fn/fo:.3f}); {len(n)} rounds")
'
