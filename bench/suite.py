#!/usr/bin/env python3
"""tumble's benchmark suite: the seven ACROBAT models (small, large) x batch (8, 64) x engine
(tumble, tumble --scheduler eager, PyTorch eager, PyTorch by hand, DyNet autobatch), interleaved.

Run it through `bench/run` (which sets up bench/.venv and builds tumble); `bench/run --help` lists
the options. What it does, in order:

1. data: instance files under bench/.data/ made by `tumble data` (see DATA below);
2. weights: `tumble run MODEL --inputs <empty> --random-params 0 --save-params W` once per model
   file; every engine reads W (tumble with `--params W`);
3. peak: the machine's sgemm peak at the peers' thread count: the faster of torch `x @ W.T` on square
   matrices and tumble's own kernel (`gemm_bench`, 2048×1024×1024);
4. measurement rounds: for round r = 1..R, for every point (model, size, batch), every engine runs
   the point's K mini-batches once (the engine order rotates every round). Round 1 also writes
   every engine's outputs, and each peer's outputs are compared with tumble's (1e-4 relative +
   1e-4 absolute on floats, exact on ints and structure); a mismatching point is reported loudly
   and marked invalid (its time is not used). Where tumble is skipped, peers are checked against
   PyTorch eager.
5. results: bench/results/<date>-<machine>.json (every sample, the medians, the checks, tumble's
   profile), <date>-<machine>.md (the table) and <date>-<machine>.png (the plots).

Timing (ms per mini-batch, median over rounds):
- tumble: one `tumble run ... --batch N --repeat R --profile` process over the point's K
  mini-batches; its `repeats without decoding inputs` line (each run's wall time less the time
  spent decoding the instances from parsed JSON into tumble values), divided by K. That covers
  the host program, graph building, scheduling, gathers, kernels and encoding the results to JSON
  text; model parsing/type checking, weight loading, reading the JSON file and decoding the
  instances are outside it, as for the peers (and, from 2026-11-25's ninth session, freeing the
  decoded instances after the run, which the peers never do inside their timed loops: it is
  counted with the decoding). (Until 2026-11-24's second session the decoding was
  inside: the `total` line, which includes it, is kept in the JSON as `ms_with_decode`.) The
  process wall time is recorded too.
- peers: wall-clock time of the K mini-batches inside a long-lived peer process (weights loaded
  and inputs decoded beforehand), divided by K; host readout of the results is inside.
Roofline: useful dense FLOPs of the point's mini-batches (matmuls / GEMVs only, 2 FLOPs per
multiply-add, counted from the equations and each instance's structure; see `flops_*`) divided by
K and by the measured sgemm peak: the time a perfect GEMM would need for that mini-batch.

DATA: TreeLSTM and MV-RNN: SST test trees in file order (`tumble data sst --split test --format
tree`); BiRNN and StackRNN: the same sentences as token lists (`--format tokens`); NestedRNN:
`tumble data nested --seed 0` (1-8 inner sequences of 20-40 ids uniform in [2, 21703)); DRNN:
`tumble data drnn --seed 0 --hidden H` (latent N(0,1), max_depth 3-5, max_width 2-3); Berxit:
`tumble data berxit --seed 0` ([CLS] + 127 uniform ids, sequence length 128) with each instance's
threshold then redrawn uniformly from BERXIT_THRESHOLDS (seeded): with random weights the [CLS]
confidence hardly depends on the tokens, so a fixed threshold would make every instance exit at
the same layer; varied thresholds give varied exit layers (the histogram is in the results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
import common  # noqa: E402

MODELS = ["treelstm", "mvrnn", "birnn", "stackrnn", "nestedrnn", "drnn", "berxit"]
SIZES = ["small", "large"]
BATCHES = [8, 64]
ENGINES = ["tumble", "tumble_plain", "tumble_eager", "torch_eager", "torch_batched", "dynet"]
PEERS = {"torch_eager": "torch_eager.py", "torch_batched": "torch_batched.py", "dynet": "dynet_auto.py"}
LABEL = {
    "tumble": "tumble",
    "tumble_plain": "tumble, plain model",
    "tumble_eager": "tumble --scheduler eager",
    "torch_eager": "PyTorch eager",
    "torch_batched": "PyTorch by hand",
    "dynet": "DyNet autobatch",
}
BERXIT_THRESHOLDS = [0.6, 0.7, 0.8, 0.9]
RTOL = ATOL = 1e-4


def log(msg=""):
    print(msg, flush=True)


def sh(cmd, **kw):
    return subprocess.run(cmd, cwd=ROOT, check=True, **kw)


# ---------------------------------------------------------------------------------------------
# FLOPs (dense only, 2 per multiply-add)


def hidden(model, weights_shapes):
    return weights_shapes


def flops_instance(kind, dims, inst, out):
    """Useful dense FLOPs of one instance. `inst` is the decoded instance, `out` its output
    (StackRNN, DRNN and Berxit take the control-flow decisions from it)."""
    if kind == "treelstm":
        H = dims["H"]

        def f(n):
            if not n.children:
                return 2 * 3 * H * H
            k = len(n.children)
            return sum(f(c) for c in n.children) + k * 2 * H * H + 2 * 3 * H * H

        return f(inst) + 2 * 5 * H
    if kind == "mvrnn":
        H = dims["H"]

        def f(n):
            if not n.children:
                return 0
            k = len(n.children)
            # per composition: B a, A b (2 x 2H^2), W [..] (4H^2), W_M [A; B] (4H^3)
            return sum(f(c) for c in n.children) + (k - 1) * (8 * H * H + 4 * H * H * H)

        return f(inst) + 2 * 5 * H
    if kind == "birnn":
        H = dims["H"]
        n = len(inst)
        return 2 * n * (4 * H * H) + n * 2 * 5 * 2 * H
    if kind == "nestedrnn":
        H = dims["H"]
        toks = sum(len(s) for s in inst)
        return toks * 4 * H * H + len(inst) * 12 * H * H
    if kind == "stackrnn":
        H = dims["H"]
        n = len(inst)
        actions = out[1]
        # decisions: steps where both actions are legal
        stack, pos, dec = 0, 0, 0
        for a in actions:
            if pos < n and stack >= 2:
                dec += 1
            if a == 0:
                stack, pos = stack + 1, pos + 1
            else:
                stack -= 1
        return len(actions) * 6 * H * H + actions.count(1) * 4 * H * H + dec * 4 * H + 10 * H
    if kind == "drnn":
        H = dims["H"]

        def count(t):
            return 1 + sum(count(c) for c in t["Rose"][1])

        nodes = count(out)
        return nodes * (4 * H * H + 4 * H + 2 * 64 * H) + (nodes - 1) * 4 * H * H
    if kind == "berxit":
        D, Fd, S = dims["D"], dims["F"], 128
        per_layer = 8 * S * D * D + 4 * S * D * Fd + 4 * S * S * D + 2 * D * D + 4 * D
        return out[1] * per_layer
    raise ValueError(kind)


def model_dims(kind, shapes):
    if kind == "berxit":
        return {"D": shapes["pos_emb"][1], "F": shapes["l1_W1"][0]}
    key = {"treelstm": "U_f", "mvrnn": "W", "birnn": "W_h_fwd", "stackrnn": "U_t", "nestedrnn": "W_h",
           "drnn": "U_a"}[kind]
    return {"H": shapes[key][0]}


def safetensors_shapes(path):
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def measure_peak(threads):
    """sgemm peak (GFLOP/s): the best of a few `x @ W.T` on square-ish float32 matrices."""
    try:
        import torch

        torch.set_num_threads(threads)
        best = 0.0
        for n in (1024, 2048):
            x, w = torch.randn(n, n), torch.randn(n, n)
            (x @ w.T).sum()
            for _ in range(3):
                t = time.perf_counter()
                reps = 3
                for _ in range(reps):
                    x @ w.T
                dt = (time.perf_counter() - t) / reps
                best = max(best, 2 * n**3 / dt / 1e9)
        return best, f"torch {torch.__version__} x @ W.T, n in (1024, 2048), {threads} thread(s)"
    except ImportError:
        import numpy as np

        n = 2048
        x, w = np.random.rand(n, n).astype("f4"), np.random.rand(n, n).astype("f4")
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            x @ w.T
            best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
        return best, "numpy x @ W.T, n = 2048 (torch missing), all threads"


def measure_tumble_peak(threads):
    """tumble's own sgemm peak (GFLOP/s): `gemm_bench`'s 2048×1024×1024 product (bench/run builds
    it); 0 when the example is missing or fails."""
    exe = os.path.join(ROOT, "target", "release", "examples", "gemm_bench")
    try:
        out = subprocess.run([exe, "--threads", str(threads), "--shapes", "1,16,16", "--min-time", "0.05"],
                             capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return 0.0, "tumble gemm_bench missing"
    m = re.search(r"peak sgemm (\S+) contiguous: ([0-9.]+) GFLOP/s", out)
    if not m:
        return 0.0, "tumble gemm_bench printed no peak"
    return float(m.group(2)), f"tumble gemm_bench {m.group(1)}, {threads} thread(s)"


# ---------------------------------------------------------------------------------------------
# engines


class Peer:
    def __init__(self, name, threads):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "peers", PEERS[name]), "--serve", "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(os.path.join(DATA, f"{name}.stderr"), "w"),
            text=True, cwd=ROOT)
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"{name}: peer did not start (see bench/.data/{name}.stderr)")

    def run(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: peer died (see bench/.data/{self.name}.stderr)")
        return json.loads(line)

    def close(self):
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


# One worker: "time (ms): total T = parts"; several: "time (ms): total T (wall) on W workers x K kernel
# threads; mini-batches summed S = parts" (T is the wall time either way).
PROFILE_TOTAL = re.compile(r"^time \(ms\): total ([0-9.]+) (?:\(wall\) .*?; mini-batches summed [0-9.]+ )?= (.*)$",
                           re.M)
# With `--repeat N`: every run's time; the first is the cold process, the rest are warm.
PROFILE_REPEATS = re.compile(r"^repeats \(ms per run\): ([0-9. ]+); warm median ([0-9.]+)$", re.M)
# The same runs less decoding the instances (the peers decode theirs before the timer starts).
PROFILE_REPEATS_NO_DECODE = re.compile(
    r"^repeats without decoding inputs \(ms per run\): ([0-9. ]+); warm median ([0-9.]+)$", re.M)
PROFILE_HEAD = re.compile(r"mini-batches (\d+)\s+DFG nodes (\d+).*?batched launches (\d+)")


TUMBLE_THREADS = 1


def run_tumble(exe, model, params, inputs, batch, scheduler, out, repeat=1, plain=False):
    # plain: the model as written without Primitive=1 marks (models/plain/), same weights
    path = f"models/plain/{model}.rly" if plain else f"models/{model}.rly"
    cmd = [exe, "run", path, "--inputs", inputs, "--params", params, "--batch", str(batch),
           "--scheduler", scheduler, "--profile", "--repeat", str(repeat), "-o", out or os.devnull]
    t = time.perf_counter()
    # tumble's kernels use TUMBLE_NUM_THREADS threads (default: every core); match the peers
    env = dict(os.environ, TUMBLE_NUM_THREADS=str(TUMBLE_THREADS))
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = (time.perf_counter() - t) * 1e3
    if p.returncode != 0:
        return {"ok": False, "error": p.stderr[-2000:]}
    m = PROFILE_TOTAL.search(p.stderr)
    h = PROFILE_HEAD.search(p.stderr)
    with_decode = PROFILE_REPEATS.search(p.stderr)
    rep = PROFILE_REPEATS_NO_DECODE.search(p.stderr) or with_decode
    k = int(h.group(1)) if h else 1
    parts = {}
    if m:
        for part in m.group(2).split(" + "):
            name, val = part.split()
            parts[name] = float(val) / max(1, k)
    return {
        "ok": True,
        # cold: the process's first run of the job; warm: the median of its later runs (the profile
        # printed is the last run's)
        # (one run: the total less decoding, read from the breakdown)
        "ms": (float(rep.group(1).split()[0]) if rep
               else float(m.group(1)) - parts.get("decode", 0.0) * max(1, k) if m else wall) / max(1, k),
        "warm_ms": float(rep.group(2)) / max(1, k) if rep else None,
        "ms_with_decode": (float(with_decode.group(1).split()[0]) / max(1, k)) if with_decode else None,
        "wall_ms": wall,
        "batches": k,
        "parts": parts,
        "nodes": int(h.group(2)) if h else None,
        "launches": int(h.group(3)) if h else None,
        "profile": p.stderr[-4000:],
    }


# ---------------------------------------------------------------------------------------------
# data


def make_data(exe, n_tree, n_nested, n_drnn, n_berxit):
    os.makedirs(DATA, exist_ok=True)
    T = lambda *a: sh([exe, "data", *a], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: E731
    files = {}

    def mk(name, args):
        path = os.path.join(DATA, name)
        if not os.path.exists(path):
            T(*args, "-o", path)
        return path

    files["tree"] = mk(f"sst_tree_{n_tree}.jsonl", ["sst", "--split", "test", "--format", "tree", "--limit", str(n_tree)])
    files["tokens"] = mk(f"sst_tokens_{n_tree}.jsonl", ["sst", "--split", "test", "--format", "tokens", "--limit", str(n_tree)])
    files["nested"] = mk(f"nested_{n_nested}.jsonl", ["nested", "--count", str(n_nested), "--seed", "0"])
    for h, size in ((256, "small"), (512, "large")):
        files[f"drnn_{size}"] = mk(f"drnn{h}_{n_drnn}.jsonl", ["drnn", "--count", str(n_drnn), "--seed", "0", "--hidden", str(h)])
    path = os.path.join(DATA, f"berxit_{n_berxit}.jsonl")
    if not os.path.exists(path):
        raw = path + ".raw"
        T("berxit", "--count", str(n_berxit), "--seed", "0", "--threshold", "0.9", "-o", raw)
        rng = random.Random(0)
        with open(raw) as f, open(path, "w") as g:
            for line in f:
                if line.strip():
                    inst = json.loads(line)
                    inst["threshold"] = rng.choice(BERXIT_THRESHOLDS)
                    g.write(json.dumps(inst) + "\n")
        os.remove(raw)
    files["berxit"] = path
    return files


def input_file(kind, size, files):
    return {
        "treelstm": files["tree"], "mvrnn": files["tree"], "birnn": files["tokens"], "stackrnn": files["tokens"],
        "nestedrnn": files["nested"], "drnn": files[f"drnn_{size}"], "berxit": files["berxit"],
    }[kind]


def subset(path, n):
    """The first n instances of path, as its own file (cached)."""
    out = f"{path[:-6]}.first{n}.jsonl"
    if not os.path.exists(out):
        with open(path) as f:
            lines = [l for l in f if l.strip()]
        if len(lines) < n:
            raise RuntimeError(f"{path}: {len(lines)} instances, {n} needed")
        with open(out, "w") as g:
            g.writelines(lines[:n])
    return out


# ---------------------------------------------------------------------------------------------
# main


def median(xs):
    return statistics.median(xs) if xs else None


def fmt_ms(x):
    if x is None:
        return "—"
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def main():
    global DATA, TUMBLE_THREADS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="~2-minute subset: small models, batch 8, 2 rounds, 2 mini-batches, no tumble on Berxit")
    ap.add_argument("--models", nargs="*", default=MODELS, choices=MODELS)
    ap.add_argument("--sizes", nargs="*", default=SIZES, choices=SIZES)
    ap.add_argument("--batches", nargs="*", type=int, default=BATCHES)
    ap.add_argument("--engines", nargs="*", default=ENGINES, choices=ENGINES)
    ap.add_argument("--rounds", type=int, default=5, help="repeats per point (Berxit: --berxit-rounds)")
    ap.add_argument("--minibatches", type=int, default=4, help="K mini-batches per point at batch 8 (64: half, at least 1)")
    ap.add_argument("--berxit-rounds", type=int, default=1)
    ap.add_argument("--berxit-tumble", choices=["none", "small8", "all"], default="all",
                    help="which Berxit points tumble runs (default all: 5-45 s per mini-batch; "
                         "small8: berxit_small at batch 8 only)")
    ap.add_argument("--berxit-peers", choices=["tumble", "all"], default="tumble",
                    help="which Berxit points the peers run (default tumble: those --berxit-tumble has tumble run, "
                         "since a peer's time alone makes no ratio -- the peers' Berxit-small b64 and Berxit-large "
                         "points take ~7 minutes a round; all: every one)")
    ap.add_argument("--threads", type=int, default=1, help="threads for the peers and for tumble's kernels "
                    "(TUMBLE_NUM_THREADS); the sgemm peak is measured at this count")
    ap.add_argument("--tumble", default=os.path.join(ROOT, "target", "release", "tumble"))
    ap.add_argument("--tumble-repeat", type=int, default=3,
                    help="tumble (inline) runs each point this many times in one process (`--repeat`): the "
                         "first run is the cold figure, the median of the others the warm one (peers are warm "
                         "long-lived processes); 1: cold only")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds to wait before each engine's run of a point (lets whatever the previous "
                         "run left behind -- freed memory, a peer's background work -- settle)")
    ap.add_argument("--tag", help="results file stem (default <date>-<machine>)")
    ap.add_argument("--table", metavar="JSON",
                    help="run nothing: print the report (tables and issue 17's targets per point) of an "
                         "earlier run's results JSON")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            res = json.load(f)
        print(make_table(res["points"], res["meta"]["engines"], res["meta"]), end="")
        return 0
    if args.quick:
        args.sizes, args.batches, args.rounds, args.minibatches = ["small"], [8], 2, 2
        args.berxit_tumble = "none"
    DATA = os.path.join(HERE, ".data")
    os.makedirs(DATA, exist_ok=True)
    TUMBLE_THREADS = args.threads
    resdir = os.path.join(HERE, "results")
    os.makedirs(resdir, exist_ok=True)
    t_start = time.time()
    # A private copy of the binary: a concurrent `cargo build` in this tree cannot swap it mid-run.
    exe = os.path.join(DATA, "tumble.bin")
    shutil.copy2(args.tumble, exe)

    # ---- peers available?
    peers = {}
    notes = []
    for eng in args.engines:
        if eng in PEERS:
            try:
                peers[eng] = Peer(eng, args.threads)
            except Exception as e:
                notes.append(f"{LABEL[eng]} unavailable: {e}")
                log(f"!! {LABEL[eng]} unavailable, continuing without it: {e}")
    engines = [e for e in args.engines if e in peers or e.startswith("tumble")]

    # ---- points and data
    kmax = max(args.minibatches * 8 // b if b < 64 else max(1, args.minibatches // 2) for b in args.batches)
    need = max(b * (args.minibatches if b < 64 else max(1, args.minibatches // 2)) for b in args.batches)
    n_berxit = max(args.batches)  # one mini-batch per Berxit point
    files = make_data(exe, max(need, 8), max(need, 8), max(need, 8), n_berxit)
    del kmax
    points = []
    for kind in args.models:
        for size in args.sizes:
            for b in args.batches:
                k = 1 if kind == "berxit" else (args.minibatches if b < 64 else max(1, args.minibatches // 2))
                points.append({"model": f"{kind}_{size}", "kind": kind, "size": size, "batch": b, "k": k})

    # ---- weights
    wdir = os.path.join(DATA, "weights")
    os.makedirs(wdir, exist_ok=True)
    params = {}
    for model in sorted({p["model"] for p in points}):
        path = os.path.join(wdir, f"{model}.seed0.safetensors")
        if not os.path.exists(path):
            # tumble needs one instance to tell inputs from parameters; a Berxit instance with
            # threshold 0 exits after layer 1 (cheap), and every layer's weights are generated anyway
            kind, size = model.split("_")
            with open(input_file(kind, size, files)) as f:
                first = json.loads(f.readline())
            if kind == "berxit":
                first["threshold"] = 0.0
            one = os.path.join(DATA, f"one.{model}.jsonl")
            with open(one, "w") as f:
                f.write(json.dumps(first) + "\n")
            log(f"weights: {model} (tumble run --random-params 0 --save-params)")
            sh([exe, "run", f"models/{model}.rly", "--inputs", one, "--random-params", "0", "--save-params", path,
                "-o", os.devnull], stderr=subprocess.DEVNULL)
            extra = set(first) & set(safetensors_shapes(path))
            if extra:
                raise RuntimeError(f"{path} holds instance inputs {sorted(extra)}")
        params[model] = path

    peak, peak_how = measure_peak(args.threads)
    peak_all, _ = measure_peak(os.cpu_count() or 1)
    # The roofline is the machine's peak, not one peer's: where tumble's own kernel is faster than
    # torch's sgemm (an AVX-512 AMD EPYC: MKL takes its AVX2 path there), its figure is the peak.
    own, own_how = measure_tumble_peak(args.threads)
    if own > peak:
        peak, peak_how = own, f"{own_how}; {peak_how}: {peak:.1f}"
    all_cpus = os.cpu_count() or 1
    peak_all = max(peak_all, own if all_cpus == args.threads else measure_tumble_peak(all_cpus)[0])
    log(f"sgemm peak: {peak:.1f} GFLOP/s at {args.threads} thread(s) ({peak_all:.1f} with {os.cpu_count()})")

    for p in points:
        p["inputs"] = subset(input_file(p["kind"], p["size"], files), p["batch"] * p["k"])
        p["samples"] = {e: [] for e in engines}
        p["check"] = {}
        p["skip"] = {}
        if p["kind"] == "berxit":
            allow = args.berxit_tumble == "all" or (args.berxit_tumble == "small8" and p["size"] == "small"
                                                     and p["batch"] == 8)
            if not allow:
                for e in ("tumble", "tumble_plain", "tumble_eager"):
                    p["skip"][e] = f"--berxit-tumble {args.berxit_tumble}" + (" (--quick)" if args.quick else "")
                if args.berxit_peers == "tumble":
                    for e in engines:
                        p["skip"].setdefault(e, f"--berxit-peers tumble (tumble does not run it: "
                                                f"--berxit-tumble {args.berxit_tumble})")

    work = []
    for r in range(max(args.rounds, args.berxit_rounds)):
        for i, p in enumerate(points):
            rounds = args.berxit_rounds if p["kind"] == "berxit" else args.rounds
            if r >= rounds:
                continue
            rot = engines[r % len(engines):] + engines[: r % len(engines)]
            for e in rot:
                if e not in p["skip"]:
                    work.append((r, i, e))
    log(f"{len(points)} points x {len(engines)} engines, {len(work)} runs; engines: {', '.join(engines)}")

    outs = {}
    t0 = time.time()
    for n, (r, i, e) in enumerate(work, 1):
        p = points[i]
        first = r == 0
        if args.settle > 0:
            time.sleep(args.settle)
        out = os.path.join(DATA, "out", f"{p['model']}.b{p['batch']}.{e}.jsonl") if first else None
        if out:
            os.makedirs(os.path.dirname(out), exist_ok=True)
        if e.startswith("tumble"):
            res = run_tumble(exe, p["model"], params[p["model"]], p["inputs"], p["batch"],
                             "eager" if e == "tumble_eager" else "inline", out,
                             repeat=args.tumble_repeat if e == "tumble" else 1, plain=e == "tumble_plain")
            if res["ok"]:
                ms = res["ms"]
                if res.get("warm_ms") is not None:
                    p.setdefault("warm_samples", []).append(res["warm_ms"])
                p.setdefault("tumble_profile", {}).setdefault(e, []).append(
                    {k: res[k] for k in ("ms", "warm_ms", "wall_ms", "parts", "nodes", "launches")})
                if first:
                    p.setdefault("tumble_profile_text", {})[e] = res["profile"]
        else:
            try:
                res = peers[e].run(model=p["model"], params=params[p["model"]], inputs=p["inputs"],
                                   batch=p["batch"], out=out)
            except Exception as ex:
                res = {"ok": False, "error": str(ex)}
            ms = res["ms_per_batch"][0] if res.get("ok") else None
        if res["ok"]:
            p["samples"][e].append(ms)
            if out:
                outs[(i, e)] = out
        else:
            p["skip"][e] = "error: " + res["error"].strip().splitlines()[-1][:200]
            log(f"!! {p['model']} b{p['batch']} {e}: FAILED: {res['error'][-800:]}")
        done = time.time() - t0
        eta = done / n * (len(work) - n)
        log(f"[{n}/{len(work)}] round {r + 1} {p['model']:15s} b{p['batch']:<3d} {LABEL[e]:26s} "
            f"{fmt_ms(ms) if res['ok'] else 'FAILED':>9s} ms/batch   ({done:.0f} s, ~{eta:.0f} s left)")

    # ---- output checks
    bad = 0
    for i, p in enumerate(points):
        ref_e = "tumble" if (i, "tumble") in outs else ("tumble_eager" if (i, "tumble_eager") in outs else
                                                        ("torch_eager" if (i, "torch_eager") in outs else None))
        p["check_reference"] = ref_e
        if ref_e is None:
            continue
        want = common.read_jsonl(outs[(i, ref_e)])
        for e in engines:
            if e == ref_e or (i, e) not in outs:
                continue
            got = common.read_jsonl(outs[(i, e)])
            probs = [] if len(got) == len(want) else [f"{len(got)} results for {len(want)}"]
            for j, (g, w) in enumerate(zip(got, want)):
                probs += [f"instance {j + 1}{x}" for x in common.compare(g, w, RTOL, ATOL)]
            p["check"][e] = {"ok": not probs, "against": ref_e, "problems": probs[:10]}
            if probs:
                bad += 1
                log(f"!!!! MISMATCH {p['model']} batch {p['batch']}: {LABEL[e]} disagrees with {LABEL[ref_e]} "
                    f"({len(probs)} problems), point marked INVALID:")
                for x in probs[:5]:
                    log(f"!!!!   {x}")
        # FLOPs from the reference outputs (control-flow decisions) and the instances
        shapes = safetensors_shapes(params[p["model"]])
        dims = model_dims(p["kind"], shapes)
        insts = [common.decode(p["kind"], x) for x in common.read_jsonl(p["inputs"])]
        total = sum(flops_instance(p["kind"], dims, x, o) for x, o in zip(insts, want))
        p["flops_per_batch"] = total / p["k"]
        p["roofline_ms"] = p["flops_per_batch"] / (peak * 1e9) * 1e3
        if p["kind"] == "berxit":
            hist = {}
            for o in want:
                hist[o[1]] = hist.get(o[1], 0) + 1
            p["exit_layers"] = dict(sorted(hist.items()))

    for pe in peers.values():
        pe.close()

    # ---- summarize
    for p in points:
        p["median_ms"] = {}
        for e in engines:
            valid = e not in p["check"] or p["check"][e]["ok"]
            p["median_ms"][e] = median(p["samples"][e]) if valid and p["samples"][e] else None
            p.setdefault("invalid", {})[e] = not valid
        tumble_ok = "tumble" not in p["check"] or p["check"]["tumble"]["ok"]
        p["warm_median_ms"] = median(p["warm_samples"]) if tumble_ok and p.get("warm_samples") else None

    stamp = datetime.date.today().isoformat()
    cpu = "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = m.group(1).strip() if m else platform.processor()
    except OSError:
        pass
    machine = f"{os.cpu_count()}cpu-" + re.sub(r"[^a-z0-9]+", "-", re.sub(r"\(R\)|\(TM\)", "", cpu).lower()).strip("-")
    stem = args.tag or f"{stamp}-{machine}" + ("-quick" if args.quick else "")
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "crates", "models", "Cargo.toml"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine, "cpu": cpu, "cpus": os.cpu_count(), "hostname": socket.gethostname(),
        "git": git, "dirty_tree": bool(dirty), "command": "bench/run " + " ".join(sys.argv[1:]),
        "threads": args.threads, "sgemm_peak_gflops": peak, "sgemm_peak_how": peak_how,
        "sgemm_peak_gflops_all_cpus": peak_all, "rounds": args.rounds, "berxit_rounds": args.berxit_rounds,
        "engines": engines, "notes": notes, "mismatches": bad, "seconds": time.time() - t_start,
        "tolerance": {"rtol": RTOL, "atol": ATOL}, "tumble_repeat": args.tumble_repeat,
        "berxit_thresholds": BERXIT_THRESHOLDS,
    }
    for p in points:
        p["inputs"] = os.path.relpath(p["inputs"], ROOT)
    with open(os.path.join(resdir, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "points": points}, f, indent=1)
    table = make_table(points, engines, meta)
    with open(os.path.join(resdir, stem + ".md"), "w") as f:
        f.write(table)
    log("")
    log(table)
    try:
        make_plot(points, engines, os.path.join(resdir, stem + ".png"), meta)
        log(f"plot: bench/results/{stem}.png")
    except ImportError as e:
        log(f"no plot (matplotlib missing: {e})")
    log(f"results: bench/results/{stem}.json, .md ({time.time() - t_start:.0f} s in all)")
    if bad:
        log(f"!!!! {bad} engine/point output MISMATCHES: those points are marked invalid (see above)")
    return 1 if bad else 0


def make_table(points, engines, meta):
    peers = [e for e in engines if e != "tumble"]
    warm = any(p.get("warm_median_ms") for p in points)
    head = ["model", "batch", "roofline ms"] + [LABEL[e] + " ms" for e in engines] + \
        (["tumble warm ms"] if warm else []) + [f"{LABEL[e]} / tumble" for e in peers] + \
        ([f"{LABEL[e]} / tumble warm" for e in peers if not e.startswith("tumble")] if warm else [])
    lines = [
        f"Machine: {meta['cpu']}, {meta['cpus']} CPUs; peers and tumble at {meta['threads']} thread(s); "
        f"sgemm peak {meta['sgemm_peak_gflops']:.1f} GFLOP/s ({meta['sgemm_peak_how']}); "
        f"git {meta['git']}{' + uncommitted changes' if meta['dirty_tree'] else ''}; `{meta['command']}`; median of {meta['rounds']} rounds "
        f"(Berxit {meta['berxit_rounds']}).",
        "",
        "ms per mini-batch (median); tumble = a new process's first run of the point (cold), tumble warm = "
        f"the median of its next {meta.get('tumble_repeat', 1) - 1} runs in the same process (the peers are warm "
        "long-lived processes); `x / tumble` = that engine's time over tumble's (> 1: tumble faster); "
        "roofline = useful dense FLOPs of a mini-batch / sgemm peak; ✗ = outputs disagree (invalid), "
        "— = not run.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|",
    ]
    for p in points:
        t = p["median_ms"].get("tumble")
        row = [p["model"], str(p["batch"]), f"{p.get('roofline_ms', 0):.3g}"]
        for e in engines:
            v = p["median_ms"].get(e)
            row.append("✗" if p["invalid"].get(e) else fmt_ms(v))
        w = p.get("warm_median_ms")
        if warm:
            row.append(fmt_ms(w) if w else "—")
        for e in peers:
            v = p["median_ms"].get(e)
            row.append(f"{v / t:.2f}×" if (v and t) else "—")
        if warm:
            for e in peers:
                if not e.startswith("tumble"):
                    v = p["median_ms"].get(e)
                    row.append(f"{v / w:.2f}×" if (v and w) else "—")
        lines.append("| " + " | ".join(row) + " |")
    # Summary: geometric mean of peer/tumble over the points where both ran, and the points where
    # tumble (cold, and warm) is faster than every peer that ran.
    lines.append("")
    for label, key in (("cold", None), ("warm", "warm_median_ms")):
        if key and not warm:
            continue
        parts = []
        for e in peers:
            if e.startswith("tumble") and key:
                continue
            rs = []
            for p in points:
                t = p.get(key) if key else p["median_ms"].get("tumble")
                v = p["median_ms"].get(e)
                if v and t:
                    rs.append(v / t)
            if rs:
                g = math.exp(sum(math.log(r) for r in rs) / len(rs))
                parts.append(f"{LABEL[e]} {g:.2f}× (min {min(rs):.2f}×, {len(rs)} points)")
        fastest = 0
        ran = 0
        for p in points:
            t = p.get(key) if key else p["median_ms"].get("tumble")
            ok = is_fastest(p, t, peers)
            if ok is not None:
                ran += 1
                fastest += ok
        lines.append(f"tumble {label}: geometric mean of peer / tumble: " + "; ".join(parts) +
                     f". Fastest engine on {fastest} of {ran} points.")
        lines.append("")
    skipped = sorted({f"{p['model']} b{p['batch']} {LABEL[e]}: {why}" for p in points for e, why in p["skip"].items()})
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    ex = [f"{p['model']} b{p['batch']}: {p['exit_layers']}" for p in points if p.get("exit_layers")]
    if ex:
        lines += ["", "Berxit exit layers (layer: instances): " + "; ".join(ex) + "."]
    lines += [""] + make_targets(points, engines)
    return "\n".join(lines) + "\n"


def is_fastest(p, t, engines):
    """Whether tumble's time `t` (cold or warm) is below that of every peer engine among `engines`
    that ran the point (tumble's own variants are not peers: the targets table compares with
    `--scheduler eager` in a column of its own), or None when there is no time or no peer. The one
    definition of "fastest" behind the summary's count and the targets table."""
    others = [p["median_ms"].get(e) for e in engines if not e.startswith("tumble")]
    others = [v for v in others if v]
    if not t or not others:
        return None
    return all(t < v for v in others)


# Issue 17's targets, per point: which points each applies to.
ROOFLINE_TARGET = 0.75  # GEMM-bound points at b64: dense FLOPs / sgemm peak over tumble's time
ROOFLINE_MODELS = {"treelstm_large", "birnn_large", "stackrnn_large", "berxit_small", "berxit_large"}
HOST_TARGET = 0.10  # host program, DFG, scheduling, gathers, launch bookkeeping (outputs), other: at most this share at b64
HOST_PARTS = ("program", "dfg", "scheduling", "gather", "outputs", "other")


def host_share(p):
    """tumble's median share of time outside its kernels over the point's rounds (the profile each
    round prints is its process's last run; decoding the instances is left out, as for the peers),
    or None without a profile."""
    shares = []
    for r in p.get("tumble_profile", {}).get("tumble", []):
        parts = r.get("parts") or {}
        host = sum(parts.get(k, 0.0) for k in HOST_PARTS)
        total = host + parts.get("kernels", 0.0) + parts.get("encode", 0.0)
        if total > 0:
            shares.append(host / total)
    return median(shares) if shares else None


def make_targets(points, engines):
    """Issue 17's targets marked per point: faster than every peer and than tumble's own eager
    scheduler (cold, and warm against the peers), the roofline share of the GEMM-bound points at
    b64, and the host share at b64 (not DRNN, whose work is control flow)."""
    mark = lambda ok: "—" if ok is None else ("✓" if ok else "✗")  # noqa: E731
    rivals = [e for e in ("torch_eager", "torch_batched", "dynet", "tumble_eager") if e in engines]
    head = ["model", "batch"] + [f"faster than {LABEL[e]}" for e in rivals] + \
        ["fastest (cold)", "fastest (warm)", "roofline cold / warm", "host share (b64)"]
    out = ["### Issue 17's targets per point (✓ met, ✗ not, — not applicable or not run)", "",
           "Fastest: tumble's time below every peer's (PyTorch eager, PyTorch by hand, DyNet; the same "
           "count as the summary's; `--scheduler eager` has its own column); "
           f"roofline: ≥ {ROOFLINE_TARGET:.0%} at b64 on {', '.join(sorted(ROOFLINE_MODELS))}; host share: "
           f"{' + '.join(HOST_PARTS)} ≤ {HOST_TARGET:.0%} of tumble's time at b64 on every model but DRNN "
           "(median over the rounds of the profile each process prints, decoding left out).", "",
           "| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + [":---:"] * (len(head) - 2)) + "|"]
    met = {k: [0, 0] for k in ("fastest cold", "fastest warm", "roofline", "host")}

    def count(key, ok):
        if ok is not None:
            met[key][0] += bool(ok)
            met[key][1] += 1
        return ok

    for p in points:
        t, w = p["median_ms"].get("tumble"), p.get("warm_median_ms")
        if not t:
            continue
        row = [p["model"], str(p["batch"])]
        for e in rivals:
            v = p["median_ms"].get(e)
            row.append(f"{mark(t < v)} {v / t:.2f}×" if v else "—")
        row.append(mark(count("fastest cold", is_fastest(p, t, rivals))))
        row.append(mark(count("fastest warm", is_fastest(p, w, rivals))))
        roof = p.get("roofline_ms")
        if p["model"] in ROOFLINE_MODELS and p["batch"] >= 64 and roof:
            ok = count("roofline", roof / t >= ROOFLINE_TARGET)
            row.append(f"{mark(ok)} {roof / t:.0%} / {roof / w:.0%}" if w else f"{mark(ok)} {roof / t:.0%}")
        else:
            row.append("—")
        h = host_share(p)
        if p["batch"] >= 64 and p["kind"] != "drnn" and h is not None:
            row.append(f"{mark(count('host', h <= HOST_TARGET))} {h:.0%}")
        else:
            row.append(f"({h:.0%})" if h is not None else "—")
        out.append("| " + " | ".join(row) + " |")
    out += ["", "Targets met: " + "; ".join(f"{k} {a} of {n}" for k, (a, n) in met.items()) + "."]
    return out


def make_plot(points, engines, path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = []
    for p in points:
        if p["kind"] not in kinds:
            kinds.append(p["kind"])
    ncol = min(4, len(kinds))
    nrow = (len(kinds) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.6 * nrow), squeeze=False)
    colors = {"tumble": "#1f77b4", "tumble_plain": "#6baed6", "tumble_eager": "#aec7e8", "torch_eager": "#d62728", "torch_batched": "#ff9896",
              "dynet": "#2ca02c"}
    for ax, kind in zip(axes.flat, kinds):
        ps = [p for p in points if p["kind"] == kind]
        width = 0.8 / len(engines)
        for j, e in enumerate(engines):
            xs, ys = [], []
            for x, p in enumerate(ps):
                v = p["median_ms"].get(e)
                if v:
                    xs.append(x - 0.4 + width * (j + 0.5))
                    ys.append(v)
            ax.bar(xs, ys, width, label=LABEL[e], color=colors.get(e))
        for x, p in enumerate(ps):
            if p.get("roofline_ms"):
                ax.hlines(p["roofline_ms"], x - 0.45, x + 0.45, colors="k", linestyles="dashed",
                          label="roofline (FLOPs / sgemm peak)" if x == 0 else None)
        ax.set_yscale("log")
        ax.set_xticks(range(len(ps)))
        ax.set_xticklabels([f"{p['size']}\nb{p['batch']}" for p in ps])
        ax.set_title(kind)
        ax.set_ylabel("ms per mini-batch")
        ax.grid(axis="y", which="major", alpha=0.3)
    for ax in list(axes.flat)[len(kinds):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(f"tumble vs peers, {meta['cpu']} ({meta['cpus']} CPUs), {meta['date'][:10]}, git {meta['git']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=110)


DATA = os.path.join(HERE, ".data")

if __name__ == "__main__":
    sys.exit(main())
