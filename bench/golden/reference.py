"""Independent numpy reference implementations of tumble's zoo models.

Written from the equations and Relay code in models/*.rly and models/README.md only (not from
tumble's Rust sources), to check tumble's outputs. Only numpy is needed.

Every model takes a weights dict (name -> float32 ndarray, as read by `load_safetensors`) and one
decoded instance (the JSON object of one line of a .jsonl file) and returns `@main`'s return value
encoded as tumble encodes it in JSON: tensors as nested lists, `List[T]` as a list. Sizes (H, E,
vocabulary, number of word matrices) are taken from the weights, so the same code serves the small
and the large variant of each model.

Arithmetic is float64 (weights converted from their float32 values); results are rounded to float32
at the end, so that they can be compared with tumble's float32 outputs within a float32 tolerance.
"""

from __future__ import annotations

import json
import struct

import numpy as np

# ---------------------------------------------------------------------------------------------
# safetensors


_DTYPES = {
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}


def load_safetensors(path: str) -> dict[str, np.ndarray]:
    """Reads a safetensors file by hand: u64 LE header length, JSON header, raw LE data."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - start != count * dt.itemsize:
            raise ValueError(f"{path}: tensor {name}: {end - start} bytes for shape {shape}")
        arr = np.frombuffer(blob, dtype=dt, count=count, offset=base + start).reshape(shape)
        out[name] = arr.copy()
    return out


# ---------------------------------------------------------------------------------------------
# helpers


def _f64(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def dense(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Relay nn.dense: x Wᵀ, W stored (out, in)."""
    return x @ w.T


def _token(t) -> int:
    """A `Tensor[(1), int32]` token as JSON: `[id]`."""
    if isinstance(t, list):
        if len(t) != 1:
            raise ValueError(f"token tensor must have shape (1), got {t!r}")
        t = t[0]
    return int(t)


def _rose(tree) -> tuple[int, list]:
    """Decodes `{"Rose": [[id], [children...]]}` into (id, children)."""
    if not isinstance(tree, dict) or list(tree.keys()) != ["Rose"]:
        raise ValueError(f"expected a Rose node, got {str(tree)[:80]}")
    value, children = tree["Rose"]
    return _token(value), children


def _f32_list(x: np.ndarray) -> list:
    """Rounds to float32 and converts to nested lists of Python floats (exactly the f32 values)."""
    return np.asarray(x, dtype=np.float32).astype(np.float64).tolist()


def _embed(emb: np.ndarray, tok: int) -> np.ndarray:
    """take(%emb, [tok], axis=0): the (1, E) row. Out-of-range ids are an error here."""
    if not 0 <= tok < emb.shape[0]:
        raise IndexError(f"token id {tok} out of range for embedding table of {emb.shape[0]} rows")
    return emb[tok : tok + 1]


# ---------------------------------------------------------------------------------------------
# TreeLSTM (child-sum, Tai et al. 2015)


def treelstm(weights: dict[str, np.ndarray], instance: dict) -> list:
    w = _f64(weights)
    emb, W_iou, b_iou, U_iou = w["emb"], w["W_iou"], w["b_iou"], w["U_iou"]
    U_f, b_f, W_out, b_out = w["U_f"], w["b_f"], w["W_out"], w["b_out"]

    def gates(pre):
        i, o, u = np.split(pre, 3, axis=1)  # stacked i, o, u
        return i, o, u

    def node(tree):
        tok, children = _rose(tree)
        if not children:  # leaf: input from the word embedding, no children
            x = _embed(emb, tok)
            i, o, u = gates(dense(x, W_iou) + b_iou)
            c = sigmoid(i) * np.tanh(u)
            return sigmoid(o) * np.tanh(c), c
        states = [node(ch) for ch in children]
        forgets = [sigmoid(dense(h, U_f) + b_f) * c for h, c in states]
        h_sum, fc_sum = states[0][0], forgets[0]
        for (h, _), fc in zip(states[1:], forgets[1:]):  # foldl(add, hd, tl)
            h_sum = h_sum + h
            fc_sum = fc_sum + fc
        i, o, u = gates(dense(h_sum, U_iou) + b_iou)
        c = sigmoid(i) * np.tanh(u) + fc_sum
        return sigmoid(o) * np.tanh(c), c

    h, _ = node(instance["tree"])
    return _f32_list(dense(h, W_out) + b_out)


# ---------------------------------------------------------------------------------------------
# MV-RNN (Socher et al. 2012)


def mvrnn(weights: dict[str, np.ndarray], instance: dict) -> list:
    w = _f64(weights)
    emb, mat_emb, W, b_W, W_M = w["emb"], w["mat_emb"], w["W"], w["b_W"], w["W_M"]
    W_out, b_out = w["W_out"], w["b_out"]
    n_mats = mat_emb.shape[0]

    def compose(left, right):
        a, A = left
        b, B = right
        # column vectors: p = tanh(W [B a; A b] + b_W); with rows, (B a)ᵀ = a Bᵀ = dense(a, B)
        ba = dense(a, B)
        ab = dense(b, A)
        p = np.tanh(dense(np.concatenate([ba, ab], axis=1), W) + b_W)
        P = W_M @ np.concatenate([A, B], axis=0)  # (H, 2H) @ (2H, H)
        return p, P

    def node(tree):
        tok, children = _rose(tree)
        if not children:
            m = min(max(tok, 0), n_mats - 1)  # take(..., mode="clip")
            return _embed(emb, tok), mat_emb[m]
        states = [node(ch) for ch in children]
        acc = states[0]
        for s in states[1:]:  # left to right: ((c1 c2) c3) ...; one child is that child
            acc = compose(acc, s)
        return acc

    p, _ = node(instance["tree"])
    return _f32_list(dense(p, W_out) + b_out)


# ---------------------------------------------------------------------------------------------
# BiRNN (forward + backward Elman RNN, per-token argmax classifier)


def birnn_logits(weights: dict[str, np.ndarray], instance: dict) -> np.ndarray:
    """The (n, 5) float64 logits, one row per token (before the argmax)."""
    w = _f64(weights)
    emb, W_out, b_out = w["emb"], w["W_out"], w["b_out"]
    toks = [_token(t) for t in instance["tokens"]]
    H = w["W_h_fwd"].shape[0]

    def rnn(seq, W_x, W_h, b):
        h = np.zeros((1, H))
        hs = []
        for t in seq:
            h = np.tanh(dense(_embed(emb, t), W_x) + b + dense(h, W_h))
            hs.append(h)
        return hs

    fwd = rnn(toks, w["W_x_fwd"], w["W_h_fwd"], w["b_fwd"])
    bwd = rnn(toks[::-1], w["W_x_bwd"], w["W_h_bwd"], w["b_bwd"])[::-1]
    if not toks:
        return np.zeros((0, W_out.shape[0]))
    rows = [dense(np.concatenate([hf, hb], axis=1), W_out) + b_out for hf, hb in zip(fwd, bwd)]
    return np.concatenate(rows, axis=0)


def birnn(weights: dict[str, np.ndarray], instance: dict) -> list:
    logits = birnn_logits(weights, instance)
    # argmax(axis=[1]) of each (1, 5) row -> Tensor[(1), int32]; ties: first index
    return [[int(np.argmax(row))] for row in logits]


MODELS = {
    "treelstm": treelstm,
    "mvrnn": mvrnn,
    "birnn": birnn,
}


# ---------------------------------------------------------------------------------------------
# JSON encoding, as tumble writes results: compact, floats as the shortest decimal of the f32


def _jsonable(value):
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("booleans are not expected in these models' outputs")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = np.float32(value)
        if not np.isfinite(f):
            raise ValueError(f"non-finite output value {value!r}")
        # str(np.float32) is the shortest decimal that reads back as this f32; as a Python float
        # it prints (json) as that same decimal or a shorter one for the same f32.
        return float(str(f))
    raise TypeError(f"unexpected value {value!r}")


def to_json(value) -> str:
    """One instance's result as a compact JSON line (no newline)."""
    return json.dumps(_jsonable(value), separators=(",", ":"), allow_nan=False)
