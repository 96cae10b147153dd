#!/usr/bin/env python3
"""PyTorch batched by hand: what an expert writes to batch each model across a mini-batch.

- TreeLSTM: nodes of all trees grouped by height (leaves first); one launch sequence per level,
  child sums with index_add_.
- MV-RNN: the left-to-right compositions of all trees grouped by dependency depth; batched
  bmm for the matrix-vector products.
- BiRNN: padding + packing (pack_padded_sequence) into torch's fused bidirectional nn.RNN, then
  one classifier GEMM over all tokens.
- NestedRNN: outer steps in lock step across instances; at each outer step the inner sequences of
  the active instances are packed into one nn.RNN call started from their outer states; one
  batched GRU cell.
- StackRNN: transition steps in lock step across instances (every instance takes 2n - 1 steps):
  one tracker GEMM, one action GEMM (one host read of the decisions per step) and one
  composition GEMM per step.
- DRNN: wave-front generation across instances: every node whose inputs are known is computed
  in one batched call, then its children's and next siblings' input states in two batched calls.
- Berxit: the active instances' hidden states stacked (B, 128, D); each layer and exit head runs
  batched; exited instances leave the batch.
All seven models are batched; none falls back to the eager code.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import f32list  # noqa: E402
from torch_eager import T, bert_layers, gelu  # noqa: E402


def treelstm(w):
    emb, W_iou, b_iou, U_iou = w["emb"], w["W_iou"], w["b_iou"], w["U_iou"]
    U_f, b_f, W_out, b_out = w["U_f"], w["b_f"], w["W_out"], w["b_out"]
    H = U_f.shape[0]

    def run(trees):
        # number nodes; group by height
        levels: dict[int, list] = {}
        nodes = []

        def visit(n):
            for c in n.children:
                visit(c)
            n.idx = len(nodes)
            nodes.append(n)
            levels.setdefault(n.height, []).append(n)

        for t in trees:
            visit(t)
        h_all = torch.empty(len(nodes), H)
        c_all = torch.empty(len(nodes), H)
        leaves = levels[0]
        idx = torch.tensor([n.idx for n in leaves])
        i, o, u = F.linear(emb[torch.tensor([n.tok for n in leaves])], W_iou, b_iou).chunk(3, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u)
        h_all[idx] = torch.sigmoid(o) * torch.tanh(c)
        c_all[idx] = c
        for height in range(1, max(levels) + 1):
            lv = levels.get(height)
            if not lv:
                continue
            child = torch.tensor([ch.idx for n in lv for ch in n.children])
            parent = torch.tensor([k for k, n in enumerate(lv) for _ in n.children])
            hc = h_all[child]
            fc = torch.sigmoid(F.linear(hc, U_f, b_f)) * c_all[child]
            h_sum = torch.zeros(len(lv), H).index_add_(0, parent, hc)
            fc_sum = torch.zeros(len(lv), H).index_add_(0, parent, fc)
            i, o, u = F.linear(h_sum, U_iou, b_iou).chunk(3, dim=1)
            c = torch.sigmoid(i) * torch.tanh(u) + fc_sum
            idx = torch.tensor([n.idx for n in lv])
            h_all[idx] = torch.sigmoid(o) * torch.tanh(c)
            c_all[idx] = c
        roots = torch.tensor([t.idx for t in trees])
        return [f32list(r) for r in F.linear(h_all[roots], W_out, b_out).unsqueeze(1)]

    return run


def mvrnn(w):
    emb, mat_emb, W, b_W, W_M = w["emb"], w["mat_emb"], w["W"], w["b_W"], w["W_M"]
    W_out, b_out = w["W_out"], w["b_out"]
    last = mat_emb.shape[0] - 1
    H = W.shape[0]

    def run(trees):
        # slots: leaves first, then one slot per composition; ops grouped by depth
        leaves, ops = [], {}  # ops: depth -> [(left slot, right slot, out slot)]
        nslots = [0]

        def visit(n):  # -> (slot, depth)
            if not n.children:
                s = nslots[0]
                nslots[0] += 1
                leaves.append((s, n.tok))
                return s, 0
            acc = None
            for ch in n.children:
                r = visit(ch)
                if acc is None:
                    acc = r
                    continue
                s = nslots[0]
                nslots[0] += 1
                d = 1 + max(acc[1], r[1])
                ops.setdefault(d, []).append((acc[0], r[0], s))
                acc = (s, d)
            return acc

        roots = [visit(t)[0] for t in trees]
        vec = torch.empty(nslots[0], H)
        mat = torch.empty(nslots[0], H, H)
        ls = torch.tensor([s for s, _ in leaves])
        toks = [t for _, t in leaves]
        vec[ls] = emb[torch.tensor(toks)]
        mat[ls] = mat_emb[torch.tensor([min(max(t, 0), last) for t in toks])]
        for d in sorted(ops):
            l, r, o = (torch.tensor(x) for x in zip(*ops[d]))
            a, A, b, B = vec[l], mat[l], vec[r], mat[r]
            ba = torch.bmm(B, a.unsqueeze(2)).squeeze(2)  # (B a) = dense(a, B)
            ab = torch.bmm(A, b.unsqueeze(2)).squeeze(2)
            vec[o] = torch.tanh(F.linear(torch.cat([ba, ab], dim=1), W, b_W))
            mat[o] = torch.matmul(W_M, torch.cat([A, B], dim=1))
        return [f32list(r) for r in F.linear(vec[torch.tensor(roots)], W_out, b_out).unsqueeze(1)]

    return run


def birnn(w):
    H = w["W_h_fwd"].shape[0]
    rnn = torch.nn.RNN(H, H, nonlinearity="tanh", bias=True, batch_first=True, bidirectional=True)
    with torch.no_grad():
        rnn.weight_ih_l0.copy_(w["W_x_fwd"])
        rnn.weight_hh_l0.copy_(w["W_h_fwd"])
        rnn.bias_ih_l0.copy_(w["b_fwd"])
        rnn.bias_hh_l0.zero_()
        rnn.weight_ih_l0_reverse.copy_(w["W_x_bwd"])
        rnn.weight_hh_l0_reverse.copy_(w["W_h_bwd"])
        rnn.bias_ih_l0_reverse.copy_(w["b_bwd"])
        rnn.bias_hh_l0_reverse.zero_()
    emb, W_out, b_out = w["emb"], w["W_out"], w["b_out"]

    def run(sents):
        lens = [len(s) for s in sents]
        nz = [k for k, n in enumerate(lens) if n]
        out = [[] for _ in sents]
        if not nz:
            return out
        Tmax = max(lens)
        ids = torch.zeros(len(nz), Tmax, dtype=torch.long)
        for r, k in enumerate(nz):
            ids[r, : lens[k]] = torch.tensor(sents[k])
        # pack_padded_sequence takes its lengths on the CPU, wherever the data is.
        packed = pack_padded_sequence(emb[ids], torch.tensor([lens[k] for k in nz], device="cpu"),
                                      batch_first=True,
                                      enforce_sorted=False)
        hs, _ = pad_packed_sequence(rnn(packed)[0], batch_first=True)  # (B, Tmax, 2H)
        mask = torch.arange(Tmax)[None, :] < torch.tensor([lens[k] for k in nz])[:, None]
        classes = torch.argmax(F.linear(hs[mask], W_out, b_out), dim=1).tolist()
        pos = 0
        for k in nz:
            out[k] = [[c] for c in classes[pos : pos + lens[k]]]
            pos += lens[k]
        return out

    return run


def nestedrnn(w):
    emb, W_x, W_h, b = w["emb"], w["W_x"], w["W_h"], w["b"]
    H = W_h.shape[0]
    inner = torch.nn.RNN(H, H, nonlinearity="tanh", batch_first=True)
    gru = torch.nn.GRUCell(H, H)
    with torch.no_grad():
        inner.weight_ih_l0.copy_(W_x)
        inner.weight_hh_l0.copy_(W_h)
        inner.bias_ih_l0.copy_(b)
        inner.bias_hh_l0.zero_()
        gru.weight_ih.copy_(w["W_gx"])
        gru.bias_ih.copy_(w["b_gx"])
        gru.weight_hh.copy_(w["W_gh"])
        gru.bias_hh.copy_(w["b_gh"])

    def run(insts):
        B = len(insts)
        h = torch.zeros(B, H)
        steps = max((len(s) for s in insts), default=0)
        for t in range(steps):
            act = [k for k in range(B) if len(insts[k]) > t]
            seqs = [insts[k][t] for k in act]
            x = h[act].clone()  # inner final state; an empty inner sequence leaves the outer state
            ne = [r for r, s in enumerate(seqs) if s]
            if ne:
                lens = torch.tensor([len(seqs[r]) for r in ne], device="cpu")
                ids = torch.zeros(len(ne), int(lens.max()), dtype=torch.long)
                for j, r in enumerate(ne):
                    ids[j, : len(seqs[r])] = torch.tensor(seqs[r])
                packed = pack_padded_sequence(emb[ids], lens, batch_first=True, enforce_sorted=False)
                _, hn = inner(packed, h[[act[r] for r in ne]].unsqueeze(0))
                x[ne] = hn[0]
            h[act] = gru(x, h[act])
        return [f32list(r) for r in h.unsqueeze(1)]

    return run


def stackrnn(w):
    emb, W_t, U_t, b_t = w["emb"], w["W_t"], w["U_t"], w["b_t"]
    W_a, b_a, W_c, b_c, W_out, b_out = w["W_a"], w["b_a"], w["W_c"], w["b_c"], w["W_out"], w["b_out"]
    H = U_t.shape[0]

    def run(sents):
        B = len(sents)
        zero = torch.zeros(1, H)
        stacks = [[] for _ in range(B)]
        pos = [0] * B
        actions = [[] for _ in range(B)]
        h = torch.zeros(B, H)
        words = [emb[torch.tensor(s)] for s in sents]  # (n, H) per instance
        for step in range(max(2 * len(s) - 1 for s in sents)):
            act = [k for k in range(B) if not (pos[k] == len(sents[k]) and len(stacks[k]) == 1)]
            if not act:
                break
            s0 = torch.cat([stacks[k][-1] if stacks[k] else zero for k in act])
            x0 = torch.cat([words[k][pos[k] : pos[k] + 1] if pos[k] < len(sents[k]) else zero for k in act])
            ha = torch.tanh(F.linear(torch.cat([s0, x0], dim=1), W_t) + F.linear(h[act], U_t) + b_t)
            h[act] = ha
            free = [j for j, k in enumerate(act) if pos[k] < len(sents[k]) and len(stacks[k]) >= 2]
            wants = {}
            if free:
                dec = torch.argmax(F.linear(ha[free], W_a, b_a), dim=1).tolist()
                wants = dict(zip(free, dec))
            red = []
            for j, k in enumerate(act):
                if pos[k] < len(sents[k]) and not wants.get(j, 0):
                    stacks[k].append(x0[j : j + 1])
                    pos[k] += 1
                    actions[k].append(0)
                else:
                    red.append(k)
                    actions[k].append(1)
            if red:
                lr = torch.cat([torch.cat([stacks[k][-2], stacks[k][-1]], dim=1) for k in red])
                p = torch.tanh(F.linear(lr, W_c, b_c))
                for j, k in enumerate(red):
                    del stacks[k][-2:]
                    stacks[k].append(p[j : j + 1])
        logits = F.linear(torch.cat([s[0] for s in stacks]), W_out, b_out)
        return [[f32list(logits[k : k + 1]), actions[k]] for k in range(B)]

    return run


def drnn(w):
    label_emb, U_a, U_f, b_pred = w["label_emb"], w["U_a"], w["U_f"], w["b_pred"]
    W_topo, b_topo, W_label, b_label, v_a, v_f = (
        w["W_topo"], w["b_topo"], w["W_label"], w["b_label"], w["v_a"], w["v_f"])
    W_anc, b_anc, W_frat, b_frat = w["W_anc"], w["b_anc"], w["W_frat"], w["b_frat"]
    H = U_a.shape[0]

    def run(insts):
        # a pending node: (h_a, h_f, depth, width, max_width, list to append its tree to)
        roots = [[] for _ in insts]
        pend = [(common.to_device(lat), torch.zeros(1, H), d, 1, mw, roots[k])
                for k, (lat, d, mw) in enumerate(insts)]
        while pend:
            ha = torch.cat([p[0] for p in pend])
            hf = torch.cat([p[1] for p in pend])
            h = torch.tanh(F.linear(ha, U_a) + F.linear(hf, U_f) + b_pred)
            pr = torch.sigmoid(F.linear(h, W_topo, b_topo))
            hc, hs = pr[:, 0] > 0.5, pr[:, 1] > 0.5
            scores = F.linear(h, W_label, b_label) + (hc.float()[:, None] * v_a + hs.float()[:, None] * v_f)
            labels = torch.argmax(scores, dim=1)
            lab, hcl, hsl = labels.tolist(), hc.tolist(), hs.tolist()
            kids = [j for j, p in enumerate(pend) if p[2] > 1 and hcl[j]]
            sibs = [j for j, p in enumerate(pend) if p[3] > 1 and hsl[j]]
            trees = []
            for j, p in enumerate(pend):
                t = {"Rose": [[lab[j]], []]}
                p[5].append(t)  # siblings are appended in order: each waits for its elder
                trees.append(t)
            nxt = []
            if kids:
                x = label_emb[labels[kids]]
                ca = torch.tanh(F.linear(torch.cat([x, ha[kids]], dim=1), W_anc, b_anc))
                for r, j in enumerate(kids):
                    p = pend[j]
                    nxt.append((ca[r : r + 1], torch.zeros(1, H), p[2] - 1, p[4], p[4], trees[j]["Rose"][1]))
            if sibs:
                x = label_emb[labels[sibs]]
                nf = torch.tanh(F.linear(torch.cat([x, hf[sibs]], dim=1), W_frat, b_frat))
                for r, j in enumerate(sibs):
                    p = pend[j]
                    nxt.append((ha[j : j + 1], nf[r : r + 1], p[2], p[3] - 1, p[4], p[5]))
            pend = nxt
        return [r[0] for r in roots]

    return run


def berxit(w):
    layers = bert_layers(w)
    D = w["pos_emb"].shape[1]
    nh = D // 64

    def layer(x, p):
        B, S, _ = x.shape
        q = F.linear(x, p["Wq"], p["bq"]).reshape(B, S, nh, 64).transpose(1, 2)
        k = F.linear(x, p["Wk"], p["bk"]).reshape(B, S, nh, 64).transpose(1, 2)
        v = F.linear(x, p["Wv"], p["bv"]).reshape(B, S, nh, 64).transpose(1, 2)
        probs = torch.softmax((q @ k.transpose(2, 3)) * 0.125, dim=-1)
        ctx = (probs @ v).transpose(1, 2).reshape(B, S, D)
        a = F.layer_norm(F.linear(ctx, p["Wo"], p["bo"]) + x, (D,), p["ln1_g"], p["ln1_b"], eps=1e-12)
        y = F.linear(gelu(F.linear(a, p["W1"], p["b1"])), p["W2"], p["b2"]) + a
        return F.layer_norm(y, (D,), p["ln2_g"], p["ln2_b"], eps=1e-12)

    def run(insts):
        toks = common.to_device(np.stack([t for t, _ in insts]))
        S = toks.shape[1]
        th = torch.tensor([t for _, t in insts], dtype=torch.float32)
        x = w["word_emb"][toks] + w["pos_emb"][:S] + w["type_emb"][0]
        x = F.layer_norm(x, (D,), w["emb_ln_g"], w["emb_ln_b"], eps=1e-12)
        alive = list(range(len(insts)))
        out = [None] * len(insts)
        for l, p in enumerate(layers, start=1):
            x = layer(x, p)
            logits = F.linear(torch.tanh(F.linear(x[:, 0], p["exit_Wp"], p["exit_bp"])), p["exit_W"], p["exit_b"])
            done = (torch.softmax(logits, dim=-1).max(dim=-1).values > th[alive]).tolist()
            keep = []
            for j, k in enumerate(alive):
                if done[j] or l == len(layers):
                    out[k] = [f32list(logits[j : j + 1]), l]
                else:
                    keep.append(j)
            if len(keep) < len(alive):
                alive = [alive[j] for j in keep]
                x = x[keep]
            if not alive:
                break
        return out

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
    fn = MODELS[common.kind_of(model)](T(weights))

    def run_batch(insts):
        with torch.inference_mode():
            return fn(insts)

    return run_batch


if __name__ == "__main__":
    common.main(build, "torch_batched")
