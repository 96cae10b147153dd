#!/usr/bin/env bash
# Plain programs: independent calls made concurrent and a second recursion phased (compile-time
# passes `concurrency` and `phases`). A binary-tree encoder (H = 256) with a refinement loop after
# it, written plainly (bench/models/bintree_refine.rly) and with db.concurrent by hand
# (bintree_refine_annotated.rly), on 256 random trees of 1-256 leaves; warm medians of
# `--repeat 3` (decoding excluded) per variant, rounds interleaved, 1 thread; outputs compared.
# Usage: bench/auto_concurrency.sh [ROUNDS] [TUMBLE]
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}; T=${2:-target/release/tumble}
D=$(mktemp -d); trap 'rm -rf "$D"' EXIT
python3 - "$D/trees.jsonl" <<'PY'
import json, random, sys
r = random.Random(11)
def tree(d):
    if d == 0 or r.random() < 0.25:
        return {"Leaf": [[r.randrange(500)]]}
    return {"Node": [tree(d - 1), tree(d - 1)]}
with open(sys.argv[1], "w") as f:
    for _ in range(256):
        f.write(json.dumps({"t": tree(r.randint(1, 8))}) + "\n")
PY
M=bench/models
"$T" run $M/bintree_refine.rly --inputs "$D/trees.jsonl" --random-params 2 --save-params "$D/w.safetensors" -o /dev/null
variants=("plain|$M/bintree_refine.rly"
          "plain, --no-auto-concurrency --no-phases|$M/bintree_refine.rly --no-auto-concurrency --no-phases"
          "plain, --no-auto-concurrency|$M/bintree_refine.rly --no-auto-concurrency"
          "annotated|$M/bintree_refine_annotated.rly")
for r in $(seq "$ROUNDS"); do
  for b in 8 64; do
    for i in "${!variants[@]}"; do
      name=${variants[$i]%%|*}; args=${variants[$i]#*|}
      out=$("$T" run $args --inputs "$D/trees.jsonl" --params "$D/w.safetensors" --batch $b --threads 1 \
        --profile --repeat 3 -o "$D/out$i.$b.jsonl" 2>&1)
      launches=$(sed -n 's/.*batched launches \([0-9]*\).*/\1/p' <<<"$out")
      warm=$(sed -n 's/^repeats without decoding inputs (ms per run): .*warm median //p' <<<"$out")
      echo "$b|$name|$launches|$warm"
    done
    for i in 1 2 3; do cmp -s "$D/out0.$b.jsonl" "$D/out$i.$b.jsonl" || echo "b$b: outputs of variant $i DIFFER" >&2; done
  done
done | python3 -c '
import sys, statistics as st, collections
d = collections.defaultdict(list); l = {}
for line in sys.stdin:
    b, name, launches, warm = line.strip().split("|")
    d[(int(b), name)].append(float(warm)); l[(int(b), name)] = launches
print("| batch | variant | launches | warm ms, median [min, max] |")
print("|---:|---|---:|---|")
for (b, name), v in sorted(d.items(), key=lambda kv: kv[0][0]):
    print(f"| {b} | {name} | {l[(b, name)]} | {st.median(v):.2f} [{min(v):.2f}, {max(v):.2f}] |")
'
