#!/usr/bin/env python3
"""tumble on a GPU against PyTorch eager and PyTorch by hand on the same GPU, in one process.

For each zoo model and mini-batch size: `tumble run --device cuda --repeat R --profile` (cold: the
process's first run, warm: the median of the later ones, each less decoding the instances, per
mini-batch), then the two PyTorch peers (bench/peers/, `TUMBLE_PEER_DEVICE=cuda`: weights and
every tensor on the GPU, results read back to Python lists inside the timed region) R times each,
first run cold and the median of the rest warm. tumble's outputs are compared with PyTorch by
hand's (1e-4), and `--device cuda` with `--device cpu` (1e-4).

    python3 bench/gpu_suite.py --tumble target/release/tumble --data DIR [--repeat 4] [--json OUT]

DIR holds the instance files bench/run makes (`sst_tree_128.first32.jsonl`, ...) and each model's
`one.MODEL.jsonl` (weights are generated here from it: `--random-params 0 --save-params`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TUMBLE_PEER_DEVICE", "cuda")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))

import common  # noqa: E402
from suite import PROFILE_HEAD, PROFILE_REPEATS_NO_DECODE  # noqa: E402

INPUTS = {
    "treelstm": "sst_tree_128", "mvrnn": "sst_tree_128", "birnn": "sst_tokens_128",
    "stackrnn": "sst_tokens_128", "nestedrnn": "nested_128", "drnn_small": "drnn256_128",
    "drnn_large": "drnn512_128",
}
DEVICE_LINE = re.compile(r"^device: (\d+) stages on the GPU, (\d+) on the host.*$", re.M)


def inputs_for(data, model, batch):
    kind = model.split("_")[0]
    stem = INPUTS.get(model) or INPUTS[kind]
    return os.path.join(data, f"{stem}.first{32 if batch <= 8 else 128}.jsonl")


def tumble(exe, model, params, inputs, batch, device, repeat, out, env=None, extra=()):
    cmd = [exe, "run", os.path.join(ROOT, "models", f"{model}.rly"), "--inputs", inputs, "--params",
           params, "--batch", str(batch), "--device", device, "--profile", "--repeat", str(repeat),
           "-o", out, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if p.returncode != 0:
        return {"ok": False, "error": p.stderr[-3000:]}
    rep = PROFILE_REPEATS_NO_DECODE.search(p.stderr)
    head = PROFILE_HEAD.search(p.stderr)
    k = int(head.group(1)) if head else 1
    runs = [float(x) / k for x in rep.group(1).split()] if rep else []
    dev = DEVICE_LINE.search(p.stderr)
    return {"ok": True, "cold": runs[0] if runs else None,
            "warm": float(rep.group(2)) / k if rep else None, "runs": runs,
            "stages": [int(dev.group(1)), int(dev.group(2))] if dev else None,
            "profile": p.stderr[-2500:]}


def peer(runner, model, params, inputs, batch, repeat, out):
    try:
        r = runner.run(model, params, inputs, batch, out, repeat)
    except Exception as e:  # a peer failing is a missing point, not the end of the suite
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    t = r["ms_per_batch"]
    return {"ok": True, "cold": t[0], "warm": statistics.median(t[1:]) if len(t) > 1 else t[0]}


def compare_files(a, b):
    with open(a) as fa, open(b) as fb:
        la, lb = fa.read().splitlines(), fb.read().splitlines()
    if len(la) != len(lb):
        return [f"{len(la)} vs {len(lb)} lines"]
    bad = []
    for i, (x, y) in enumerate(zip(la, lb)):
        d = common.compare(json.loads(x), json.loads(y))
        if d:
            bad.append(f"instance {i}: {d[0]}")
            if len(bad) > 3:
                break
    return bad


def bad(row, key):
    return len(row[key]) if key in row else "-"


def table(path):
    """A results file of this script as a markdown table, warm times and the ratios."""
    import math
    rows = json.load(open(path))

    def w(r, k):
        x = r.get(k) or {}
        return x.get("warm") if x.get("ok") else None
    print("| model | batch | tumble GPU | PyTorch by hand GPU | PyTorch eager GPU | tumble CPU | by hand / tumble GPU"
          " | eager / tumble GPU | outputs |")
    print("|---|---|---|---|---|---|---|---|---|")
    hand, eager = [], []
    for r in rows:
        t, h, e, c = w(r, "tumble"), w(r, "by_hand"), w(r, "eager"), w(r, "tumble_cpu")
        fmt = lambda x: f"{x:.2f}" if x is not None else "n/a"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}×" if a and b else "n/a"  # noqa: E731
        if t and h:
            hand.append(h / t)
        if t and e:
            eager.append(e / t)
        agree = f"= CPU: {bad(r, 'vs_cpu')} bad; by hand: {bad(r, 'vs_by_hand')} bad"
        print(f"| {r['model']} | {r['batch']} | {fmt(t)} | {fmt(h)} | {fmt(e)} | {fmt(c)} | {ratio(h, t)} |"
              f" {ratio(e, t)} | {agree} |")
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")  # noqa: E731
    print(f"\ngeometric mean: by hand / tumble GPU {gm(hand):.2f}×, eager / tumble GPU {gm(eager):.2f}×; tumble GPU "
          f"fastest of the three GPU engines on {sum(1 for r in rows if w(r, 'tumble') and w(r, 'by_hand') and w(r, 'eager') and w(r, 'tumble') < min(w(r, 'by_hand'), w(r, 'eager')))} of {len(rows)} points")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        return table(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tumble", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--models", default="treelstm_small,treelstm_large,mvrnn_small,mvrnn_large,birnn_small,"
                    "birnn_large,nestedrnn_small,nestedrnn_large,stackrnn_small,stackrnn_large,drnn_small,drnn_large")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--work", default="/tmp/gpu_suite")
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="tumble's device (cpu: a dry run of this script)")
    ap.add_argument("--ab", metavar="VAR=VALUE",
                    help="also time tumble on the GPU with this environment variable set, or with this "
                         "option (--workers=1) (an A/B column)")
    ap.add_argument("--skip-cpu", action="store_true", help="no --device cpu comparison")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    import torch  # noqa: E402
    import torch_batched  # noqa: E402
    import torch_eager  # noqa: E402

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"GPU: {gpu}; peers on {common.DEVICE}; torch {torch.__version__}", flush=True)
    eager, by_hand = common.Runner(torch_eager.build), common.Runner(torch_batched.build)
    rows = []
    for model in args.models.split(","):
        params = os.path.join(args.work, f"{model}.safetensors")
        one = os.path.join(args.data, f"one.{model}.jsonl")
        subprocess.run([args.tumble, "run", os.path.join(ROOT, "models", f"{model}.rly"), "--inputs", one,
                        "--random-params", "0", "--save-params", params, "-o", os.devnull], check=True,
                       capture_output=True)
        for batch in [int(b) for b in args.batches.split(",")]:
            inputs = inputs_for(args.data, model, batch)
            o = {e: os.path.join(args.work, f"{model}.b{batch}.{e}.jsonl") for e in ("gpu", "cpu", "eager", "hand")}
            t0 = time.time()
            row = {"model": model, "batch": batch,
                   "tumble": tumble(args.tumble, model, params, inputs, batch, args.device, args.repeat,
                                    o["gpu"]),
                   "eager": peer(eager, model, params, inputs, batch, args.repeat, o["eager"]),
                   "by_hand": peer(by_hand, model, params, inputs, batch, args.repeat, o["hand"])}
            if row["tumble"]["ok"] and row["by_hand"]["ok"]:
                row["vs_by_hand"] = compare_files(o["gpu"], o["hand"])
            if args.ab:
                # --flag=value: a command-line option; VAR=VALUE: an environment variable
                env, extra = ({}, args.ab.split("=", 1)) if args.ab.startswith("--") else \
                    (dict([args.ab.split("=", 1)]), [])
                row["tumble_ab"] = tumble(args.tumble, model, params, inputs, batch, args.device, args.repeat,
                                          os.devnull, env, extra)
            if not args.skip_cpu and row["tumble"]["ok"]:
                # tumble on this machine's processors (every core), for reference
                cpu = tumble(args.tumble, model, params, inputs, batch, "cpu", args.repeat, o["cpu"])
                row["tumble_cpu"] = cpu
                row["vs_cpu"] = compare_files(o["gpu"], o["cpu"]) if cpu["ok"] else [cpu["error"][-300:]]
            rows.append(row)
            t, e, h = row["tumble"], row["eager"], row["by_hand"]

            def f(x, k):
                return f"{x[k]:9.2f}" if x.get("ok") and x.get(k) is not None else "      n/a"
            print(f"{model:16s} b{batch:<3d} tumble cold {f(t, 'cold')} warm {f(t, 'warm')} | eager cold "
                  f"{f(e, 'cold')} warm {f(e, 'warm')} | by hand cold {f(h, 'cold')} warm {f(h, 'warm')} ms/batch"
                  f" | stages gpu/host {t.get('stages')} | mismatches vs by hand {bad(row, 'vs_by_hand')}, vs cpu "
                  f"{bad(row, 'vs_cpu')} ({time.time() - t0:.0f} s)", flush=True)
            for k, what in (("tumble_ab", f"tumble with {args.ab}"), ("tumble_cpu", "tumble on the CPU")):
                if k in row:
                    print(f"    {what}: cold {f(row[k], 'cold')} warm {f(row[k], 'warm')} ms/batch", flush=True)
            for k in ("vs_by_hand", "vs_cpu"):
                if row.get(k):
                    print(f"    {k}: {row[k][:3]}", flush=True)
            for k in ("tumble", "eager", "by_hand"):
                if not row[k].get("ok"):
                    print(f"    {k} failed: {row[k].get('error', '')[-1500:]}", flush=True)
            # After every point: a run stopped at its time limit keeps what it measured.
            if args.json:
                with open(args.json, "w") as fo:
                    json.dump(rows, fo, indent=1)


if __name__ == "__main__":
    main()
