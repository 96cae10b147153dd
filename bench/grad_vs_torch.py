#!/usr/bin/env python3
"""tumble grad against PyTorch autograd (issue 20): same weights, same instances, same scalar loss.

For TreeLSTM, BiRNN and StackRNN (small by default), the zoo model is wrapped into a scalar loss
the way crates/runtime/tests/gradients.rs does it: `@main` is renamed `@main_fwd` and a new `@main`
with the same parameters returns

    treelstm  sum(o * o)                  o = the root's class logits (1, 5)
    stackrnn  sum(o.0 * o.0)              o.0 = the sentence's class logits (1, 5) (actions ignored),
              with the final tracker state added to the final phrase before the classifier
              (`(%top, Nil)` -> `(add(%top, %h), Nil)` in @stackrnn's base case): otherwise the
              tracker's W_t, U_t, b_t reach the loss only through argmax and get zero gradient.
              W_a, b_a (the action classifier) still do: their gradient is 0 on both sides.
    birnn     sum over tokens of sum(l * l), l = the token's logits (1, 5): the classifier's
              argmax is removed, since the class ids have no gradient

The wrapper is written to a temporary directory; tumble's gradient of the sum over instances is
`tumble grad WRAPPER --params W --inputs X --batch B -o G.safetensors`. PyTorch computes the same
loss with an eager per-instance implementation (the math of bench/peers/torch_eager.py) under
autograd, in float64 from the same float32 weights (the exact gradient, up to float64 rounding);
the float32 autograd gradient is reported too, as the noise floor of a float32 engine.

Error per parameter: max |g_tumble - g_torch| / max |g_torch| (relative to the parameter
gradient's largest entry). Target: <= 1e-4.

    bench/.venv/bin/python bench/grad_vs_torch.py [--tumble PATH] [--n 64] [--batch 16] [--large]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(HERE, "peers"))
import common  # noqa: E402

SQUARES = "sum(multiply(%o, %o))"
LOSSES = {
    "treelstm": SQUARES,
    "stackrnn": "sum(multiply(%o.0, %o.0))",
    "birnn": "@foldl(fn (%acc: Tensor[(), float32], %l: Tensor[(1, 5), float32]) -> Tensor[(), float32] "
    "{ add(%acc, sum(multiply(%l, %l))) }, zeros(shape=[], dtype=\"float32\"), %o)",
}
INPUTS = {"treelstm": "sst_tree_128.jsonl", "birnn": "sst_tokens_128.jsonl", "stackrnn": "sst_tokens_128.jsonl"}


def with_loss(text: str, loss: str) -> str:
    """Port of gradients.rs `with_loss`: @main -> @main_fwd, new @main returning `loss` of %o."""
    start = text.index("def @main(")
    close = start + text[start:].index(") ->")
    params = text[start + len("def @main("):close]
    names = []
    for line in params.splitlines():
        line = line.strip()
        if line.startswith("%"):
            names.append("%" + line[1:].split(":")[0].strip())
    renamed = text.replace("def @main(", "def @main_fwd(", 1)
    return (f"{renamed}\n\ndef @main({params}) -> Tensor[(), float32] {{\n"
            f"  let %o = @main_fwd({', '.join(names)});\n  {loss}\n}}\n")


def stackrnn_edit(text: str) -> str:
    old = "(Nil, Cons(%top, Nil)) => (%top, Nil),"
    assert old in text, "stackrnn's base case moved: update stackrnn_edit"
    return text.replace(old, "(Nil, Cons(%top, Nil)) => (add(%top, %h), Nil),")


def birnn_edit(text: str) -> str:
    return (text.replace("argmax(%logits, axis=[1])", "%logits")
            .replace(") -> Tensor[(1), int32] {", ") -> Tensor[(1, 5), float32] {")
            .replace(") -> List[Tensor[(1), int32]] {", ") -> List[Tensor[(1, 5), float32]] {"))


# ---------------------------------------------------------------------------------------------
# PyTorch: the same models (bench/peers/torch_eager.py), returning the scalar loss of one instance


def treelstm_loss(w, tree):
    emb, W_iou, b_iou, U_iou = w["emb"], w["W_iou"], w["b_iou"], w["U_iou"]
    U_f, b_f, W_out, b_out = w["U_f"], w["b_f"], w["W_out"], w["b_out"]

    def node(n):
        if not n.children:
            i, o, u = F.linear(emb[n.tok:n.tok + 1], W_iou, b_iou).chunk(3, dim=1)
            c = torch.sigmoid(i) * torch.tanh(u)
            return torch.sigmoid(o) * torch.tanh(c), c
        states = [node(ch) for ch in n.children]
        h_sum = sum(h for h, _ in states)
        fc_sum = sum(torch.sigmoid(F.linear(h, U_f, b_f)) * c for h, c in states)
        i, o, u = F.linear(h_sum, U_iou, b_iou).chunk(3, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u) + fc_sum
        return torch.sigmoid(o) * torch.tanh(c), c

    h, _ = node(tree)
    o = F.linear(h, W_out, b_out)
    return (o * o).sum()


def birnn_loss(w, toks):
    emb, W_out, b_out = w["emb"], w["W_out"], w["b_out"]
    H = w["W_h_fwd"].shape[0]

    def rnn(ts, W_x, W_h, b):
        h = torch.zeros(1, H, dtype=emb.dtype)
        hs = []
        for t in ts:
            h = torch.tanh(F.linear(emb[t:t + 1], W_x, b) + F.linear(h, W_h))
            hs.append(h)
        return hs

    fwd = rnn(toks, w["W_x_fwd"], w["W_h_fwd"], w["b_fwd"])
    bwd = rnn(toks[::-1], w["W_x_bwd"], w["W_h_bwd"], w["b_bwd"])[::-1]
    total = 0
    for hf, hb in zip(fwd, bwd):
        l = F.linear(torch.cat([hf, hb], dim=1), W_out, b_out)
        total = total + (l * l).sum()
    return total


def stackrnn_loss(w, toks, actions_out):
    emb, W_t, U_t, b_t = w["emb"], w["W_t"], w["U_t"], w["b_t"]
    W_a, b_a, W_c, b_c, W_out, b_out = w["W_a"], w["b_a"], w["W_c"], w["b_c"], w["W_out"], w["b_out"]
    H = U_t.shape[0]
    zero = torch.zeros(1, H, dtype=emb.dtype)
    stack, i, n, h, actions, margins = [], 0, len(toks), zero, [], []
    while not (i == n and len(stack) == 1):
        s0 = stack[-1] if stack else zero
        x0 = emb[toks[i]:toks[i] + 1] if i < n else zero
        # the .rly adds bias after the sum of the two products
        h = torch.tanh(F.linear(torch.cat([s0, x0], dim=1), W_t) + F.linear(h, U_t) + b_t)
        if i < n and len(stack) >= 2:
            a = F.linear(h, W_a, b_a)[0]
            reduce = int(torch.argmax(a).item()) == 1
            margins.append(abs(float((a[1] - a[0]).detach())))
        else:
            reduce = i >= n
        if reduce:
            right, left = stack.pop(), stack.pop()
            stack.append(torch.tanh(F.linear(torch.cat([left, right], dim=1), W_c, b_c)))
            actions.append(1)
        else:
            stack.append(x0)
            i += 1
            actions.append(0)
    actions_out.append((actions, min(margins) if margins else float("inf")))
    o = F.linear(stack[0] + h, W_out, b_out)  # + h: see stackrnn_edit
    return (o * o).sum()


def torch_grad(kind, weights, insts, dtype):
    w = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in weights.items()}
    leaves = dict(w)
    # One gather of the embedding rows used, so that autograd does not build a dense
    # (21703, 256) gradient per lookup (the math is unchanged: emb[t] is the same row).
    toks = sorted({t for x in insts for t in all_tokens(kind, x)})
    pos = {t: i for i, t in enumerate(toks)}
    w = dict(w, emb=Rows(w["emb"][torch.tensor(toks, dtype=torch.long)], pos))
    acts = []
    total = 0
    for x in insts:
        if kind == "treelstm":
            total = total + treelstm_loss(w, x)
        elif kind == "birnn":
            total = total + birnn_loss(w, x)
        else:
            total = total + stackrnn_loss(w, x, acts)
    total.backward()
    grads = {k: (v.grad.double().numpy() if v.grad is not None else np.zeros(v.shape)) for k, v in leaves.items()}
    return float(total.detach()), grads, acts


class Rows:
    """emb[t:t+1] over a gathered subset of the embedding rows."""

    def __init__(self, rows, pos):
        self.rows, self.pos, self.dtype = rows, pos, rows.dtype

    def __getitem__(self, s):
        i = self.pos[s.start]
        return self.rows[i:i + 1]


def all_tokens(kind, x):
    if kind == "treelstm":
        out, st = [], [x]
        while st:
            n = st.pop()
            if not n.children:
                out.append(n.tok)
            st.extend(n.children)
        return out
    return list(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tumble", default=os.environ.get("TUMBLE", os.path.join(ROOT, "target/release/tumble")))
    ap.add_argument("--n", type=int, default=64, help="instances per model (first N of bench/.data/*_128.jsonl)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--size", default="small", choices=["small", "large"])
    ap.add_argument("--models", default="treelstm,birnn,stackrnn")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--json", help="write the per-parameter errors here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    data = os.path.join(HERE, ".data")
    report, worst_all = {}, 0.0
    with tempfile.TemporaryDirectory(prefix="grad_vs_torch.") as tmp:
        for kind in a.models.split(","):
            model = f"{kind}_{a.size}"
            text = open(os.path.join(ROOT, "models", model + ".rly")).read()
            if kind == "birnn":
                text = birnn_edit(text)
            if kind == "stackrnn":
                text = stackrnn_edit(text)
            wrapper = os.path.join(tmp, model + "_loss.rly")
            open(wrapper, "w").write(with_loss(text, LOSSES[kind]))
            lines = [l for l in open(os.path.join(data, INPUTS[kind])) if l.strip()][: a.n]
            inputs = os.path.join(tmp, model + ".jsonl")
            open(inputs, "w").write("".join(lines))
            wpath = os.path.join(data, "weights", f"{model}.seed0.safetensors")
            gpath = os.path.join(tmp, model + ".grad.safetensors")
            cmd = [a.tumble, "grad", wrapper, "--params", wpath, "--inputs", inputs,
                   "--batch", str(a.batch), "--threads", str(a.threads), "-o", gpath]
            t0 = time.time()
            r = subprocess.run(cmd, capture_output=True, text=True)
            t_tumble = time.time() - t0
            if r.returncode != 0:
                print(f"{model}: tumble grad failed:\n{r.stderr}", file=sys.stderr)
                sys.exit(1)
            g_tumble = common.load_safetensors(gpath)
            weights = common.load_safetensors(wpath)
            insts = [common.decode(kind, json.loads(l)) for l in lines]
            t0 = time.time()
            loss64, g64, acts = torch_grad(kind, weights, insts, torch.float64)
            t_torch = time.time() - t0
            _, g32, _ = torch_grad(kind, weights, insts, torch.float32)
            rows = {}
            print(f"\n{model}: {len(insts)} instances, loss {loss64:.6g} (sum over instances), "
                  f"tumble grad --batch {a.batch}: {t_tumble:.2f} s, torch f64 autograd: {t_torch:.2f} s")
            if acts:
                m = min(mg for _, mg in acts)
                print(f"  StackRNN smallest |REDUCE - SHIFT| score margin among the chosen actions (f64): {m:.3g}")
            missing = sorted(set(g64) - set(g_tumble))
            if missing:
                print(f"  !! parameters with no tumble gradient: {missing}")
            print(f"  {'param':<8} {'shape':<14} {'max|g|':>10} {'rel.err tumble':>15} {'rel.err torch f32':>18}")
            for name in weights:
                if name not in g_tumble:
                    continue
                ref = g64[name]
                scale = float(np.abs(ref).max())
                den = scale if scale > 0 else 1.0
                e_t = float(np.abs(g_tumble[name].astype(np.float64) - ref).max()) / den
                e_32 = float(np.abs(g32[name] - ref).max()) / den
                worst_all = max(worst_all, e_t)
                rows[name] = {"shape": list(ref.shape), "max_abs_grad": scale, "rel_err_tumble": e_t,
                              "rel_err_torch_f32": e_32}
                print(f"  {name:<8} {str(tuple(ref.shape)):<14} {scale:>10.3g} {e_t:>15.2e} {e_32:>18.2e}")
            worst = max(r_["rel_err_tumble"] for r_ in rows.values())
            print(f"  max over parameters: {worst:.2e}  ({'OK' if worst <= a.tol else 'FAIL'} at {a.tol:g})")
            report[model] = {"instances": len(insts), "batch": a.batch, "loss": loss64, "params": rows,
                             "max_rel_err": worst}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"\nworst relative error over all models and parameters: {worst_all:.2e} "
          f"({'within' if worst_all <= a.tol else 'OVER'} {a.tol:g})")
    sys.exit(0 if worst_all <= a.tol else 1)


if __name__ == "__main__":
    main()
