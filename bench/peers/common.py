"""Shared plumbing for the peer implementations (PyTorch eager, PyTorch by hand, DyNet autobatch).

Every peer script defines `build(model, weights) -> run_batch`, where `model` is a zoo stem such as
"treelstm_small", `weights` a dict name -> float32 ndarray read from the safetensors file that
`tumble run --save-params` wrote, and `run_batch(instances) -> list` computes one mini-batch of
decoded instances and returns one result per instance, already encoded the way `tumble run`
encodes `@main`'s result in JSON (tensors as nested lists, lists as lists, a Tree as
{"Rose": [[label], [children...]]}, tuples as lists). Sizes come from the weights, so one code
path serves the small and the large variant of a model.

`main(build, name)` gives every peer the same command line:

    python bench/peers/PEER.py MODEL --params W.safetensors --inputs X.jsonl --batch N [-o OUT]
    python bench/peers/PEER.py --serve        # JSON requests on stdin, one per line

The serve mode keeps one process (and its weight cache) alive, so that bench/run can interleave
points of every engine without paying the interpreter start-up and the weight loading each time.
Timing: wall-clock time from the first mini-batch's start to the last one's end, divided by the
number of mini-batches. Input decoding (JSON -> Python trees/lists) and weight loading are outside
the timed region; converting each result to Python lists (host-side readout) is inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
import traceback

import numpy as np

# ---------------------------------------------------------------------------------------------
# weights and instances

_DT = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "I64": "<i8"}


def load_safetensors(path: str) -> dict:
    """safetensors by hand: u64 LE header size, JSON header, raw little-endian data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        blob = bytearray(f.read())  # writable, so torch.from_numpy shares it without a warning
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = np.dtype(_DT[info["dtype"]])
        a, b = info["data_offsets"]
        shape = tuple(info["shape"])
        arr = np.frombuffer(blob, dtype=dt, count=(b - a) // dt.itemsize, offset=a).reshape(shape)
        out[name] = np.ascontiguousarray(arr, dtype=np.float32 if dt.kind == "f" else dt)
    return out


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tok(t) -> int:
    """A Tensor[(1), int32] token as JSON: [id] (a bare int is accepted too)."""
    return int(t[0]) if isinstance(t, list) else int(t)


class Node:
    """A decoded Rose tree node: `tok` (leaf word, 0 for internal nodes) and `children`."""

    __slots__ = ("tok", "children", "height", "idx")

    def __init__(self, tok_, children):
        self.tok = tok_
        self.children = children
        self.height = 0 if not children else 1 + max(c.height for c in children)
        self.idx = -1


def decode_tree(v) -> Node:
    value, children = v["Rose"]
    return Node(tok(value), [decode_tree(c) for c in children])


def decode(kind: str, inst: dict):
    """One JSON instance -> the peer-side Python value (done before timing starts)."""
    if kind in ("treelstm", "mvrnn"):
        return decode_tree(inst["tree"])
    if kind in ("birnn", "stackrnn"):
        return [tok(t) for t in inst["tokens"]]
    if kind == "nestedrnn":
        return [[tok(t) for t in seq] for seq in inst["seqs"]]
    if kind == "drnn":
        return (
            np.asarray(inst["latent"], dtype=np.float32).reshape(1, -1),
            int(inst["max_depth"]),
            int(inst["max_width"]),
        )
    if kind == "berxit":
        # the threshold is a float32 scalar: compare against its float32 value
        return (np.asarray(inst["tokens"], dtype=np.int64), float(np.float32(inst["threshold"])))
    raise ValueError(f"unknown model kind {kind}")


def kind_of(model: str) -> str:
    return os.path.basename(model).split("_")[0].replace(".rly", "")


# Where the PyTorch peers run: `cpu`, or `cuda` for the GPU comparison (bench/gpu_suite.py).
DEVICE = os.environ.get("TUMBLE_PEER_DEVICE", "cpu")


def to_device(a):
    """A numpy array as a torch tensor on the peers' device."""
    import torch

    return torch.from_numpy(a).to(DEVICE)


def f32list(x) -> list:
    if hasattr(x, "detach"):  # a torch tensor, maybe on the GPU
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=np.float32).astype(np.float64).tolist()


# ---------------------------------------------------------------------------------------------
# comparison (used by bench/run; here so that peers can self-check too)


def compare(got, want, rtol=1e-4, atol=1e-4, path="") -> list[str]:
    """Structural comparison: floats within atol + rtol*|want|, ints and structure exactly."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or sorted(got) != sorted(want):
            return [f"{path}: structure {str(got)[:60]} vs {str(want)[:60]}"]
        out = []
        for k in want:
            out += compare(got[k], want[k], rtol, atol, f"{path}.{k}")
        return out
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: structure {str(got)[:60]} vs {str(want)[:60]}"]
        out = []
        for i, (g, w) in enumerate(zip(got, want)):
            out += compare(g, w, rtol, atol, f"{path}[{i}]")
            if len(out) > 20:
                break
        return out
    if isinstance(want, bool) or isinstance(got, bool):
        return [] if got == want else [f"{path}: {got!r} != {want!r}"]
    if isinstance(want, int) and not isinstance(want, bool) and isinstance(got, int):
        return [] if got == want else [f"{path}: {got!r} != {want!r}"]
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        d = abs(float(got) - float(want))
        return [] if d <= atol + rtol * abs(float(want)) else [f"{path}: {got!r} vs {want!r} (|diff| {d:.3g})"]
    return [f"{path}: {got!r} vs {want!r}"]


# ---------------------------------------------------------------------------------------------
# driver


def set_threads(n: int | None) -> None:
    if not n:
        return
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(n)
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:
            pass


class Runner:
    def __init__(self, build):
        self.build = build
        self.cache = {}  # (model, params) -> run_batch
        self.inputs = {}  # (path, kind) -> decoded instances

    def get(self, model, params):
        key = (model, os.path.abspath(params))
        if key not in self.cache:
            if kind_of(model) == "berxit":  # one Berxit at a time (Berxit-large is ~1.3 GB)
                for k in [k for k in self.cache if kind_of(k[0]) == "berxit"]:
                    del self.cache[k]
            self.cache[key] = self.build(model, load_safetensors(params))
        return self.cache[key]

    def run(self, model, params, inputs, batch, out=None, repeats=1):
        run_batch = self.get(model, params)
        kind = kind_of(model)
        ikey = (os.path.abspath(inputs), kind)
        if ikey not in self.inputs:
            self.inputs.clear()
            self.inputs[ikey] = [decode(kind, x) for x in read_jsonl(inputs)]
        insts = self.inputs[ikey]
        batches = [insts[i : i + batch] for i in range(0, len(insts), batch)]
        times = []
        results = None
        for _ in range(max(1, repeats)):
            res = []
            t0 = time.perf_counter()
            for b in batches:
                res.extend(run_batch(b))
            times.append((time.perf_counter() - t0) * 1e3 / max(1, len(batches)))
            results = res
        if out:
            with open(out, "w") as f:
                for r in results:
                    f.write(json.dumps(r, separators=(",", ":")) + "\n")
        return {"ok": True, "ms_per_batch": times, "batches": len(batches), "instances": len(insts)}


def main(build, name: str, setup=None) -> None:
    ap = argparse.ArgumentParser(description=f"{name} peer for tumble's zoo models")
    ap.add_argument("model", nargs="?", help="zoo stem, e.g. treelstm_small")
    ap.add_argument("--params")
    ap.add_argument("--inputs")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-o", "--output")
    ap.add_argument("--serve", action="store_true", help="JSON requests on stdin, replies on stdout")
    args = ap.parse_args()
    set_threads(args.threads)
    if setup:
        setup(args)
    runner = Runner(build)
    if not args.serve:
        r = runner.run(args.model, args.params, args.inputs, args.batch, args.output, args.repeats)
        print(json.dumps(r))
        return
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    out.write(json.dumps({"ok": True, "ready": name}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            if req.get("cmd") == "quit":
                break
            if req.get("threads"):
                set_threads(req["threads"])
            r = runner.run(req["model"], req["params"], req["inputs"], req["batch"], req.get("out"),
                           req.get("repeats", 1))
        except Exception as e:  # reported to the driver, which marks the point invalid
            r = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        out.write(json.dumps(r) + "\n")
        out.flush()
