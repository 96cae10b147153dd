#!/usr/bin/env python3
"""Plain vs annotated: every zoo model in `models/` (static blocks marked by hand with `Primitive=1`)
against its plain form in `models/plain/` (no marks: the compiler finds the blocks), same weights,
same instances, interleaved in one process each per round.

Per model: one mini-batch of --batch instances (the suite's data: SST test trees / sentences,
generated NestedRNN / DRNN / Berxit instances), weights drawn once (`--random-params 0
--save-params`) from the annotated file and read by both. Each round runs both files (order
alternating) with `--repeat R --profile`; the time is the warm median of the repeats (all but the
first run of the process), the launches are the profile's `batched launches`. Reported: median
over rounds of each, the ratio plain/annotated, the spread (min-max of the per-round ratios),
and whether the outputs agree (floats within 1e-4 relative + 1e-5 absolute, everything else
exactly). Exits 1 if any output differs.

    bench/plain_vs_annotated.py [--models treelstm_small,...] [--batch 64] [--rounds 5] [--repeat 3]

Needs only python3 and target/release/tumble (it builds it)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXE = os.path.join(ROOT, "target", "release", "tumble")
MODELS = [f"{m}_{s}" for m in ("treelstm", "mvrnn", "birnn", "nestedrnn", "drnn", "stackrnn", "berxit")
          for s in ("small", "large")]


def data_args(model: str, n: int) -> list[str]:
    kind, size = model.rsplit("_", 1)
    if kind in ("treelstm", "mvrnn"):
        return ["sst", "--split", "test", "--format", "tree", "--limit", str(n)]
    if kind in ("birnn", "stackrnn"):
        return ["sst", "--split", "test", "--format", "tokens", "--limit", str(n)]
    if kind == "nestedrnn":
        return ["nested", "--count", str(n), "--seed", "0"]
    if kind == "drnn":
        return ["drnn", "--count", str(n), "--seed", "0", "--hidden", "256" if size == "small" else "512"]
    return ["berxit", "--count", str(n), "--seed", "0", "--threshold", "0.8"]


def run(model_file: str, inputs: str, weights: str, batch: int, repeat: int, out: str) -> tuple[float, int]:
    p = subprocess.run([EXE, "run", model_file, "--inputs", inputs, "--params", weights, "--batch", str(batch),
                        "--threads", "1", "--repeat", str(repeat), "--profile", "-o", out],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{model_file}: {p.stderr.strip()[-2000:]}")
    launches = int(re.search(r"batched launches (\d+)", p.stderr).group(1))
    warm = re.search(r"warm median ([0-9.]+)", p.stderr)
    total = float(warm.group(1)) if warm else float(re.search(r"time \(ms\): total ([0-9.]+)", p.stderr).group(1))
    return total, launches


def close(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= 1e-5 + 1e-4 * abs(b)
    return a == b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "tumble-cli"], cwd=ROOT, check=True)
    tmp = tempfile.mkdtemp(prefix="plain-vs-annotated-")
    rows, bad = [], False
    for model in args.models.split(","):
        annotated = os.path.join(ROOT, "models", f"{model}.rly")
        plain = os.path.join(ROOT, "models", "plain", f"{model}.rly")
        if not os.path.exists(plain):
            print(f"{model}: no plain form, skipped", file=sys.stderr)
            continue
        n = 8 if model.startswith("berxit") else args.batch
        inputs = os.path.join(tmp, f"{model}.jsonl")
        subprocess.run([EXE, "data", *data_args(model, n), "-o", inputs], check=True, capture_output=True)
        weights = os.path.join(tmp, f"{model}.safetensors")
        subprocess.run([EXE, "run", annotated, "--inputs", inputs, "--random-params", "0", "--save-params", weights,
                        "--batch", "1", "-o", os.path.join(tmp, "w.jsonl")], check=True, capture_output=True)
        times = {"a": [], "p": []}
        launches = {}
        outs = {k: os.path.join(tmp, f"{model}.{k}.jsonl") for k in "ap"}
        for r in range(args.rounds):
            for k in ("ap" if r % 2 == 0 else "pa"):
                t, l = run(annotated if k == "a" else plain, inputs, weights, n, args.repeat, outs[k])
                times[k].append(t)
                launches[k] = l
        with open(outs["a"]) as f, open(outs["p"]) as g:
            same = all(close(json.loads(x), json.loads(y)) for x, y in zip(f, g))
        bad |= not same
        ratios = [p / a for p, a in zip(times["p"], times["a"])]
        ta, tp = statistics.median(times["a"]), statistics.median(times["p"])
        rows.append((model, n, ta, tp, tp / ta, min(ratios), max(ratios), launches["a"], launches["p"],
                     launches["p"] / max(launches["a"], 1), same))
        print(f"{model}: {ta:.1f} vs {tp:.1f} ms, launches {launches['a']} vs {launches['p']}", file=sys.stderr)
    print(f"batch {args.batch} (Berxit 8), 1 thread, warm median of {args.repeat - 1} repeats, median of "
          f"{args.rounds} rounds\n")
    print("| model | batch | annotated ms | plain ms | plain/annotated (spread) | launches annotated | "
          "launches plain | ratio | outputs agree |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for m, n, ta, tp, q, lo, hi, la, lp, lq, same in rows:
        print(f"| {m} | {n} | {ta:.1f} | {tp:.1f} | {q:.2f} ({lo:.2f}–{hi:.2f}) | {la} | {lp} | {lq:.2f} | "
              f"{'yes' if same else 'NO'} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
