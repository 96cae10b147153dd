"""Overhead of the Python path over the CLI on one job (bench/RESULTS.md, "Python package").

    python bench/python_overhead.py TREES.jsonl [--runs 5] [--tumble target/release/tumble]

For each of --runs rounds, alternating so that machine noise hits both alike:
- CLI cold: `tumble run MODEL --inputs TREES --random-params 0 --batch 64 --threads 1 --profile`
  in a fresh process, its profile's `total`;
- Python cold: a fresh interpreter loads the model and calls run() once: the call's wall time
  (conversion in + run + conversion out) and the run's own profile total;
- CLI warm: `--repeat 6`, the warm median it prints; Python warm: runs 2-6 in one process.
Prints medians (ms).
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

root = Path(__file__).resolve().parents[1]
p = argparse.ArgumentParser()
p.add_argument("trees")
p.add_argument("--runs", type=int, default=5)
p.add_argument("--tumble", default=str(root / "target/release/tumble"))
p.add_argument("--model", default=str(root / "models/treelstm_small.rly"))
p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
p.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
args = p.parse_args()

TOTAL = re.compile(r"time \(ms\): total ([0-9.]+)")


def python_runs(repeat):
    import tumble

    trees = [json.loads(l) for l in Path(args.trees).read_text().splitlines() if l.strip()]
    model = tumble.load(args.model, random_params=0)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        model.run(trees, batch=64, threads=1, profile=True)
        wall = (time.perf_counter() - t0) * 1e3
        out.append((wall, float(TOTAL.search(model.last_profile).group(1))))
    return out


if args.child:
    print(json.dumps(python_runs(args.repeat)))
    sys.exit(0)

cli = [args.tumble, "run", args.model, "--inputs", args.trees, "--random-params", "0",
       "--batch", "64", "--threads", "1", "--profile"]
res = {k: [] for k in ("cli_cold", "py_cold_wall", "py_cold_total", "cli_warm", "py_warm_wall", "py_warm_total")}
for _ in range(args.runs):
    err = subprocess.run(cli, capture_output=True, text=True, check=True).stderr
    res["cli_cold"].append(float(TOTAL.search(err).group(1)))
    child = [sys.executable, __file__, args.trees, "--model", args.model, "--child"]
    [(w, t)] = json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout)
    res["py_cold_wall"].append(w)
    res["py_cold_total"].append(t)
    err = subprocess.run(cli + ["--repeat", "6"], capture_output=True, text=True, check=True).stderr
    res["cli_warm"].append(float(re.search(r"repeats \(ms per run\): .*?; warm median ([0-9.]+)", err).group(1)))
    warm = json.loads(subprocess.run(child + ["--repeat", "6"], capture_output=True, text=True, check=True).stdout)[1:]
    res["py_warm_wall"].append(statistics.median(w for w, _ in warm))
    res["py_warm_total"].append(statistics.median(t for _, t in warm))
med = {k: statistics.median(v) for k, v in res.items()}
for k, v in res.items():
    print(f"{k:14s} median {med[k]:8.2f} ms   runs: {' '.join(f'{x:.1f}' for x in v)}")
for kind in ("cold", "warm"):
    cli_t = med[f"cli_{kind}"]
    print(f"{kind}: python wall / CLI total = {med[f'py_{kind}_wall'] / cli_t:.3f}; "
          f"python wall / its own run total = {med[f'py_{kind}_wall'] / med[f'py_{kind}_total']:.3f}")
