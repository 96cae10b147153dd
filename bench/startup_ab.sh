#!/usr/bin/env bash
# Start-up A/B of two tumble binaries: the "ready after" line of `--profile` (parse, check, read
# weights, compile, pack) for a one-instance run from source and from a compiled model, the two
# binaries interleaved, N rounds; prints per-model medians (min-max) in milliseconds.
# Needs the suite's data (bench/run makes it).
#   bench/startup_ab.sh OLD NEW [ROUNDS] [MODEL...]
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?old binary}; NEW=${2:?new binary}; ROUNDS=${3:-5}; shift 3 || true
MODELS=${*:-treelstm_small treelstm_large birnn_large mvrnn_large nestedrnn_large}
D=bench/.data
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
ready() { "$@" --threads 1 --profile -o /dev/null 2>&1 | sed -n 's/.*ready after \([0-9.]*\) ms.*/\1/p'; }
for m in $MODELS; do
  W=$D/weights/$m.seed0.safetensors; X=$D/one.$m.jsonl
  "$OLD" compile models/$m.rly --params "$W" --inputs "$X" -o "$TMP/$m.old.tumble" 2>/dev/null
  "$NEW" compile models/$m.rly --params "$W" --inputs "$X" -o "$TMP/$m.new.tumble" 2>/dev/null
  for _ in $(seq "$ROUNDS"); do for v in old new; do
    b=$OLD; [ $v = new ] && b=$NEW
    echo "$m $v $(ready "$b" run models/$m.rly --params "$W" --inputs "$X") $(ready "$b" run "$TMP/$m.$v.tumble" --inputs "$X")"
  done; done
done | python3 -c '
import sys, collections, statistics as st
d = collections.defaultdict(list)
for l in sys.stdin:
    m, v, s, c = l.split(); d[(m, v, "s")].append(float(s)); d[(m, v, "c")].append(float(c))
f = lambda k: f"{st.median(d[k]):.1f} ({min(d[k]):.1f}-{max(d[k]):.1f})"
print("| model | source: old | source: new | compiled: old | compiled: new |")
print("|---|---:|---:|---:|---:|")
for m in dict.fromkeys(k[0] for k in d):
    print("| " + m + " | " + " | ".join(f((m, v, k)) for k in "sc" for v in ("old", "new")) + " |")
'
