#!/usr/bin/env bash
# Shape-class kernel variants against the one generic kernel (issue 19, item 3): the GEMM
# dispatches each product by its shape at run time — N ≤ 8 output columns to the narrow dot
# products (`TUMBLE_NO_NARROW_GEMM` turns them off), row blocks of ≤ 8 rows to the AVX-512 direct
# tile that reads A where it lies (`TUMBLE_NO_DIRECT_A`), everything else to the blocked,
# packed GEMM. This runs `gemm_bench` on shapes of each class twice per round, interleaved —
# variants on (the default) and off (every product on the generic blocked kernel) — and prints
# the median time of each and their ratio, for contiguous A and for gathered A with an epilogue.
# Usage: bench/speculation.sh [ROUNDS]   (1 thread; ~1 minute a round)
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
cargo build --release -q -p tumble-kernels --example gemm_bench || exit 1
BIN=target/release/examples/gemm_bench
# B (rows), K, N: few rows (1, 4, 8) and many (14, 64), narrow N (5, 2) and wide (256, 768).
SHAPES="1,256,5;8,512,5;64,512,5;1253,512,5;8,256,2;64,256,2;1,256,256;4,256,256;8,256,256;14,256,256;64,256,256;1,512,768;8,512,768;64,512,768"
for r in $(seq "$ROUNDS"); do
  for v in spec generic; do
    if [ $v = generic ]; then
      out=$(TUMBLE_NO_NARROW_GEMM=1 TUMBLE_NO_DIRECT_A=1 $BIN --no-peak --min-time 0.2 --shapes "$SHAPES")
    else
      out=$($BIN --no-peak --min-time 0.2 --shapes "$SHAPES")
    fi
    grep -E '^ *[0-9]' <<<"$out" | tr -d '|' | awk -v v=$v '{print v, $1, $2, $3, $4, $6}'
  done
done | python3 -c '
import sys, statistics as st, collections
d = collections.defaultdict(list)
for l in sys.stdin:
    v, b, k, n, c, g = l.split()
    d[(int(b), int(k), int(n), v)].append((float(c), float(g)))
print("%5s %4s %4s | %-22s | %9s %9s %6s | %11s %9s %6s" % ("B", "K", "N", "class", "contig us", "generic", "ratio", "gath+sig us", "generic", "ratio"))
for (b, k, n) in dict.fromkeys(x[:3] for x in d):
    s, g = d[(b, k, n, "spec")], d[(b, k, n, "generic")]
    cls = "narrow (N<=8)" if n <= 8 else ("direct tile (B<=8)" if b <= 8 else "blocked (generic)")
    sc, gc = st.median(x[0] for x in s), st.median(x[0] for x in g)
    sg, gg = st.median(x[1] for x in s), st.median(x[1] for x in g)
    print(f"{b:>5} {k:>4} {n:>4} | {cls:<22} | {sc:>9.2f} {gc:>9.2f} {sc/gc:>6.3f} | {sg:>11.2f} {gg:>9.2f} {sg/gg:>6.3f}")
'
