#!/usr/bin/env python3
"""tumble-kernels' GEMM against PyTorch (MKL) on the zoo's batched dense shapes, side by side.

    bench/.venv/bin/python bench/gemm_vs_torch.py [--threads T] [--rounds R] [--min-time S]
        [--kn 'K,N;K,N'] [--batches 'B,B']

Runs `gemm_bench` (ours) and `torch_gemm.py` (torch, same shapes, same thread count) alternately
for R rounds — the machine's speed drifts, so the two are interleaved — keeps each cell's best
time, and prints the ratio torch time / tumble time (> 1: tumble faster) for
  (a) contiguous `x @ W.T` against our contiguous A;
  (b) torch `sigmoid(x @ W.T)` on contiguous x against our gathered rows + fused sigmoid epilogue;
  (c) torch `sigmoid(index_select(pool, idx) @ W.T)` (the eager gather) against the same of ours.
The kernels issue's targets: >= 0.9x at B >= 64 and >= 0.7x at B = 8, gather and epilogue included
on our side (columns b and c). Needs torch in the running Python (bench/run sets up bench/.venv).
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(b, k, n) for (k, n) in [(256, 768), (512, 1536), (256, 256), (768, 3072)]
          for b in [1, 8, 64, 512, 2048]]


def run(cmd):
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    rows, peak = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+)\s+(\d+)\s+\|(.*)", line)
        if m:
            nums = [float(x) for x in re.findall(r"[\d.]+", m.group(4))]
            # us, GFLOP/s pairs: keep the times.
            rows[tuple(int(m.group(i)) for i in (1, 2, 3))] = nums[0::2]
        p = re.match(r"peak sgemm .*: ([\d.]+) GFLOP/s", line)
        if p:
            peak = float(p.group(1))
    return rows, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.2)
    ap.add_argument("--kn", help="weight shapes `K,N;K,N...` instead of the zoo's (e.g. an RNN step's)")
    ap.add_argument("--batches", help="row counts `B,B...` instead of 1, 8, 64, 512, 2048")
    args = ap.parse_args()
    global SHAPES
    if args.kn or args.batches:
        kns = [tuple(int(v) for v in kn.split(",")) for kn in args.kn.split(";")] if args.kn else \
            sorted({s[1:] for s in SHAPES}, key=lambda kn: [s[1:] for s in SHAPES].index(kn))
        bs = [int(b) for b in args.batches.split(",")] if args.batches else sorted({s[0] for s in SHAPES})
        SHAPES = [(b, k, n) for (k, n) in kns for b in bs]
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "tumble-kernels", "--example",
                    "gemm_bench"], cwd=ROOT, check=True)
    shapes = ";".join(f"{b},{k},{n}" for (b, k, n) in SHAPES)
    common = ["--threads", str(args.threads), "--min-time", str(args.min_time), "--shapes", shapes]
    ours_cmd = [os.path.join(ROOT, "target/release/examples/gemm_bench"), "--stat", "min"] + common
    torch_cmd = [sys.executable, os.path.join(ROOT, "crates/kernels/examples/torch_gemm.py")] + common
    best_ours, best_torch = {}, {}
    peaks = {"tumble": 0.0, "torch": 0.0}
    for r in range(args.rounds):
        for name, cmd, best in (("tumble", ours_cmd, best_ours), ("torch", torch_cmd, best_torch)):
            rows, peak = run(cmd)
            peaks[name] = max(peaks[name], peak or 0.0)
            for key, times in rows.items():
                old = best.get(key)
                best[key] = times if old is None else [min(a, b) for a, b in zip(old, times)]
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    print(f"# threads {args.threads}, best of {args.rounds} interleaved rounds; "
          f"sgemm peak: tumble {peaks['tumble']:.1f}, torch {peaks['torch']:.1f} GFLOP/s")
    print("# ratio = torch time / tumble time (> 1: tumble faster); "
          "a = contiguous mm, b = +sigmoid (ours gathered), c = gather+mm+sigmoid both")
    kns = sorted({(k, n) for (_, k, n) in SHAPES}, key=lambda kn: SHAPES.index(
        next(s for s in SHAPES if s[1:] == kn)))
    print("| B | " + " | ".join(f"{k}×{n} a / b / c" for (k, n) in kns) + " |")
    print("|---|" + "---|" * len(kns))
    for b in sorted({s[0] for s in SHAPES}):
        cells = []
        for (k, n) in kns:
            ours, theirs = best_ours.get((b, k, n)), best_torch.get((b, k, n))
            if not ours or not theirs:
                cells.append("n/a")
                continue
            # ours: [contiguous, gathered+sigmoid]; torch: [mm, mm+sigmoid, gather+mm+sigmoid]
            a = theirs[0] / ours[0]
            bb = theirs[1] / ours[1]
            c = theirs[2] / ours[1]
            cells.append(f"{a:.2f} / {bb:.2f} / {c:.2f}")
        print(f"| {b} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
