#!/usr/bin/env python3
"""PyTorch eager peer: each model written the way a user writes it, one instance at a time,
recursion over the tree / loop over the sequence, no batching across instances or nodes.

The math follows models/README.md and models/*.rly exactly (row vectors, weights stored (out, in),
so `nn.dense(x, W)` is `F.linear(x, W)`). Every model of the zoo is here.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import f32list  # noqa: E402

if common.DEVICE != "cpu":
    # Factories (zeros, tensor, arange) make their tensors on the GPU too.
    torch.set_default_device(common.DEVICE)


def T(weights):
    return {k: common.to_device(v) for k, v in weights.items()}


def treelstm(w):
    emb, W_iou, b_iou, U_iou = w["emb"], w["W_iou"], w["b_iou"], w["U_iou"]
    U_f, b_f, W_out, b_out = w["U_f"], w["b_f"], w["W_out"], w["b_out"]

    def node(n):
        if not n.children:
            i, o, u = F.linear(emb[n.tok : n.tok + 1], W_iou, b_iou).chunk(3, dim=1)
            c = torch.sigmoid(i) * torch.tanh(u)
            return torch.sigmoid(o) * torch.tanh(c), c
        states = [node(ch) for ch in n.children]
        h_sum, fc_sum = None, None
        for h, c in states:
            fc = torch.sigmoid(F.linear(h, U_f, b_f)) * c
            h_sum = h if h_sum is None else h_sum + h
            fc_sum = fc if fc_sum is None else fc_sum + fc
        i, o, u = F.linear(h_sum, U_iou, b_iou).chunk(3, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u) + fc_sum
        return torch.sigmoid(o) * torch.tanh(c), c

    def run(tree):
        h, _ = node(tree)
        return f32list(F.linear(h, W_out, b_out))

    return run


def mvrnn(w):
    emb, mat_emb, W, b_W, W_M = w["emb"], w["mat_emb"], w["W"], w["b_W"], w["W_M"]
    W_out, b_out = w["W_out"], w["b_out"]
    last = mat_emb.shape[0] - 1

    def node(n):
        if not n.children:
            return emb[n.tok : n.tok + 1], mat_emb[min(max(n.tok, 0), last)]
        acc = None
        for ch in n.children:
            s = node(ch)
            if acc is None:
                acc = s
                continue
            (a, A), (b, B) = acc, s
            p = torch.tanh(F.linear(torch.cat([a @ B.T, b @ A.T], dim=1), W, b_W))
            acc = (p, W_M @ torch.cat([A, B], dim=0))
        return acc

    def run(tree):
        p, _ = node(tree)
        return f32list(F.linear(p, W_out, b_out))

    return run


def birnn(w):
    emb, W_out, b_out = w["emb"], w["W_out"], w["b_out"]
    H = w["W_h_fwd"].shape[0]

    def rnn(toks, W_x, W_h, b):
        h = torch.zeros(1, H)
        hs = []
        for t in toks:
            h = torch.tanh(F.linear(emb[t : t + 1], W_x, b) + F.linear(h, W_h))
            hs.append(h)
        return hs

    def run(toks):
        fwd = rnn(toks, w["W_x_fwd"], w["W_h_fwd"], w["b_fwd"])
        bwd = rnn(toks[::-1], w["W_x_bwd"], w["W_h_bwd"], w["b_bwd"])[::-1]
        out = []
        for hf, hb in zip(fwd, bwd):
            logits = F.linear(torch.cat([hf, hb], dim=1), W_out, b_out)
            out.append([int(torch.argmax(logits, dim=1).item())])
        return out

    return run


def nestedrnn(w):
    emb, W_x, W_h, b = w["emb"], w["W_x"], w["W_h"], w["b"]
    W_gx, b_gx, W_gh, b_gh = w["W_gx"], w["b_gx"], w["W_gh"], w["b_gh"]
    H = W_h.shape[0]

    def gru(x, h):
        xr, xz, xn = F.linear(x, W_gx, b_gx).chunk(3, dim=1)
        hr, hz, hn = F.linear(h, W_gh, b_gh).chunk(3, dim=1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h

    def run(seqs):
        h = torch.zeros(1, H)
        for seq in seqs:
            inner = h
            for t in seq:
                inner = torch.tanh(F.linear(emb[t : t + 1], W_x, b) + F.linear(inner, W_h))
            h = gru(inner, h)
        return f32list(h)

    return run


def stackrnn(w):
    emb, W_t, U_t, b_t = w["emb"], w["W_t"], w["U_t"], w["b_t"]
    W_a, b_a, W_c, b_c, W_out, b_out = w["W_a"], w["b_a"], w["W_c"], w["b_c"], w["W_out"], w["b_out"]
    H = U_t.shape[0]

    def run(toks):
        zero = torch.zeros(1, H)
        stack, i, n, h, actions = [], 0, len(toks), zero, []
        while not (i == n and len(stack) == 1):
            s0 = stack[-1] if stack else zero
            x0 = emb[toks[i] : toks[i] + 1] if i < n else zero
            h = torch.tanh(F.linear(torch.cat([s0, x0], dim=1), W_t) + F.linear(h, U_t) + b_t)
            if i < n:
                reduce = len(stack) >= 2 and int(torch.argmax(F.linear(h, W_a, b_a), dim=1).item()) == 1
            else:
                reduce = True
            if reduce:
                right, left = stack.pop(), stack.pop()
                stack.append(torch.tanh(F.linear(torch.cat([left, right], dim=1), W_c, b_c)))
                actions.append(1)
            else:
                stack.append(x0)
                i += 1
                actions.append(0)
        return [f32list(F.linear(stack[0], W_out, b_out)), actions]

    return run


def drnn(w):
    label_emb, U_a, U_f, b_pred = w["label_emb"], w["U_a"], w["U_f"], w["b_pred"]
    W_topo, b_topo, W_label, b_label, v_a, v_f = (
        w["W_topo"], w["b_topo"], w["W_label"], w["b_label"], w["v_a"], w["v_f"])
    W_anc, b_anc, W_frat, b_frat = w["W_anc"], w["b_anc"], w["W_frat"], w["b_frat"]
    H = U_a.shape[0]

    def rnn(label, h, W, b):
        return torch.tanh(F.linear(torch.cat([label_emb[label : label + 1], h], dim=1), W, b))

    def gen(h_a, h_f, depth, width, max_width):
        h = torch.tanh(F.linear(h_a, U_a) + F.linear(h_f, U_f) + b_pred)
        p = torch.sigmoid(F.linear(h, W_topo, b_topo)).reshape(2)
        has_children, has_sibling = p[0] > 0.5, p[1] > 0.5
        scores = F.linear(h, W_label, b_label) + (has_children.float() * v_a + has_sibling.float() * v_f)
        label = int(torch.argmax(scores, dim=1).item())
        children = []
        if depth > 1 and bool(has_children):
            children = gen(rnn(label, h_a, W_anc, b_anc), torch.zeros(1, H), depth - 1, max_width, max_width)
        siblings = []
        if width > 1 and bool(has_sibling):
            siblings = gen(h_a, rnn(label, h_f, W_frat, b_frat), depth, width - 1, max_width)
        return [{"Rose": [[label], children]}] + siblings

    def run(inst):
        latent, max_depth, max_width = inst
        return gen(common.to_device(latent), torch.zeros(1, H), max_depth, 1, max_width)[0]

    return run


def bert_layers(w):
    L = sum(1 for k in w if k.endswith("_Wq"))
    return [{k[len(f"l{l}_"):]: v for k, v in w.items() if k.startswith(f"l{l}_")} for l in range(1, L + 1)]


def gelu(u):
    return 0.5 * u * (1 + torch.tanh(0.7978845608 * (u + 0.044715 * (u * u * u))))


def berxit(w):
    layers = bert_layers(w)
    D = w["pos_emb"].shape[1]
    nh = D // 64

    def layer(x, p):
        S = x.shape[0]
        q = F.linear(x, p["Wq"], p["bq"]).reshape(S, nh, 64).transpose(0, 1)
        k = F.linear(x, p["Wk"], p["bk"]).reshape(S, nh, 64).transpose(0, 1)
        v = F.linear(x, p["Wv"], p["bv"]).reshape(S, nh, 64).transpose(0, 1)
        probs = torch.softmax((q @ k.transpose(1, 2)) * 0.125, dim=-1)
        ctx = (probs @ v).transpose(0, 1).reshape(S, D)
        a = F.layer_norm(F.linear(ctx, p["Wo"], p["bo"]) + x, (D,), p["ln1_g"], p["ln1_b"], eps=1e-12)
        y = F.linear(gelu(F.linear(a, p["W1"], p["b1"])), p["W2"], p["b2"]) + a
        return F.layer_norm(y, (D,), p["ln2_g"], p["ln2_b"], eps=1e-12)

    def run(inst):
        toks, threshold = inst
        S = len(toks)
        x = w["word_emb"][common.to_device(toks)] + w["pos_emb"][:S] + w["type_emb"][0]
        x = F.layer_norm(x, (D,), w["emb_ln_g"], w["emb_ln_b"], eps=1e-12)
        for l, p in enumerate(layers, start=1):
            x = layer(x, p)
            pooled = torch.tanh(F.linear(x[0:1], p["exit_Wp"], p["exit_bp"]))
            logits = F.linear(pooled, p["exit_W"], p["exit_b"])
            if l == len(layers) or float(torch.softmax(logits, dim=-1).max()) > threshold:
                return [f32list(logits), l]

    return run


MODELS = {
    "treelstm": treelstm,
    "mvrnn": mvrnn,
    "birnn": birnn,
    "nestedrnn": nestedrnn,
    "stackrnn": stackrnn,
    "drnn": drnn,
    "berxit": berxit,
}


def build(model, weights):
    one = MODELS[common.kind_of(model)](T(weights))

    def run_batch(insts):
        with torch.inference_mode():
            return [one(x) for x in insts]

    return run_batch


if __name__ == "__main__":
    common.main(build, "torch_eager")
