#!/usr/bin/env python3
"""Training throughput (trees/s) of the child-sum TreeLSTM on SST (issue 20): tumble train vs DyNet
autobatch vs PyTorch by hand-batched vs PyTorch eager, the same model and hyperparameters.

Model: models/treelstm_sst_train_all.rly: the child-sum Tree-LSTM (H = 256, embeddings 256,
vocabulary 21,703), a 5-class classifier at every node, the loss of a tree = the sum over its nodes
of the cross-entropy; the loss of a mini-batch = the mean over its trees. Every engine: one epoch
over the first N SST training trees (`tumble data sst --split train --labels all`), mini-batches of
20 (shuffled with a fixed seed), Adagrad lr 0.05, no weight decay, the same initial weights
(bench/.data/weights/treelstm_small.seed0.safetensors: same names and shapes), 1 thread (`--threads`).

    tumble       tumble train models/treelstm_sst_train_all.rly --train X --params W --epochs 1
                 --batch 20 --optimizer adagrad --lr 0.05 --threads 1 --quiet -o OUT
    dynet        DyNet autobatch (dynet_config autobatch=1), one graph per mini-batch holding every
                 tree's nodes and losses, loss.forward(); loss.backward(); AdagradTrainer.update()
                 (the embeddings are lookup parameters: sparse updates, DyNet's default; gradient clipping,
                 on by default in DyNet, turned off as in the others)
    torch_batch  PyTorch by hand: nodes of the mini-batch grouped by height, one GEMM per level
                 (as bench/peers/torch_batched.py), all node losses in one cross_entropy;
                 autograd; torch.optim.Adagrad (embeddings sparse: F.embedding(sparse=True))
    torch_eager  PyTorch eager: recursion per tree, node by node (bench/peers/torch_eager.py),
                 a cross_entropy per node; autograd; the same optimizer

Each engine runs in its own process, rounds interleaved (round r runs every engine once). Timed:
the epoch's training loop (tumble: its own epoch report, N / instances-per-second; the peers:
wall clock around the loop, after data decoding and weight loading). Process wall time (start-up,
compile, loading, writing tumble's output included) is recorded too.

    bench/.venv/bin/python bench/train_speed.py [--tumble PATH] [--n 1000] [--rounds 3] [--threads 1]
        [--epochs 1] [--engines tumble,dynet,torch_batch,torch_eager] [--json OUT]

With --epochs E (E ≥ 2) each process trains E epochs, each timed; the first epoch's figures stay
the headline (a one-epoch run), and the last epoch's (the steady state) and the whole run's (all E
epochs' trees over all E training loops) are reported beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
WEIGHTS = os.path.join(HERE, ".data", "weights", "treelstm_small.seed0.safetensors")
MODEL = os.path.join(ROOT, "models", "treelstm_sst_train_all.rly")
BATCH, LR, SEED = 20, 0.05, 0
THREADS = 1  # --threads: every engine's thread count
EPOCHS = 1  # --epochs: epochs each engine trains, each timed


# ---------------------------------------------------------------------------------------------
# instances


class LNode:
    __slots__ = ("tok", "label", "children", "height", "idx")

    def __init__(self, tok, label, children):
        self.tok, self.label, self.children = tok, label, children
        self.height = 0 if not children else 1 + max(c.height for c in children)
        self.idx = -1


def decode(inst):
    def go(t, l):
        (v, ch), (lab, lch) = t["Rose"], l["Rose"]
        tok = int(v[0]) if isinstance(v, list) else int(v)
        lab = int(lab[0]) if isinstance(lab, list) else int(lab)
        return LNode(tok, lab, [go(a, b) for a, b in zip(ch, lch)])

    return go(inst["tree"], inst["labels"])


def batches(trees):
    order = list(range(len(trees)))
    random.Random(SEED).shuffle(order)
    return [[trees[i] for i in order[k:k + BATCH]] for k in range(0, len(order), BATCH)]


# ---------------------------------------------------------------------------------------------
# PyTorch


def torch_train(kind, weights, trees):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    w = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in weights.items()}
    opt = torch.optim.Adagrad(list(w.values()), lr=LR)
    emb, W_iou, b_iou, U_iou = w["emb"], w["W_iou"], w["b_iou"], w["U_iou"]
    U_f, b_f, W_out, b_out = w["U_f"], w["b_f"], w["W_out"], w["b_out"]
    H = U_f.shape[0]

    def eager_loss(trees):
        total = []

        def node(n):
            if not n.children:
                x = F.embedding(torch.tensor([n.tok]), emb, sparse=True)
                i, o, u = F.linear(x, W_iou, b_iou).chunk(3, dim=1)
                c = torch.sigmoid(i) * torch.tanh(u)
                h = torch.sigmoid(o) * torch.tanh(c)
            else:
                states = [node(ch) for ch in n.children]
                h_sum = fc_sum = None
                for hk, ck in states:
                    fc = torch.sigmoid(F.linear(hk, U_f, b_f)) * ck
                    h_sum = hk if h_sum is None else h_sum + hk
                    fc_sum = fc if fc_sum is None else fc_sum + fc
                i, o, u = F.linear(h_sum, U_iou, b_iou).chunk(3, dim=1)
                c = torch.sigmoid(i) * torch.tanh(u) + fc_sum
                h = torch.sigmoid(o) * torch.tanh(c)
            total.append(F.cross_entropy(F.linear(h, W_out, b_out), torch.tensor([n.label]), reduction="sum"))
            return h, c

        for t in trees:
            node(t)
        return torch.stack(total).sum() / len(trees)

    def batched_loss(trees):
        levels, nodes = {}, []

        def visit(n):
            for c in n.children:
                visit(c)
            n.idx = len(nodes)
            nodes.append(n)
            levels.setdefault(n.height, []).append(n)

        for t in trees:
            visit(t)
        # states as a list of per-level tensors; a node's (level, row) locates it
        where = {}
        hs, cs = [], []
        leaves = levels[0]
        x = F.embedding(torch.tensor([n.tok for n in leaves]), emb, sparse=True)
        i, o, u = F.linear(x, W_iou, b_iou).chunk(3, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u)
        hs.append(torch.sigmoid(o) * torch.tanh(c))
        cs.append(c)
        for r, n in enumerate(leaves):
            where[n.idx] = r
        offset = [0, len(leaves)]
        for height in range(1, max(levels) + 1):
            lv = levels.get(height, [])
            if not lv:
                offset.append(offset[-1])
                continue
            h_prev, c_prev = torch.cat(hs), torch.cat(cs)  # every state computed so far
            child = torch.tensor([where[ch.idx] for n in lv for ch in n.children])
            parent = torch.tensor([k for k, n in enumerate(lv) for _ in n.children])
            hc = h_prev[child]
            fc = torch.sigmoid(F.linear(hc, U_f, b_f)) * c_prev[child]
            h_sum = torch.zeros(len(lv), H).index_add(0, parent, hc)
            fc_sum = torch.zeros(len(lv), H).index_add(0, parent, fc)
            i, o, u = F.linear(h_sum, U_iou, b_iou).chunk(3, dim=1)
            c = torch.sigmoid(i) * torch.tanh(u) + fc_sum
            hs.append(torch.sigmoid(o) * torch.tanh(c))
            cs.append(c)
            base = offset[-1]
            for r, n in enumerate(lv):
                where[n.idx] = base + r
            offset.append(base + len(lv))
        order = [n for h in sorted(levels) for n in levels[h]]
        labels = torch.tensor([n.label for n in order])
        logits = F.linear(torch.cat(hs), W_out, b_out)
        return F.cross_entropy(logits, labels, reduction="sum") / len(trees)

    loss_of = eager_loss if kind == "torch_eager" else batched_loss
    bs = batches(trees)
    times, losses = [], []
    for _ in range(EPOCHS):
        t0 = time.perf_counter()
        total = 0.0
        for b in bs:
            opt.zero_grad(set_to_none=True)
            loss = loss_of(b)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
        times.append(time.perf_counter() - t0)
        losses.append(total / len(trees))
    return times, losses


# ---------------------------------------------------------------------------------------------
# DyNet


def dynet_train(weights, trees):
    import dynet_config

    dynet_config.set(autobatch=1, mem="2048", random_seed=1)
    import dynet as dy
    import numpy as np

    pc = dy.ParameterCollection()
    P = {}
    for k, v in weights.items():
        if k == "emb":
            P[k] = pc.lookup_parameters_from_numpy(np.ascontiguousarray(v))
        else:
            P[k] = pc.add_parameters(v.shape, init=dy.NumpyInitializer(v))
    trainer = dy.AdagradTrainer(pc, learning_rate=LR)
    trainer.set_clip_threshold(0)  # DyNet clips gradients at norm 5 by default; the others do not
    H = weights["U_f"].shape[0]

    def loss_of(trees):
        dy.renew_cg()
        emb, W_iou, b_iou, U_iou, U_f, b_f = (P[k] for k in ("emb", "W_iou", "b_iou", "U_iou", "U_f", "b_f"))
        W_out, b_out = P["W_out"], P["b_out"]
        losses = []

        def node(n):
            if not n.children:
                iou = dy.affine_transform([b_iou, W_iou, dy.lookup(emb, n.tok)])
                c = dy.cmult(dy.logistic(dy.pick_range(iou, 0, H)), dy.tanh(dy.pick_range(iou, 2 * H, 3 * H)))
            else:
                states = [node(ch) for ch in n.children]
                fcs = [dy.cmult(dy.logistic(dy.affine_transform([b_f, U_f, h])), c) for h, c in states]
                h_sum = dy.esum([h for h, _ in states])
                iou = dy.affine_transform([b_iou, U_iou, h_sum])
                c = dy.cmult(dy.logistic(dy.pick_range(iou, 0, H)), dy.tanh(dy.pick_range(iou, 2 * H, 3 * H)))
                c = c + dy.esum(fcs)
            h = dy.cmult(dy.logistic(dy.pick_range(iou, H, 2 * H)), dy.tanh(c))
            losses.append(dy.pickneglogsoftmax(dy.affine_transform([b_out, W_out, h]), n.label))
            return h, c

        for t in trees:
            node(t)
        return dy.esum(losses) * (1.0 / len(trees))

    bs = batches(trees)
    times, losses = [], []
    for _ in range(EPOCHS):
        t0 = time.perf_counter()
        total = 0.0
        for b in bs:
            loss = loss_of(b)
            total += loss.value() * len(b)  # the forward (autobatched)
            loss.backward()
            trainer.update()
        times.append(time.perf_counter() - t0)
        losses.append(total / len(trees))
    return times, losses


# ---------------------------------------------------------------------------------------------
# tumble


def tumble_train(tumble, train_path, n):
    with tempfile.TemporaryDirectory(prefix="train_speed.") as tmp:
        cmd = [tumble, "train", MODEL, "--train", train_path, "--params", WEIGHTS, "--epochs", str(EPOCHS),
               "--batch", str(BATCH), "--optimizer", "adagrad", "--lr", str(LR), "--seed", str(SEED),
               "--threads", str(THREADS), "--quiet", "-o", os.path.join(tmp, "out.safetensors")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"tumble train failed: {r.stderr[-2000:]}")
        out = r.stdout + r.stderr
        ms = re.findall(r"train loss ([0-9.eE+-]+) \(([0-9.eE+-]+) instances/s", out)
        if len(ms) != EPOCHS:
            raise RuntimeError(f"cannot read tumble's epoch reports: {out[-500:]}")
        return [n / float(rate) for _, rate in ms], [float(loss) for loss, _ in ms]


# ---------------------------------------------------------------------------------------------
# driver


def worker(a):
    global THREADS, EPOCHS
    THREADS, EPOCHS = a.threads, a.epochs
    # DyNet's CPU kernels (Eigen) and any MKL/OpenMP under PyTorch read these at import.
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(a.threads)
    import common

    lines = [l for l in open(a.train) if l.strip()][: a.n]
    if a.engine == "tumble":
        with tempfile.TemporaryDirectory(prefix="train_speed.") as tmp:
            first = os.path.join(tmp, "train.jsonl")  # tumble trains on the whole file: its first N
            with open(first, "w") as f:
                f.write("".join(lines))
            times, losses = tumble_train(a.tumble, first, len(lines))
    else:
        trees = [decode(json.loads(l)) for l in lines]
        weights = common.load_safetensors(WEIGHTS)
        if a.engine == "dynet":
            times, losses = dynet_train(weights, trees)
        else:
            times, losses = torch_train(a.engine, weights, trees)
    n = len(lines)
    # The first epoch (what a single-epoch run sees) and the last (the steady state of a longer
    # run: every engine's allocator, caches and lazily built state warm).
    print(json.dumps({"engine": a.engine, "trees": n, "seconds": times[0], "trees_per_s": n / times[0],
                      "epoch_seconds": times, "last_epoch_trees_per_s": n / times[-1],
                      "mean_train_loss": losses[0], "epoch_losses": losses}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tumble", default=os.environ.get("TUMBLE", os.path.join(ROOT, "target/release/tumble")))
    ap.add_argument("--n", type=int, default=1000, help="training trees (the first N of SST train)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="tumble,dynet,torch_batch,torch_eager")
    ap.add_argument("--train", help="SST train with --labels all (default: made with tumble data sst)")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of every engine (tumble: --threads T, its default --workers T; PyTorch: "
                         "set_num_threads; DyNet: OMP/MKL_NUM_THREADS, its autobatched CPU run is single-threaded)")
    ap.add_argument("--epochs", type=int, default=1,
                    help="epochs each engine trains in its process; with 2 or more the last epoch is "
                         "reported too (the steady state), beside the first")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # worker mode
    a = ap.parse_args()
    if a.engine:
        return worker(a)
    tmp = tempfile.mkdtemp(prefix="train_speed.")
    if not a.train:
        a.train = os.path.join(tmp, "train.jsonl")
        subprocess.run([a.tumble, "data", "sst", "--split", "train", "--labels", "all", "--limit", str(a.n),
                        "-o", a.train], check=True, capture_output=True)
    engines = a.engines.split(",")
    runs = {e: [] for e in engines}
    for r in range(a.rounds):
        for e in engines:
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--engine", e, "--train", a.train,
                                "--n", str(a.n), "--tumble", a.tumble, "--threads", str(a.threads),
                                "--epochs", str(a.epochs)],
                               capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if p.returncode != 0:
                print(f"round {r + 1} {e}: FAILED\n{p.stderr[-3000:]}", file=sys.stderr)
                continue
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res["process_wall_s"] = wall
            runs[e].append(res)
            last = f", last epoch {res['last_epoch_trees_per_s']:.1f} trees/s" if a.epochs > 1 else ""
            print(f"round {r + 1} {e:<12} {res['trees_per_s']:8.1f} trees/s  (epoch {res['seconds']:.2f} s, "
                  f"process {wall:.2f} s, mean train loss {res['mean_train_loss']:.4f}{last})", flush=True)
    print(f"\nchild-sum TreeLSTM, SST train first {a.n} trees, batch {BATCH}, Adagrad lr {LR}, {a.threads} thread(s), "
          f"{a.rounds} interleaved rounds: median trees/s [min, max]")
    med = {}
    for e in engines:
        v = [x["trees_per_s"] for x in runs[e]]
        if not v:
            print(f"  {e:<12} no result")
            continue
        med[e] = statistics.median(v)
        pw = statistics.median(x["process_wall_s"] for x in runs[e])
        print(f"  {e:<12} {med[e]:8.1f}  [{min(v):.1f}, {max(v):.1f}]   process wall median {pw:.2f} s")
    if "tumble" in med:
        for e in engines:
            if e != "tumble" and e in med:
                print(f"  tumble / {e}: {med['tumble'] / med[e]:.2f}x")
    last_med, run_med = {}, {}
    if a.epochs > 1:
        last_med = summary(f"last epoch (epoch {a.epochs} of each process)", engines, runs,
                           lambda x: x["last_epoch_trees_per_s"])
        # The whole run: every epoch's trees over every epoch's training loop (a training run is
        # many epochs; tumble's first records each instance's trace, the later ones replay it).
        run_med = summary(f"all {a.epochs} epochs (the training run, loops only)", engines, runs,
                          lambda x: x["trees"] * len(x["epoch_seconds"]) / sum(x["epoch_seconds"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"n": a.n, "rounds": a.rounds, "epochs": a.epochs, "runs": runs,
                       "median_trees_per_s": med, "median_last_epoch_trees_per_s": last_med,
                       "median_run_trees_per_s": run_med}, f, indent=1)


def summary(title, engines, runs, value):
    """Prints each engine's median of `value(run)` [min, max] and tumble's ratios; returns the
    medians by engine."""
    print(f"\n{title}: median trees/s [min, max]")
    med = {}
    for e in engines:
        v = [value(x) for x in runs[e]]
        if v:
            med[e] = statistics.median(v)
            print(f"  {e:<12} {med[e]:8.1f}  [{min(v):.1f}, {max(v):.1f}]")
    if "tumble" in med:
        for e in engines:
            if e != "tumble" and e in med:
                print(f"  tumble / {e}: {med['tumble'] / med[e]:.2f}x")
    return med


if __name__ == "__main__":
    main()
