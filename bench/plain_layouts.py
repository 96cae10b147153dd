#!/usr/bin/env python3
"""Plain BiRNN-small written four ways a user might write it, timed against each other with the
compiler's layout passes on and off: the zoo's row-vector form (`nn.dense(%x, %W)`), recurrent
weights kept as `(in, out)` (`nn.dense(%h, transpose(%W_h))`, run on a weights file holding those
two matrices transposed), textbook column vectors (`W · x` as `nn.dense(%W_x, transpose(%x))`,
states `(256, 1)`, a reshaped bias), and 1-D vectors (states `(256)`). Every form computes the
same function, so every output must equal the row form's.

Each round runs every (form, switches) pair once, in rotated order, with `--repeat R --profile`;
the time is the warm median of the repeats (decoding excluded). Reported: the median over rounds,
min-max, and the ratio to the row form in the same round.

    bench/plain_layouts.py [--rounds 3] [--repeat 4] [--batch 64] [--limit 128]

Needs only python3 and target/release/tumble (it builds it)."""

from __future__ import annotations

import argparse
import json
import os
import struct
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXE = os.path.join(ROOT, "target", "release", "tumble")
BASE = os.path.join(ROOT, "models", "plain", "birnn_small.rly")

# (form, [(from, to)]): text replacements of the plain BiRNN-small.
FORMS = {
    "rows": [],
    "transposed weights": [
        ("nn.dense(%h, %W_h)", "nn.dense(%h, transpose(%W_h))"),
    ],
    "column vectors": [
        ("%h: Tensor[(1, 256), float32],\n  %emb", "%h: Tensor[(256, 1), float32],\n  %emb"),
        (") -> List[Tensor[(1, 256), float32]] {", ") -> List[Tensor[(256, 1), float32]] {"),
        ("let %x = take(%emb, %tok, axis=0);", "let %x = transpose(take(%emb, %tok, axis=0));"),
        ("tanh(add(add(nn.dense(%x, %W_x), %b), nn.dense(%h, %W_h)))",
         "tanh(add(add(nn.dense(%W_x, transpose(%x)), reshape(%b, newshape=[256, 1])), "
         "nn.dense(%W_h, transpose(%h))))"),
        ('zeros(shape=[1, 256], dtype="float32")', 'zeros(shape=[256, 1], dtype="float32")'),
        ("(%hh: (Tensor[(1, 256), float32], Tensor[(1, 256), float32]))",
         "(%hh: (Tensor[(256, 1), float32], Tensor[(256, 1), float32]))"),
        ("nn.dense(concatenate((%hh.0, %hh.1), axis=1), %W_out)",
         "transpose(nn.dense(%W_out, transpose(concatenate((%hh.0, %hh.1), axis=0))))"),
    ],
    "1-D vectors": [
        ("%h: Tensor[(1, 256), float32],\n  %emb", "%h: Tensor[(256), float32],\n  %emb"),
        (") -> List[Tensor[(1, 256), float32]] {", ") -> List[Tensor[(256), float32]] {"),
        ("let %x = take(%emb, %tok, axis=0);", "let %x = take(%emb, squeeze(%tok), axis=0);"),
        ('zeros(shape=[1, 256], dtype="float32")', 'zeros(shape=[256], dtype="float32")'),
        ("(%hh: (Tensor[(1, 256), float32], Tensor[(1, 256), float32]))",
         "(%hh: (Tensor[(256), float32], Tensor[(256), float32]))"),
        ("nn.dense(concatenate((%hh.0, %hh.1), axis=1), %W_out)",
         "nn.dense(concatenate((%hh.0, %hh.1), axis=0), %W_out)"),
        ("argmax(%logits, axis=[1])", "argmax(expand_dims(%logits, axis=0), axis=[1])"),
    ],
}

SWITCHES = {
    "default": [],
    "--no-canonical-products --no-derived-params --no-cse":
        ["--no-canonical-products", "--no-derived-params", "--no-cse"],
}

# Plain TreeLSTM-small with each gate spelling its product again (`sigmoid(split(add(nn.dense(
# %h_sum, %U_iou), %b_iou), 3).0)` per gate), against the zoo's plain form.
TREE_BASE = os.path.join(ROOT, "models", "plain", "treelstm_small.rly")
_G = "split(add(nn.dense(%h_sum, %U_iou), %b_iou), indices_or_sections=3, axis=1)"
TREE_FORMS = {
    "tree: one product per cell": [],
    "tree: the product spelled per gate": [
        ("""      let %iou = split(add(nn.dense(%h_sum, %U_iou), %b_iou), indices_or_sections=3, axis=1);
      let %c = add(multiply(sigmoid(%iou.0), tanh(%iou.2)), %fc_sum);
      (multiply(sigmoid(%iou.1), tanh(%c)), %c)""",
         f"""      let %c = add(multiply(sigmoid({_G}.0), tanh({_G}.2)), %fc_sum);
      (multiply(sigmoid({_G}.1), tanh(%c)), %c)"""),
    ],
}


# Forms whose weights file holds these matrices transposed.
TRANSPOSED = {"transposed weights": ["W_h_fwd", "W_h_bwd"]}


def transpose_weights(src: str, dst: str, names: list[str]):
    """A copy of safetensors file `src` with the 2-D f32 tensors `names` transposed."""
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    for name in names:
        meta = header[name]
        if meta["dtype"] != "F32" or len(meta["shape"]) != 2:
            sys.exit(f"{name}: not a 2-D f32 tensor")
        rows, cols = meta["shape"]
        a, b = meta["data_offsets"]
        vals = struct.unpack(f"<{rows * cols}f", data[a:b])
        t = [vals[r * cols + c] for c in range(cols) for r in range(rows)]
        data[a:b] = struct.pack(f"<{rows * cols}f", *t)
        meta["shape"] = [cols, rows]
    head = json.dumps(header).encode()
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        f.write(data)


def build():
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "tumble-cli"], cwd=ROOT, check=True)


def write_forms(tmp: str, base_path: str = BASE, forms: dict = FORMS) -> dict[str, str]:
    base = open(base_path).read()
    paths = {}
    for form, subs in forms.items():
        text = base
        for a, b in subs:
            if a not in text:
                sys.exit(f"{form}: `{a}` is not in {base_path}")
            text = text.replace(a, b)
        path = os.path.join(tmp, re.sub(r"[^a-z0-9]+", "_", form) + ".rly")
        with open(path, "w") as f:
            f.write(text)
        paths[form] = path
    return paths


def run(model: str, inputs: str, weights: str, extra: list[str], a, out: str) -> float:
    cmd = [EXE, "run", model, "--inputs", inputs, "--params", weights, "--batch", str(a.batch),
           "--threads", "1", "--profile", "--repeat", str(a.repeat), "-o", out] + extra
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    m = re.search(r"repeats without decoding inputs.*warm median ([0-9.]+)", r.stderr)
    if not m:
        sys.exit(f"no timing in the profile of {model}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--limit", type=int, default=128, help="SST test sentences")
    a = ap.parse_args()
    build()
    with tempfile.TemporaryDirectory(prefix="plain_layouts.") as tmp:
        paths = write_forms(tmp)
        paths.update(write_forms(tmp, TREE_BASE, TREE_FORMS))
        trees = os.path.join(tmp, "trees.jsonl")
        subprocess.run([EXE, "data", "sst", "--split", "test", "--format", "tree", "--limit",
                        str(a.limit), "-o", trees], check=True, capture_output=True)
        tree_weights = os.path.join(tmp, "tree_w.safetensors")
        subprocess.run([EXE, "run", paths["tree: one product per cell"], "--inputs", trees,
                        "--random-params", "0", "--save-params", tree_weights, "-o",
                        os.path.join(tmp, "x.jsonl")], check=True, capture_output=True)
        inputs = os.path.join(tmp, "sentences.jsonl")
        subprocess.run([EXE, "data", "sst", "--split", "test", "--format", "tokens", "--limit",
                        str(a.limit), "-o", inputs], check=True, capture_output=True)
        weights = os.path.join(tmp, "w.safetensors")
        subprocess.run([EXE, "run", paths["rows"], "--inputs", inputs, "--random-params", "0",
                        "--save-params", weights, "-o", os.path.join(tmp, "x.jsonl")],
                       check=True, capture_output=True)
        files = {f: weights for f in FORMS}
        files.update({f: tree_weights for f in TREE_FORMS})
        data = {f: inputs for f in FORMS}
        data.update({f: trees for f in TREE_FORMS})
        base_form = {f: "rows" for f in FORMS}
        base_form.update({f: "tree: one product per cell" for f in TREE_FORMS})
        for f, names in TRANSPOSED.items():
            files[f] = os.path.join(tmp, "w_transposed.safetensors")
            transpose_weights(weights, files[f], names)
        pairs = [(f, s) for f in list(FORMS) + list(TREE_FORMS) for s in SWITCHES]
        times: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
        ratios: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
        mismatches: list[tuple[str, str]] = []
        for r in range(a.rounds):
            order = pairs[r % len(pairs):] + pairs[:r % len(pairs)]
            this: dict[tuple[str, str], float] = {}
            outs: dict[tuple[str, str], str] = {}
            for f, s in order:
                out = os.path.join(tmp, "out.jsonl")
                this[(f, s)] = run(paths[f], data[f], files[f], SWITCHES[s], a, out)
                with open(out) as fh:
                    outs[(f, s)] = fh.read()
            if r == 0:
                mismatches = [p for p, o in outs.items() if o != outs[(base_form[p[0]], "default")]]
            for p in pairs:
                times[p].append(this[p])
                ratios[p].append(this[p] / this[(base_form[p[0]], "default")])
            print(f"round {r + 1}: " + ", ".join(f"{f} / {s}: {this[(f, s)]:.1f}" for f, s in pairs),
                  file=sys.stderr)
    print(f"\nplain BiRNN-small ({a.limit} SST test sentences) and TreeLSTM-small (trees), batch {a.batch}, 1 thread, warm median "
          f"of {a.repeat - 1} repeats, median of {a.rounds} rounds (min-max)\n")
    print("| form | switches | ms | / first form (same round) | outputs = first form's |")
    print("|---|---|---:|---:|---|")
    for f, s in pairs:
        t, q = times[(f, s)], ratios[(f, s)]
        same = "no" if (f, s) in mismatches else "yes"
        print(f"| {f} | {s} | {statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f}) | "
              f"{statistics.median(q):.2f} ({min(q):.2f}-{max(q):.2f}) | {same} |")
    if mismatches:
        sys.exit(f"outputs differ: {mismatches}")


if __name__ == "__main__":
    main()
