# Sourced by the A/B scripts (binary_ab.sh, cold_ab.sh, pair_ab.sh): the instances a zoo model
# runs on, from bench/.data (made by bench/run): 32 instances at batch 8 or less, else 128.
# Usage: ab_input MODEL BATCH
ab_input() {
  local f
  case $1 in
    treelstm*|mvrnn*) f=sst_tree_128;; birnn*|stackrnn*) f=sst_tokens_128;; nestedrnn*) f=nested_128;;
    drnn_small) f=drnn256_128;; drnn_large) f=drnn512_128;; *) echo "no inputs for $1" >&2; exit 2;;
  esac
  if [ "$2" -le 8 ]; then echo "bench/.data/$f.first32.jsonl"; else echo "bench/.data/$f.first128.jsonl"; fi
}
