"""Per tensor, the largest difference between two safetensors files of the same names and shapes
(e.g. `tumble grad` outputs with and without a switch), relative to the tensor's largest entry.

    bench/.venv/bin/python bench/compare_params.py A.safetensors B.safetensors [--tol 1e-4]

Exits 1 when a tensor differs by more than --tol (relative) or the files hold different tensors.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from common import load_safetensors  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest relative difference accepted")
    args = ap.parse_args()
    a, b = load_safetensors(args.a), load_safetensors(args.b)
    if sorted(a) != sorted(b):
        print(f"different tensors: {sorted(set(a) ^ set(b))}")
        sys.exit(1)
    worst = 0.0
    for name in sorted(a):
        x, y = a[name].astype(np.float64), b[name].astype(np.float64)
        if x.shape != y.shape:
            print(f"{name}: shapes {x.shape} and {y.shape}")
            sys.exit(1)
        diff = float(np.abs(x - y).max()) if x.size else 0.0
        scale = float(np.abs(y).max()) if y.size else 0.0
        rel = diff / scale if scale > 0 else diff
        worst = max(worst, rel)
        print(f"{name:24s} {str(x.shape):16s} max diff {diff:.3g}  largest entry {scale:.3g}  relative {rel:.3g}")
    print(f"largest relative difference {worst:.3g}")
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
