#!/usr/bin/env bash
# Programs a perf-cliff audit wrote (bench/cliffs/, issue 17): tumble OLD against NEW, alternated,
# warm medians of `--repeat 3` (decoding excluded), 1 thread, random weights (seed 0); each
# program next to the form that states by hand what the compiler should find (a dense per arm
# instead of a weight chosen per instance, a `Primitive=1` input transform).
# Usage: OLD=<tumble> NEW=<tumble> bench/cliffs_ab.sh [ROUNDS [PROGRAM ...]]   (inputs:
# bench/cliffs/gen_inputs.py); PROGRAMs (names without `.rly`) pick some of the list below.
cd "$(dirname "$0")/.."
OLD=${OLD:?set OLD to the baseline tumble}; NEW=${NEW:?set NEW to the tumble to compare}
ROUNDS=${1:-3}; shift $(( $# > 0 ? 1 : 0 ))
ONLY=" $* "
D=bench/.data/cliffs
[ -f $D/typed128.jsonl ] || python3 bench/cliffs/gen_inputs.py
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
for p in gate_wsel_512:gate256 gate_arms_512:gate256 expr_wsel_512:expr64 expr_plain_512:expr64 \
         gru_plain_512:seq256 gru_prim_512:seq256 lstmcat_plain_512:seq256 lstmcat_sep_512:seq256 \
         dan_plain_64:seq256 loopn_plain_64:loop256 memnet_bcast_512:mem256 memnet_plain_512:mem256 \
         lstm_stack_512:seq256 lstm_sep_512:seq256 gnn_prim_64:graph256 gnn_map_64:graph256 \
         rowsel_512:rows128 gnn_idx_512:rows128 ptr_512:ptr256 s2s_attend_512:s2s256 cky_nth_64:short128 cky_zip_64:short128 \
         beam_512:beam64 beamsign_512:beam64 crf_64:seq256 crfgemm_64:seq256 textcnn_512:ids128 \
         restack_512:rows128 pblstm_64:frames128 lnlstm_256:seq256 lnlstm_op_256:seq256 \
         rntn_bmm_64:btree128 rntn_dense_64:btree128 capsule_256:caps256 \
         viterbi_ax0_128:seq256 viterbi_ax1_128:seq256 \
         gelu_erf_256:seq256 gelu_pow_256:seq256 gelu_tanh_256:seq256 handln_256:seq256 \
         handln_op_256:seq256 scanmax_256:seq256 mha_div_256:seq256 mha_mul_256:seq256 \
         lstm_respelled_256:seq256 lstm_let_256:seq256 moe_map_512:seq256 moe_where_512:seq256 \
         leafgate_256:btree128 leafgate_where_256:btree128 moe_take_256:seq256 moe_if_256:seq256 \
         kvdec_pad_128:kv128 kvdec_arith_128:kv128 onehot_256:ids128 onehot_take_256:ids128 \
         rnn_count_256:count256 rnn_list_256:seq256 ggnn_typed_128:typed128 ggnn_typedlist_128:typedl128; do
  m=${p%%:*}; in=$D/${p##*:}.jsonl
  [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $m "* ]] || continue
  for r in $(seq "$ROUNDS"); do
    for v in old new; do
      cmd=$NEW; [ $v = old ] && cmd=$OLD
      out=$(TUMBLE_NUM_THREADS=1 $cmd run "bench/cliffs/$m.rly" --inputs "$in" --random-params 0 \
        --profile --repeat 3 -o "$TMP/$v.jsonl" 2>&1)
      line=$(sed -n 's/^repeats without decoding inputs (ms per run): //p' <<<"$out")
      echo "$m $v ${line##* }"
    done
    [ "$r" = 1 ] && python3 - "$TMP/old.jsonl" "$TMP/new.jsonl" "$m" <<'PY'
import json, sys
def nums(v, out):
    if isinstance(v, list): [nums(x, out) for x in v]
    elif isinstance(v, dict): [nums(v[k], out) for k in sorted(v)]
    elif isinstance(v, (int, float)) and not isinstance(v, bool): out.append(float(v))
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
xs, ys = [], []
nums(a, xs); nums(b, ys)
d = max((abs(x - y) for x, y in zip(xs, ys)), default=0.0) if len(xs) == len(ys) else float("inf")
print(f"{sys.argv[3]} outputs: max |old - new| = {d:.3g}")
PY
  done
done | python3 -c '
import sys, statistics
t = {}
for line in sys.stdin:
    w = line.split()
    if len(w) == 3 and w[1] in ("old", "new"):
        t.setdefault(w[0], {}).setdefault(w[1], []).append(float(w[2]))
    else:
        print(line.rstrip())
print("| program | old ms (median [min, max]) | new ms | old / new |")
print("|---|---:|---:|---:|")
for m, d in t.items():
    o, n = statistics.median(d["old"]), statistics.median(d["new"])
    f = lambda xs: f"{statistics.median(xs):.1f} [{min(xs):.1f}, {max(xs):.1f}]"
    print("| {} | {} | {} | {:.2f}× |".format(m, f(d["old"]), f(d["new"]), o / n))
'
