#!/usr/bin/env python3
"""PyTorch baseline for examples/gemm_bench.rs: the same shapes, `x @ W.T` then sigmoid.

    python3 crates/kernels/examples/torch_gemm.py [--threads T] [--min-time S]

Columns: (a) contiguous `x @ W.T`; (b) `torch.sigmoid(x @ W.T)` on contiguous x (no gather —
the favourable case for torch); (c) the gathered case done the eager way,
`torch.sigmoid(pool.index_select(0, idx) @ W.T)` (gather copy, GEMM, activation). Times are the
median per call, like gemm_bench. Prints torch's BLAS configuration first.
"""
import argparse
import time

import torch


def median_time(fn, min_time):
    fn()
    samples = []
    start = time.perf_counter()
    while len(samples) < 5 or (time.perf_counter() - start < min_time and len(samples) < 2000):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--shapes", default="", help="B,K,N;B,K,N...")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    else:
        shapes = [(b, k, n) for (k, n) in [(256, 768), (512, 1536), (256, 256), (768, 3072)]
                  for b in [1, 8, 64, 512, 2048]]
    cfg = [l.strip() for l in torch.__config__.show().splitlines() if "BLAS" in l or "MKL" in l or "CPU capability" in l]
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}; " + "; ".join(cfg))
    print(f"{'B':>5} {'K':>4} {'N':>5} | {'mm us':>11} {'GFLOP/s':>8} | {'mm+sig us':>11} {'GFLOP/s':>8} | {'gath+mm+sig us':>14} {'GFLOP/s':>8}")
    with torch.inference_mode():
        for (b, k, n) in shapes:
            w = torch.rand(n, k) - 0.5
            x = torch.rand(b, k) - 0.5
            pool = torch.rand(2 * b, k) - 0.5
            idx = torch.randperm(2 * b)[:b]
            flops = 2.0 * b * k * n
            ta = median_time(lambda: x @ w.T, args.min_time)
            tb = median_time(lambda: torch.sigmoid(x @ w.T), args.min_time)
            tc = median_time(lambda: torch.sigmoid(pool.index_select(0, idx) @ w.T), args.min_time)
            print(f"{b:>5} {k:>4} {n:>5} | {ta*1e6:>11.1f} {flops/ta*1e-9:>8.1f} | {tb*1e6:>11.1f} {flops/tb*1e-9:>8.1f} | {tc*1e6:>14.1f} {flops/tc*1e-9:>8.1f}")
        m, n, k = 2048, 1024, 1024
        a = torch.rand(m, k)
        w = torch.rand(n, k)
        best = float("inf")
        start = time.perf_counter()
        while time.perf_counter() - start < max(args.min_time, 1.0):
            t = time.perf_counter()
            a @ w.T
            best = min(best, time.perf_counter() - t)
        print(f"peak sgemm {m}x{n}x{k} contiguous: {2.0*m*n*k/best*1e-9:.1f} GFLOP/s (best of runs, {best*1e3:.2f} ms)")


if __name__ == "__main__":
    main()
