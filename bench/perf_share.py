#!/usr/bin/env python3
"""Shares of a `perf record -g` profile by frames on the stack, for the profile figures in RESULTS.

    perf script -F ip,sym -i perf.data | bench/perf_share.py [--within SYM] [--frame SYM ...] [--top N]

Reads the stacks `perf script -F ip,sym` prints (a frame-pointer build: RUSTFLAGS="-C
force-frame-pointers=yes"). `--within SYM`: only the samples with a frame whose symbol contains
SYM (e.g. `grad_batch`: a training step's work). For each `--frame SYM`, the samples among those
with such a frame anywhere on the stack (the function and everything it called: an allocation
under `AlignedBuf::ensure` counts for it). `--top N`: the N most frequent leaf symbols.
"""
import argparse
import collections
import sys


def stacks(lines):
    cur = []
    for line in lines:
        line = line.strip()
        if not line:
            if cur:
                yield cur
            cur = []
            continue
        parts = line.split(None, 1)
        cur.append(parts[1] if len(parts) > 1 else "?")
    if cur:
        yield cur


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--within", help="only samples with a frame containing this")
    ap.add_argument("--frame", action="append", default=[], help="count samples with this frame")
    ap.add_argument("--top", type=int, default=0, help="the most frequent leaf symbols")
    a = ap.parse_args()
    total, kept = 0, 0
    hits = collections.Counter()
    leaves = collections.Counter()
    for s in stacks(sys.stdin):
        total += 1
        if a.within and not any(a.within in f for f in s):
            continue
        kept += 1
        for want in a.frame:
            if any(want in f for f in s):
                hits[want] += 1
        leaves[s[0].split("(")[0][-90:]] += 1
    scope = f"with a frame `{a.within}`" if a.within else "in all"
    print(f"{total} samples, {kept} {scope} ({100 * kept / max(total, 1):.1f}%)")
    for want in a.frame:
        print(f"  {hits[want]:7d}  {100 * hits[want] / max(kept, 1):5.1f}%  under `{want}`")
    for sym, n in leaves.most_common(a.top):
        print(f"  {n:7d}  {100 * n / max(kept, 1):5.1f}%  leaf {sym}")


if __name__ == "__main__":
    main()
