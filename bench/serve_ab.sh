#!/usr/bin/env bash
# Alternated serving A/B: for each round, one fresh `tumble serve` per command (a binary, or
# `env VAR=1 binary`) in turn, each loaded for SECONDS by the open-loop generator at RATE req/s
# (TreeLSTM-large on SST test trees, one tree a request, `--threads $THREADS` — 1 unless
# given — `--max-batch 64 --max-wait-ms 10`), printing throughput and p50 / p99 latency. Servers run one at a time, so
# they never share the machine; rounds alternate, so a drifting VM affects every command alike.
# SERVE_ARGS (optional) are added to every server's command line (`--policy continuous
# --cell-levels 1`); a command's own flags go after the binary.
# Usage: bench/serve_ab.sh ROUNDS RATE SECONDS CMD [CMD ...]
#   e.g. SERVE_ARGS="--policy continuous --cell-levels 1" \
#        bench/serve_ab.sh 3 1200 5 /tmp/old/tumble target/release/tumble
# (needs `cargo build --release -p tumble-serve --example serve_load` and bench/.data from
# bench/serve_load.py or bench/run.)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:?rounds}; RATE=${2:?rate}; SECONDS_=${3:?seconds}; shift 3
[ $# -ge 1 ] || { echo "give at least one command" >&2; exit 2; }
GEN=${CARGO_TARGET_DIR:-target}/release/examples/serve_load
TREES=bench/.data/sst_test_tree.jsonl
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
for r in $(seq "$ROUNDS"); do
  for cmd in "$@"; do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # shellcheck disable=SC2086 # $cmd and $SERVE_ARGS are word lists
    $cmd serve models/treelstm_large.rly --random-params 0 --port "$port" --threads "${THREADS:-1}" \
      --max-batch 64 --max-wait-ms 10 ${SERVE_ARGS:-} 2> "$TMP/server.err" &
    server=$!
    for _ in $(seq 100); do grep -q listening "$TMP/server.err" 2>/dev/null && break; sleep 0.05; done
    "$GEN" "127.0.0.1:$port" treelstm_large "$TREES" "$RATE" "$SECONDS_" "$r" > "$TMP/load.json"
    kill "$server"; wait "$server" || true
    python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print("round %s  %-40s thr %7.1f  p50 %6.1f  p99 %6.1f ms" % (sys.argv[2], sys.argv[3][:40], d["throughput"], d["p50"], d["p99"]))
' "$TMP/load.json" "$r" "$cmd"
  done
done
