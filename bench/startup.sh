#!/usr/bin/env bash
# Start-up time: one instance run from source (parse, check, compile, plan) against the same model
# compiled once with `tumble compile` (weights stored in the file). Interleaved, N rounds each;
# prints per-model medians and ranges in milliseconds. Needs the suite's data (bench/run makes it).
#   bench/startup.sh [ROUNDS] [MODEL...]
set -euo pipefail
cd "$(dirname "$0")/.."
T=${TUMBLE:-target/release/tumble}
ROUNDS=${1:-15}; shift || true
MODELS=${*:-treelstm_small treelstm_large birnn_large mvrnn_large nestedrnn_large drnn_large stackrnn_large}
D=bench/.data
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
ms() { local s e; s=$(date +%s%N); "$@" >/dev/null 2>&1; e=$(date +%s%N); echo $(( (e - s) / 1000 )); }
printf "%-18s %22s %22s %8s\n" model "from source (ms)" "compiled (ms)" ratio
for m in $MODELS; do
  W=$D/weights/$m.seed0.safetensors; X=$D/one.$m.jsonl
  $T compile models/$m.rly --params "$W" --inputs "$X" -o "$TMP/$m.tumble" 2>/dev/null
  src=(); cmp=()
  for _ in $(seq "$ROUNDS"); do
    src+=("$(ms "$T" run models/$m.rly --params "$W" --inputs "$X" --threads 1)")
    cmp+=("$(ms "$T" run "$TMP/$m.tumble" --inputs "$X" --threads 1)")
  done
  python3 - "$m" "${src[*]}" "${cmp[*]}" <<'PY'
import sys, statistics as st
m, a, b = sys.argv[1], [int(x)/1000 for x in sys.argv[2].split()], [int(x)/1000 for x in sys.argv[3].split()]
f = lambda v: f"{st.median(v):7.1f} [{min(v):.1f}-{max(v):.1f}]"
print(f"{m:<18} {f(a):>22} {f(b):>22} {st.median(a)/st.median(b):7.2f}x")
PY
done
