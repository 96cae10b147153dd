#!/usr/bin/env bash
# Scaling of the compiler and runtime with program size (issue 25, "time grows faster than the
# input"): a chain of N globals, each calling the next on `negative` of its argument, and one body
# of N `let`s, each adding the first argument to the line before (a block of N operators that all
# read one input), at N and 4N, for `tumble check` and `tumble run` (batched and reference).
# Prints the best of ROUNDS wall
# times and the ratio time(4N) / time(N); a ratio well above 4-5 means a step that is not
# near-linear. A benchmark, not a test: the machine's speed drifts.
#
#   bench/scaling.sh [N] [ROUNDS]      (defaults 5000, 3; from the repository root)
set -euo pipefail
n=${1:-5000}
rounds=${2:-3}
cargo build --release -q -p tumble-cli
t=target/release/tumble
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
make_chain() { # count file
  python3 - "$1" "$2" <<'PY'
import sys
n, path = int(sys.argv[1]), sys.argv[2]
ty = "Tensor[(1, 4), float32]"
with open(path, "w") as f:
    for i in range(n - 1):
        f.write(f"def @f{i}(%x: {ty}) -> {ty} {{ @f{i + 1}(negative(%x)) }}\n")
    f.write(f"def @f{n - 1}(%x: {ty}) -> {ty} {{ %x }}\n")
    f.write(f"def @main(%x: {ty}) -> {ty} {{ @f0(%x) }}\n")
PY
}
make_lets() { # count file
  python3 - "$1" "$2" <<'PY'
import sys
n, path = int(sys.argv[1]), sys.argv[2]
ty = "Tensor[(1, 4), float32]"
with open(path, "w") as f:
    f.write(f"def @main(%x: {ty}) -> {ty} {{\n  let %a0 = %x;\n")
    for i in range(1, n + 1):
        f.write(f"  let %a{i} = add(%a{i - 1}, %x);\n")
    f.write(f"  %a{n}\n}}\n")
PY
}
echo '{"x": [[1, 2, 3, 4]]}' > "$dir/x.jsonl"
best() { # command... ; prints the best wall time in seconds of $rounds runs
  local b=""
  for _ in $(seq "$rounds"); do
    local s e
    s=$(date +%s.%N)
    "$@" > /dev/null
    e=$(date +%s.%N)
    b=$(python3 -c "print(min(x for x in [$e - $s${b:+, $b}]))")
  done
  echo "$b"
}
for shape in chain lets; do
echo "# $shape: N = $n; best of $rounds; seconds"
echo "| step | N = $n | 4N = $((4 * n)) | ratio |"
echo "|---|---:|---:|---:|"
"make_$shape" "$n" "$dir/a.rly"
"make_$shape" "$((4 * n))" "$dir/b.rly"
for step in check run reference; do
  case $step in
    check) args=(check -q) ; tail=() ;;
    run) args=(run) ; tail=(--inputs "$dir/x.jsonl") ;;
    reference) args=(run) ; tail=(--inputs "$dir/x.jsonl" --engine reference) ;;
  esac
  a=$(best "$t" "${args[@]}" "$dir/a.rly" "${tail[@]}")
  b=$(best "$t" "${args[@]}" "$dir/b.rly" "${tail[@]}")
  python3 -c "print(f'| $step | {$a:.3f} | {$b:.3f} | {$b / $a:.2f} |')"
done
done
