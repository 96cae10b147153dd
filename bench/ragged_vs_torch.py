#!/usr/bin/env python3
"""Variable-length Berxit: tumble (ragged batching on and off) against PyTorch padded batches,
nested tensors and eager, and DyNet autobatch; same weights, same instances, outputs compared.

    bench/.venv/bin/python bench/ragged_vs_torch.py [--model berxit_var_small] [--count 64]
        [--batches 8 64] [--rounds 3] [--lengths sst] [--threshold 0.9]

Engines (one thread each, interleaved per round, medians with min-max reported):
- tumble: `tumble run models/MODEL.rly --batch B --threads 1 --repeat 2`, the warm run's time
  without decoding inputs (what the peers time: they decode before their timer starts); with
  `--no-mixing-kernels` as the second tumble column (attention and the [CLS] slice once per group
  of equal length), `--no-ragged` as the third (instances batch only with equal lengths) and
  `--ragged-padding` as the fourth (tumble's padding baseline: the row-wise segments run over every
  sentence padded to its launch's longest, as a padded batch does).
- torch_padded: the hand-batched Berxit of bench/peers/torch_batched.py, each mini-batch padded to
  its longest sentence with an attention mask on the padded keys (the usual PyTorch practice);
  instances that exit leave the batch (compacted), as in the fixed-length peer.
- torch_nested: PyTorch nested tensors (jagged layout): linear, layer norm and GELU on the nested
  batch, attention by scaled_dot_product_attention on nested heads; exited instances leave it.
- torch_eager: one instance at a time at its own length (no padding, no batching).
- dynet: DyNet with automatic batching (bench/peers/dynet_auto.py: each instance a batch of its
  own tokens, at its own length; autobatching joins what it can across instances), in its own
  process with `--repeats 2`, the warm repeat's time; skipped with --no-dynet.

Inputs: `tumble data berxit --lengths SPEC` (default `sst`: the lengths of SST's training
sentences plus [CLS]). Weights: `--random-params 0` saved once to bench/.data/weights. Reports the
padding waste (padded tokens / real tokens) per batch size: the issue's target is tumble faster
than padded PyTorch by at least that factor, and at least 2x PyTorch eager.
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
import common  # noqa: E402

DATA = os.path.join(HERE, ".data")
EXE = os.path.join(ROOT, "target", "release", "tumble")
REPEATS = re.compile(r"^repeats without decoding inputs \(ms per run\): ([0-9. ]+); warm median ([0-9.]+)$", re.M)
HEAD = re.compile(r"batched launches (\d+)")
MEAN = re.compile(r"^mean batch size ([0-9.]+)$", re.M)


def gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def layers_of(w):
    n = 1
    out = []
    while f"l{n}_Wq" in w:
        out.append({k[len(f"l{n}_"):]: v for k, v in w.items() if k.startswith(f"l{n}_")})
        n += 1
    return out


def torch_berxit(w, padded=True):
    layers = layers_of(w)
    D = w["pos_emb"].shape[1]
    nh = D // 64

    def layer(x, mask, p):
        B, S, _ = x.shape
        q = F.linear(x, p["Wq"], p["bq"]).reshape(B, S, nh, 64).transpose(1, 2)
        k = F.linear(x, p["Wk"], p["bk"]).reshape(B, S, nh, 64).transpose(1, 2)
        v = F.linear(x, p["Wv"], p["bv"]).reshape(B, S, nh, 64).transpose(1, 2)
        scores = (q @ k.transpose(2, 3)) * 0.125
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        ctx = (probs @ v).transpose(1, 2).reshape(B, S, D)
        a = F.layer_norm(F.linear(ctx, p["Wo"], p["bo"]) + x, (D,), p["ln1_g"], p["ln1_b"], eps=1e-12)
        y = F.linear(gelu(F.linear(a, p["W1"], p["b1"])), p["W2"], p["b2"]) + a
        return F.layer_norm(y, (D,), p["ln2_g"], p["ln2_b"], eps=1e-12)

    def run(insts):
        lens = [len(t) for t, _ in insts]
        S = max(lens)
        B = len(insts)
        toks = torch.zeros((B, S), dtype=torch.int64)
        for i, (t, _) in enumerate(insts):
            toks[i, : len(t)] = torch.from_numpy(t)
        th = torch.tensor([t for _, t in insts], dtype=torch.float32)
        # Additive key mask: padded keys get -inf-like scores, so real rows equal unpadded ones.
        mask = None
        if min(lens) < S:
            m = torch.zeros((B, 1, 1, S))
            for i, n in enumerate(lens):
                m[i, :, :, n:] = -1e30
            mask = m
        x = w["word_emb"][toks] + w["pos_emb"][:S] + w["type_emb"][0]
        x = F.layer_norm(x, (D,), w["emb_ln_g"], w["emb_ln_b"], eps=1e-12)
        alive = list(range(B))
        out = [None] * B
        for l, p in enumerate(layers, start=1):
            x = layer(x, mask, p)
            logits = F.linear(torch.tanh(F.linear(x[:, 0], p["exit_Wp"], p["exit_bp"])), p["exit_W"], p["exit_b"])
            done = (torch.softmax(logits, dim=-1).max(dim=-1).values > th[alive]).tolist()
            keep = [j for j, k in enumerate(alive) if not (done[j] or l == len(layers))]
            for j, k in enumerate(alive):
                if j not in keep:
                    out[k] = [common.f32list(logits[j : j + 1]), l]
            if len(keep) < len(alive):
                alive = [alive[j] for j in keep]
                x = x[keep]
                if mask is not None:
                    mask = mask[keep]
            if not alive:
                break
        return out

    if padded:
        return run
    return lambda insts: [r for i in insts for r in run([i])]


def torch_nested_berxit(w):
    """Berxit on PyTorch nested tensors (jagged layout): no padding, one op call per mini-batch;
    attention by `scaled_dot_product_attention` on the nested heads."""
    layers = layers_of(w)
    D = w["pos_emb"].shape[1]
    nh = D // 64

    def layer(x, p):
        def heads(W, b):
            return F.linear(x, W, b).unflatten(-1, (nh, 64)).transpose(1, 2)

        ctx = F.scaled_dot_product_attention(heads(p["Wq"], p["bq"]), heads(p["Wk"], p["bk"]),
                                             heads(p["Wv"], p["bv"]), scale=0.125)
        ctx = ctx.transpose(1, 2).flatten(-2)
        a = F.layer_norm(F.linear(ctx, p["Wo"], p["bo"]) + x, (D,), p["ln1_g"], p["ln1_b"], eps=1e-12)
        y = F.linear(gelu(F.linear(a, p["W1"], p["b1"])), p["W2"], p["b2"]) + a
        return F.layer_norm(y, (D,), p["ln2_g"], p["ln2_b"], eps=1e-12)

    def run(insts):
        th = torch.tensor([t for _, t in insts], dtype=torch.float32)
        rows = []
        for t, _ in insts:
            ids = torch.from_numpy(t)
            e = w["word_emb"][ids] + w["pos_emb"][: len(t)] + w["type_emb"][0]
            rows.append(F.layer_norm(e, (D,), w["emb_ln_g"], w["emb_ln_b"], eps=1e-12))
        x = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        alive = list(range(len(insts)))
        out = [None] * len(insts)
        for l, p in enumerate(layers, start=1):
            x = layer(x, p)
            parts = x.unbind()
            cls = torch.stack([r[0] for r in parts])
            logits = F.linear(torch.tanh(F.linear(cls, p["exit_Wp"], p["exit_bp"])), p["exit_W"], p["exit_b"])
            done = (torch.softmax(logits, dim=-1).max(dim=-1).values > th[alive]).tolist()
            keep = [j for j in range(len(alive)) if not (done[j] or l == len(layers))]
            for j, k in enumerate(alive):
                if j not in keep:
                    out[k] = [common.f32list(logits[j : j + 1]), l]
            if not keep:
                break
            if len(keep) < len(alive):
                alive = [alive[j] for j in keep]
                x = torch.nested.as_nested_tensor([parts[j] for j in keep], layout=torch.jagged)
        return out

    return run


def run_tumble(model, params, inputs, batch, extra):
    cmd = [EXE, "run", f"models/{model}.rly", "--inputs", inputs, "--params", params, "--batch", str(batch),
           "--threads", "1", "--profile", "--repeat", "2", "-o", os.path.join(DATA, "ragged_out.jsonl")] + extra
    env = dict(os.environ, TUMBLE_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"tumble failed: {p.stderr[-2000:]}")
    rep = REPEATS.search(p.stderr)
    launches = int(HEAD.search(p.stderr).group(1))
    mean = float(MEAN.search(p.stderr).group(1))
    results = [json.loads(line) for line in open(os.path.join(DATA, "ragged_out.jsonl"))]
    return float(rep.group(2)), launches, mean, results


def run_dynet(model, params, inputs, batch):
    out = os.path.join(DATA, "ragged_dynet_out.jsonl")
    cmd = [sys.executable, os.path.join(HERE, "peers", "dynet_auto.py"), model, "--params", params,
           "--inputs", inputs, "--batch", str(batch), "--repeats", "2", "-o", out]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"dynet failed: {p.stderr[-2000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    results = [json.loads(line) for line in open(out)]
    return r["ms_per_batch"][-1] * r["batches"], results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="berxit_var_small")
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lengths", default="sst")
    ap.add_argument("--threshold", default="mixed",
                    help="exit threshold: a number, or `mixed` (the suite's: each instance's drawn from "
                         "{0.6, 0.7, 0.8, 0.9}, seeded, so instances exit at different layers)")
    ap.add_argument("--no-eager", action="store_true", help="skip PyTorch eager (slow on large)")
    ap.add_argument("--no-dynet", action="store_true", help="skip DyNet autobatch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(os.path.join(DATA, "weights"), exist_ok=True)
    tag = args.lengths.replace(":", "_")
    inputs = os.path.join(DATA, f"berxit_var_{tag}_{args.count}_t{args.threshold}.jsonl")
    if not os.path.exists(inputs):
        fixed = "0.9" if args.threshold == "mixed" else args.threshold
        subprocess.run([EXE, "data", "berxit", "--lengths", args.lengths, "--count", str(args.count), "--seed", "0",
                        "--threshold", fixed, "-o", inputs], cwd=ROOT, check=True, capture_output=True)
        if args.threshold == "mixed":
            rng = random.Random(0)
            lines = [json.loads(line) for line in open(inputs) if line.strip()]
            with open(inputs, "w") as g:
                for inst in lines:
                    inst["threshold"] = rng.choice([0.6, 0.7, 0.8, 0.9])
                    g.write(json.dumps(inst) + "\n")
    params = os.path.join(DATA, "weights", f"{args.model}.seed0.safetensors")
    if not os.path.exists(params):
        subprocess.run([EXE, "run", f"models/{args.model}.rly", "--inputs", inputs, "--random-params", "0",
                        "--save-params", params, "--batch", "1", "-o", os.devnull], cwd=ROOT, check=True,
                       capture_output=True)
    w = {k: torch.from_numpy(v) for k, v in common.load_safetensors(params).items()}
    insts = [common.decode("berxit", x) for x in common.read_jsonl(inputs)]
    lens = [len(t) for t, _ in insts]
    exits = {}
    for r in run_tumble(args.model, params, inputs, len(insts), [])[3]:
        exits[r[1]] = exits.get(r[1], 0) + 1
    print(f"{args.model}: {len(insts)} instances, lengths {min(lens)}-{max(lens)} (mean {np.mean(lens):.1f}), "
          f"lengths spec `{args.lengths}`, threshold {args.threshold}, 1 thread; exit layers {dict(sorted(exits.items()))}")
    padded = torch_berxit(w, padded=True)
    nested = torch_nested_berxit(w)
    eager = torch_berxit(w, padded=False)

    def torch_time(fn, b):
        t0 = time.perf_counter()
        res = []
        with torch.inference_mode():
            for i in range(0, len(insts), b):
                res.extend(fn(insts[i : i + b]))
        return (time.perf_counter() - t0) * 1e3, res

    rows = []
    for b in args.batches:
        waste = sum(max(lens[i : i + b]) * len(lens[i : i + b]) for i in range(0, len(lens), b)) / sum(lens)
        times = {"tumble": [], "tumble_grouped": [], "tumble_no_ragged": [], "tumble_padding": [],
                 "torch_padded": [], "torch_nested": [],
                 "torch_eager": [], "dynet": []}
        info = {}
        for r in range(args.rounds):
            ms, launches, mean, got = run_tumble(args.model, params, inputs, b, [])
            times["tumble"].append(ms)
            info["tumble"] = (launches, mean)
            ms, _, _, got_grouped = run_tumble(args.model, params, inputs, b, ["--no-mixing-kernels"])
            times["tumble_grouped"].append(ms)
            ms, launches, mean, got_off = run_tumble(args.model, params, inputs, b, ["--no-ragged"])
            times["tumble_no_ragged"].append(ms)
            info["tumble_no_ragged"] = (launches, mean)
            ms, launches, mean, got_pad = run_tumble(args.model, params, inputs, b, ["--ragged-padding"])
            times["tumble_padding"].append(ms)
            info["tumble_padding"] = (launches, mean)
            ms, want = torch_time(padded, b)
            times["torch_padded"].append(ms)
            ms, want_nested = torch_time(nested, b)
            times["torch_nested"].append(ms)
            if not args.no_eager:
                ms, want_eager = torch_time(eager, b)
                times["torch_eager"].append(ms)
            if not args.no_dynet:
                ms, want_dynet = run_dynet(args.model, params, inputs, b)
                times["dynet"].append(ms)
            if r == 0:
                for name, other in [("no_mixing_kernels", got_grouped), ("no_ragged", got_off), ("ragged_padding", got_pad), ("torch_padded", want),
                                    ("torch_nested", want_nested)] + (
                        [] if args.no_eager else [("torch_eager", want_eager)]) + (
                        [] if args.no_dynet else [("dynet", want_dynet)]):
                    bad = [m for i, (g, o) in enumerate(zip(got, other))
                           for m in common.compare(g, o, path=f"instance {i}")]
                    print(f"  b{b}: tumble vs {name}: {'outputs agree' if not bad else bad[:3]}")
        med = {k: statistics.median(v) for k, v in times.items() if v}
        spread = {k: (min(v), max(v)) for k, v in times.items() if v}
        rows.append((b, waste, med, spread, info))
    print()
    print("| batch | padding waste | tumble ms (launches, mean batch) | --no-mixing-kernels ms | "
          "--no-ragged ms (launches, mean batch) | --ragged-padding ms | PyTorch padded ms | PyTorch nested ms | PyTorch eager ms | DyNet autobatch ms | padded / tumble | "
          "nested / tumble | eager / tumble | DyNet / tumble |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, waste, med, spread, info in rows:
        def cell(k):
            if k not in med:
                return "-"
            lo, hi = spread[k]
            return f"{med[k]:.0f} ({lo:.0f}-{hi:.0f})"
        eager_ratio = f"{med['torch_eager'] / med['tumble']:.2f}x" if "torch_eager" in med else "-"
        dynet_ratio = f"{med['dynet'] / med['tumble']:.2f}x" if "dynet" in med else "-"
        print(f"| {b} | {waste:.2f}x | {cell('tumble')} ({info['tumble'][0]}, {info['tumble'][1]:.1f}) | "
              f"{cell('tumble_grouped')} | {cell('tumble_no_ragged')} ({info['tumble_no_ragged'][0]}, {info['tumble_no_ragged'][1]:.1f}) | "
              f"{cell('tumble_padding')} | {cell('torch_padded')} | {cell('torch_nested')} | {cell('torch_eager')} | {cell('dynet')} | "
              f"{med['torch_padded'] / med['tumble']:.2f}x | {med['torch_nested'] / med['tumble']:.2f}x | "
              f"{eager_ratio} | {dynet_ratio} |")


if __name__ == "__main__":
    main()
