#!/usr/bin/env bash
# Interleaved A/B of the host program: evaluation steps and the profile's `program` ms (the last of
# `--repeat 4`) and warm medians, min and median over rounds, 1 thread. Needs bench/.data (bench/run).
# Usage: OLD=... NEW=... bench/prog_ab.sh ROUNDS MODEL BATCH [MODEL BATCH ...]
cd "$(dirname "$0")/.."; . bench/ab_inputs.sh; R=$1; shift
while [ $# -ge 2 ]; do m=$1; b=$2; shift 2; in=$(ab_input $m $b)
for r in $(seq $R); do for v in old new; do cmd=$NEW; [ $v = old ] && cmd=$OLD
out=$($cmd run models/$m.rly --inputs $in --params bench/.data/weights/$m.seed0.safetensors --batch $b --threads 1 --profile --repeat 4 -o /dev/null 2>&1)
p=$(sed -n 's/^time (ms): total [0-9.]* = program \([0-9.]*\) .*/\1/p' <<<"$out"); w=$(sed -n 's/^repeats without decoding inputs.*warm median //p' <<<"$out"); s=$(sed -n 's/^host program: \([0-9]*\) evaluation.*/\1/p' <<<"$out")
echo "$m $b $v $p $w $s"; done; done; done | python3 -c '
import sys,statistics as st,collections
d=collections.defaultdict(list)
for l in sys.stdin:
  m,b,v,p,w,s=l.split(); d[(m,b,v)].append((float(p),float(w),int(s)))
for (m,b) in dict.fromkeys((k[0],k[1]) for k in d):
  o,n=d[(m,b,"old")],d[(m,b,"new")]
  f=lambda xs,i: (min(x[i] for x in xs), st.median(x[i] for x in xs))
  print(f"{m} b{b}: steps {o[0][2]} -> {n[0][2]}; program ms min {f(o,0)[0]:.2f} -> {f(n,0)[0]:.2f}, median {f(o,0)[1]:.2f} -> {f(n,0)[1]:.2f}; warm ms min {f(o,1)[0]:.2f} -> {f(n,1)[0]:.2f}, median {f(o,1)[1]:.2f} -> {f(n,1)[1]:.2f}")
'
