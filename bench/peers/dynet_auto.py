#!/usr/bin/env python3
"""DyNet peer with automatic batching (`--dynet-autobatch 1`, set through dynet_config before the
import), written the natural DyNet way: per mini-batch one fresh computation graph holding every
instance's unbatched expressions (column vectors, `W * x + b`), then one forward that DyNet's
autobatcher batches (agenda-based).

Models with tensor-dependent control flow need values in the middle of building the graph; they
are written in lock step across the mini-batch so that each forward still covers every instance:
- StackRNN: one forward per transition step (to read the SHIFT/REDUCE decisions);
- DRNN: two forwards per wave of nodes (topology decisions, then labels);
- Berxit: one forward per layer (exit decisions). Tokens ride in DyNet's batch dimension
  (128 vectors of D) for the dense layers and layer norms; attention reshapes them into (D, 128)
  matrices.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import dynet_config

dynet_config.set(autobatch=1, mem="2048", random_seed=1)
import dynet as dy  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import f32list  # noqa: E402


class Params:
    """DyNet parameters with the values of the safetensors weights (same names)."""

    def __init__(self, weights, lookups=(), mat_lookups=()):
        self.pc = dy.ParameterCollection()
        self.p = {}
        for k, v in weights.items():
            if k in mat_lookups:  # (n, H, H): one flattened column-major matrix per row
                lp = self.pc.add_lookup_parameters((v.shape[0], v.shape[1] * v.shape[2]))
                lp.init_from_array(np.ascontiguousarray(v.transpose(0, 2, 1).reshape(v.shape[0], -1)))
                self.p[k] = lp
            elif k in lookups:
                self.p[k] = self.pc.lookup_parameters_from_numpy(np.ascontiguousarray(v))
            else:
                self.p[k] = self.pc.add_parameters(v.shape, init=dy.NumpyInitializer(v))
        self.shape = {k: v.shape for k, v in weights.items()}

    def __getitem__(self, k):
        return self.p[k]


def treelstm(weights):
    P = Params(weights, lookups=("emb",))
    H = weights["U_f"].shape[0]

    def run(trees):
        dy.renew_cg()
        emb, W_iou, b_iou, U_iou, U_f, b_f = (P[k] for k in ("emb", "W_iou", "b_iou", "U_iou", "U_f", "b_f"))

        def node(n):
            if not n.children:
                iou = dy.affine_transform([b_iou, W_iou, dy.lookup(emb, n.tok)])
                c = dy.cmult(dy.logistic(dy.pick_range(iou, 0, H)), dy.tanh(dy.pick_range(iou, 2 * H, 3 * H)))
                return dy.cmult(dy.logistic(dy.pick_range(iou, H, 2 * H)), dy.tanh(c)), c
            states = [node(ch) for ch in n.children]
            fcs = [dy.cmult(dy.logistic(dy.affine_transform([b_f, U_f, h])), c) for h, c in states]
            h_sum = dy.esum([h for h, _ in states])
            iou = dy.affine_transform([b_iou, U_iou, h_sum])
            c = dy.cmult(dy.logistic(dy.pick_range(iou, 0, H)), dy.tanh(dy.pick_range(iou, 2 * H, 3 * H)))
            c = c + dy.esum(fcs)
            return dy.cmult(dy.logistic(dy.pick_range(iou, H, 2 * H)), dy.tanh(c)), c

        outs = [dy.affine_transform([P["b_out"], P["W_out"], node(t)[0]]) for t in trees]
        v = dy.concatenate_cols(outs).npvalue().reshape(-1, len(trees))
        return [f32list(v[:, k][None, :]) for k in range(len(trees))]

    return run


def mvrnn(weights):
    P = Params(weights, lookups=("emb",), mat_lookups=("mat_emb",))
    H = weights["W"].shape[0]
    last = weights["mat_emb"].shape[0] - 1

    def run(trees):
        dy.renew_cg()
        emb, mat_emb, W, b_W, W_M = (P[k] for k in ("emb", "mat_emb", "W", "b_W", "W_M"))

        def node(n):
            if not n.children:
                return dy.lookup(emb, n.tok), dy.reshape(dy.lookup(mat_emb, min(max(n.tok, 0), last)), (H, H))
            acc = None
            for ch in n.children:
                s = node(ch)
                if acc is None:
                    acc = s
                    continue
                (a, A), (b, B) = acc, s
                p = dy.tanh(dy.affine_transform([b_W, W, dy.concatenate([B * a, A * b])]))
                acc = (p, W_M * dy.concatenate([A, B]))
            return acc

        outs = [dy.affine_transform([P["b_out"], P["W_out"], node(t)[0]]) for t in trees]
        v = dy.concatenate_cols(outs).npvalue().reshape(-1, len(trees))
        return [f32list(v[:, k][None, :]) for k in range(len(trees))]

    return run


def birnn(weights):
    P = Params(weights, lookups=("emb",))
    H = weights["W_h_fwd"].shape[0]

    def run(sents):
        dy.renew_cg()
        emb = P["emb"]

        def rnn(toks, d):
            W_x, W_h, b = P["W_x_" + d], P["W_h_" + d], P["b_" + d]
            h = dy.zeros(H)
            hs = []
            for t in toks:
                h = dy.tanh(dy.affine_transform([b, W_x, dy.lookup(emb, t)]) + W_h * h)
                hs.append(h)
            return hs

        outs = []
        for toks in sents:
            fwd = rnn(toks, "fwd")
            bwd = rnn(toks[::-1], "bwd")[::-1]
            for hf, hb in zip(fwd, bwd):
                outs.append(dy.affine_transform([P["b_out"], P["W_out"], dy.concatenate([hf, hb])]))
        res = [[] for _ in sents]
        if outs:
            cls = np.argmax(dy.concatenate_cols(outs).npvalue().reshape(-1, len(outs)), axis=0).tolist()
            pos = 0
            for k, toks in enumerate(sents):
                res[k] = [[c] for c in cls[pos : pos + len(toks)]]
                pos += len(toks)
        return res

    return run


def nestedrnn(weights):
    P = Params(weights, lookups=("emb",))
    H = weights["W_h"].shape[0]

    def run(insts):
        dy.renew_cg()
        emb, W_x, W_h, b = P["emb"], P["W_x"], P["W_h"], P["b"]
        W_gx, b_gx, W_gh, b_gh = P["W_gx"], P["b_gx"], P["W_gh"], P["b_gh"]
        outs = []
        for seqs in insts:
            h = dy.zeros(H)
            for seq in seqs:
                x = h
                for t in seq:
                    x = dy.tanh(dy.affine_transform([b, W_x, dy.lookup(emb, t)]) + W_h * x)
                gx = dy.affine_transform([b_gx, W_gx, x])
                gh = dy.affine_transform([b_gh, W_gh, h])
                r = dy.logistic(dy.pick_range(gx, 0, H) + dy.pick_range(gh, 0, H))
                z = dy.logistic(dy.pick_range(gx, H, 2 * H) + dy.pick_range(gh, H, 2 * H))
                n = dy.tanh(dy.pick_range(gx, 2 * H, 3 * H) + dy.cmult(r, dy.pick_range(gh, 2 * H, 3 * H)))
                h = dy.cmult(z * -1.0 + 1.0, n) + dy.cmult(z, h)  # (1 - z) n + z h
            outs.append(h)
        v = dy.concatenate_cols(outs).npvalue().reshape(H, len(insts))
        return [f32list(v[:, k][None, :]) for k in range(len(insts))]

    return run


def stackrnn(weights):
    P = Params(weights, lookups=("emb",))
    H = weights["U_t"].shape[0]

    def run(sents):
        dy.renew_cg()
        emb, W_t, U_t, b_t, W_a, b_a, W_c, b_c = (P[k] for k in ("emb", "W_t", "U_t", "b_t", "W_a", "b_a", "W_c", "b_c"))
        zero = dy.zeros(H)
        B = len(sents)
        stacks, pos, actions = [[] for _ in range(B)], [0] * B, [[] for _ in range(B)]
        h = [zero] * B
        while True:
            act = [k for k in range(B) if not (pos[k] == len(sents[k]) and len(stacks[k]) == 1)]
            if not act:
                break
            x0 = {}
            asks = []
            for k in act:
                s0 = stacks[k][-1] if stacks[k] else zero
                x0[k] = dy.lookup(emb, sents[k][pos[k]]) if pos[k] < len(sents[k]) else zero
                h[k] = dy.tanh(W_t * dy.concatenate([s0, x0[k]]) + U_t * h[k] + b_t)
                if pos[k] < len(sents[k]) and len(stacks[k]) >= 2:
                    asks.append(k)
            wants = {}
            if asks:  # one forward for every decision of this step
                sc = dy.concatenate_cols([dy.affine_transform([b_a, W_a, h[k]]) for k in asks]).npvalue()
                wants = dict(zip(asks, np.argmax(sc.reshape(2, len(asks)), axis=0).tolist()))
            for k in act:
                if pos[k] < len(sents[k]) and not wants.get(k, 0):
                    stacks[k].append(x0[k])
                    pos[k] += 1
                    actions[k].append(0)
                else:
                    right, left = stacks[k].pop(), stacks[k].pop()
                    stacks[k].append(dy.tanh(dy.affine_transform([b_c, W_c, dy.concatenate([left, right])])))
                    actions[k].append(1)
        outs = [dy.affine_transform([P["b_out"], P["W_out"], s[0]]) for s in stacks]
        v = dy.concatenate_cols(outs).npvalue().reshape(-1, B)
        return [[f32list(v[:, k][None, :]), actions[k]] for k in range(B)]

    return run


def drnn(weights):
    P = Params(weights, lookups=("label_emb",))
    H = weights["U_a"].shape[0]

    def run(insts):
        dy.renew_cg()
        (label_emb, U_a, U_f, b_pred, W_topo, b_topo, W_label, b_label, v_a, v_f,
         W_anc, b_anc, W_frat, b_frat) = (P[k] for k in (
            "label_emb", "U_a", "U_f", "b_pred", "W_topo", "b_topo", "W_label", "b_label", "v_a", "v_f",
            "W_anc", "b_anc", "W_frat", "b_frat"))
        roots = [[] for _ in insts]
        pend = [(dy.inputTensor(lat.reshape(-1)), dy.zeros(H), d, 1, mw, roots[k])
                for k, (lat, d, mw) in enumerate(insts)]
        while pend:
            hs = [dy.tanh(U_a * p[0] + U_f * p[1] + b_pred) for p in pend]
            pr = dy.concatenate_cols([dy.logistic(dy.affine_transform([b_topo, W_topo, h])) for h in hs])
            pv = pr.npvalue().reshape(2, len(pend))  # forward 1: topology decisions
            hc, hsb = (pv[0] > 0.5), (pv[1] > 0.5)
            sc = [dy.affine_transform([b_label, W_label, h]) + v_a.expr() * float(hc[j]) + v_f.expr() * float(hsb[j])
                  for j, h in enumerate(hs)]
            labels = np.argmax(dy.concatenate_cols(sc).npvalue().reshape(-1, len(pend)), axis=0).tolist()
            nxt = []
            for j, p in enumerate(pend):
                t = {"Rose": [[labels[j]], []]}
                p[5].append(t)
                x = dy.lookup(label_emb, labels[j])
                if p[2] > 1 and hc[j]:
                    ca = dy.tanh(dy.affine_transform([b_anc, W_anc, dy.concatenate([x, p[0]])]))
                    nxt.append((ca, dy.zeros(H), p[2] - 1, p[4], p[4], t["Rose"][1]))
                if p[3] > 1 and hsb[j]:
                    nf = dy.tanh(dy.affine_transform([b_frat, W_frat, dy.concatenate([x, p[1]])]))
                    nxt.append((p[0], nf, p[2], p[3] - 1, p[4], p[5]))
            pend = nxt
        return [r[0] for r in roots]

    return run


def berxit(weights):
    lookups = ("word_emb", "pos_emb", "type_emb")
    P = Params(weights, lookups=lookups)
    L = sum(1 for k in weights if k.endswith("_Wq"))
    D = weights["pos_emb"].shape[1]
    nh = D // 64

    def ln(x, g, b):  # x: (D,) batched over tokens
        mu = dy.mean_elems(x)
        xc = x - mu
        var = dy.mean_elems(dy.square(xc))
        return dy.cmult(g, dy.cdiv(xc, dy.sqrt(var + 1e-12))) + b

    def layer(x, l, S):
        p = lambda k: P[f"l{l}_{k}"]  # noqa: E731
        q = dy.reshape(dy.affine_transform([p("bq"), p("Wq"), x]), (D, S), batch_size=1)
        k = dy.reshape(dy.affine_transform([p("bk"), p("Wk"), x]), (D, S), batch_size=1)
        v = dy.reshape(dy.affine_transform([p("bv"), p("Wv"), x]), (D, S), batch_size=1)
        heads = []
        for hh in range(nh):
            qh, kh, vh = (dy.pick_range(m, hh * 64, (hh + 1) * 64) for m in (q, k, v))
            probs_t = dy.softmax(dy.transpose(kh) * qh * 0.125, d=0)  # (keys, queries)
            heads.append(vh * probs_t)  # (64, queries)
        ctx = dy.reshape(dy.concatenate(heads), (D,), batch_size=S)
        a = ln(dy.affine_transform([p("bo"), p("Wo"), ctx]) + x, p("ln1_g"), p("ln1_b"))
        u = dy.affine_transform([p("b1"), p("W1"), a])
        g = dy.cmult(u * 0.5, dy.tanh((u + dy.cmult(u, dy.cmult(u, u)) * 0.044715) * 0.7978845608) + 1.0)
        return ln(dy.affine_transform([p("b2"), p("W2"), g]) + a, p("ln2_g"), p("ln2_b"))

    def run(insts):
        # One graph per layer: the layer's input values come in as batched input tensors, so that
        # DyNet's forward memory holds one layer of activations, not the whole network's. Each
        # instance is a batch of its own tokens (its own length: variable-length Berxit too);
        # DyNet's autobatching joins what it can across instances.
        dy.renew_cg()
        lens = [len(toks) for toks, _ in insts]
        xs = []
        for toks, _ in insts:
            S = len(toks)
            e = dy.lookup_batch(P["word_emb"], toks.tolist()) + dy.lookup_batch(P["pos_emb"], list(range(S)))
            e = e + dy.lookup(P["type_emb"], 0)
            xs.append(ln(e, P["emb_ln_g"], P["emb_ln_b"]))
        flat = dy.concatenate_to_batch(xs).npvalue().reshape(D, sum(lens))
        offs = np.cumsum([0] + lens)
        vals = {k: flat[:, offs[k] : offs[k + 1]] for k in range(len(insts))}
        alive = list(range(len(insts)))
        out = [None] * len(insts)
        for l in range(1, L + 1):
            dy.renew_cg()
            xs = {k: layer(dy.inputTensor(vals[k], batched=True), l, lens[k]) for k in alive}
            logits = []
            for k in alive:
                cls = dy.pick_batch_elem(xs[k], 0)
                pooled = dy.tanh(dy.affine_transform([P[f"l{l}_exit_bp"], P[f"l{l}_exit_Wp"], cls]))
                logits.append(dy.affine_transform([P[f"l{l}_exit_b"], P[f"l{l}_exit_W"], pooled]))
            lv = dy.concatenate_cols(logits).npvalue().reshape(2, len(alive))  # one forward per layer
            keep = []
            for j, k in enumerate(alive):
                z = lv[:, j].astype(np.float32)
                e = np.exp(z - z.max())
                conf = np.float32((e / e.sum()).max()) > np.float32(insts[k][1])
                if conf or l == L:
                    out[k] = [f32list(z[None, :]), l]
                else:
                    keep.append(k)
                    vals[k] = xs[k].npvalue().reshape(D, lens[k])  # computed by the forward above
            alive = keep
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
    return MODELS[common.kind_of(model)](weights)


if __name__ == "__main__":
    common.main(build, "dynet_auto")
