#!/usr/bin/env python3
"""Regenerates the golden outputs bench/golden/<model>_<size>.jsonl from the numpy reference.

For each model file and its bundled sample, this runs tumble once with `--random-params 0` (the
weights are deterministic for seed 0) and `--save-params`, reads the weights back, computes every
instance's output with reference.py (float64 arithmetic), and writes the numpy results, encoded as
tumble encodes `@main`'s return value, one JSON line per instance. It also compares tumble's own
output with the numpy output and prints the agreement; it exits non-zero (and writes nothing for
that model) if they disagree beyond a float32 tolerance.

Run from the repository root:

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -r bench/golden/requirements.txt
    /tmp/venv/bin/python bench/golden/make_golden.py
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import reference  # noqa: E402

ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))

# (model file stem, bundled sample)
MODELS = [
    ("treelstm_small", "examples/treelstm.jsonl"),
    ("treelstm_large", "examples/treelstm.jsonl"),
    ("birnn_small", "examples/birnn.jsonl"),
    ("birnn_large", "examples/birnn.jsonl"),
    ("mvrnn_small", "examples/mvrnn.jsonl"),
    ("mvrnn_large", "examples/mvrnn.jsonl"),
]

# tumble (float32) vs numpy (float64, rounded to float32) must agree within this.
RTOL = 1e-5
ATOL = 1e-6

# Extra instances that the bundled samples do not cover (n-ary and unary nodes, one-token and
# two-token sentences, ids at the matrix-table clip boundary). Checked against tumble only; not
# written to the golden files.
EXTRA = {
    "treelstm": [
        {"tree": {"Rose": [[0], [{"Rose": [[5], []]}, {"Rose": [[6], []]}, {"Rose": [[7], []]}]]}},
        {"tree": {"Rose": [[0], [{"Rose": [[0], [{"Rose": [[1022], []]}]]}]]}},
        {"tree": {"Rose": [[42], []]}},
        {
            "tree": {
                "Rose": [
                    [0],
                    [
                        {"Rose": [[1023], []]},
                        {"Rose": [[0], [{"Rose": [[2], []]}, {"Rose": [[3], []]},
                                        {"Rose": [[4], []]}, {"Rose": [[21702], []]}]]},
                    ],
                ]
            }
        },
    ],
    "birnn": [
        {"tokens": [[9]]},
        {"tokens": [[1], [21702]]},
        {"tokens": [[0], [1], [2], [3], [4], [5]]},
    ],
}
EXTRA["mvrnn"] = EXTRA["treelstm"]


def log(msg: str) -> None:
    print(msg, flush=True)


def read_jsonl(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def ensure_tumble(path: str | None) -> str:
    if path:
        return path
    exe = os.path.join(ROOT, "target", "release", "tumble")
    if not os.path.exists(exe):
        log("building target/release/tumble (cargo build --release -p tumble-cli)")
        subprocess.run(["cargo", "build", "--release", "-p", "tumble-cli"], cwd=ROOT, check=True)
    return exe


def run_tumble(exe: str, model: str, inputs: str, out: str, params: str | None) -> float:
    cmd = [exe, "run", f"models/{model}.rly", "--inputs", inputs, "--random-params", "0", "-o", out]
    if params:
        cmd += ["--save-params", params]
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - t


def compare(got, want, path: str, stats: dict) -> list[str]:
    """Structural comparison; floats within ATOL + RTOL*|want|, ints exactly. Returns problems."""
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: structure differs: {str(got)[:60]} vs {str(want)[:60]}"]
        problems = []
        for i, (g, w) in enumerate(zip(got, want)):
            problems += compare(g, w, f"{path}[{i}]", stats)
        return problems
    if isinstance(want, bool) or isinstance(got, bool):
        return [f"{path}: unexpected boolean"]
    if isinstance(want, int):
        if not isinstance(got, int) or got != want:
            return [f"{path}: {got!r} != {want!r}"]
        stats["ints"] += 1
        return []
    if isinstance(want, float):
        if not isinstance(got, (int, float)):
            return [f"{path}: {got!r} is not a number"]
        d = abs(got - want)
        stats["floats"] += 1
        stats["max_abs"] = max(stats["max_abs"], d)
        stats["max_rel"] = max(stats["max_rel"], d / abs(want) if want else (0.0 if d == 0 else np.inf))
        if d > ATOL + RTOL * abs(want):
            return [f"{path}: {got!r} vs {want!r} (|diff| {d:.3g})"]
        return []
    return [f"{path}: unexpected value {want!r}"]


def check_roundtrip(line: str, value) -> None:
    """The written decimals must read back as exactly the same float32 values."""
    a = np.asarray(json.loads(line), dtype=np.float32)
    b = np.asarray(value, dtype=np.float32)
    if a.shape != b.shape or not np.array_equal(a, b):
        raise AssertionError(f"float32 round trip failed for {line[:80]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tumble", help="tumble binary (default: target/release/tumble, built if missing)")
    ap.add_argument("--only", nargs="*", help="model stems to do (default: all six)")
    ap.add_argument("--no-extra", action="store_true", help="skip the extra-instance checks")
    args = ap.parse_args()

    exe = ensure_tumble(args.tumble)
    failed = False
    with tempfile.TemporaryDirectory(prefix="tumble-golden-") as tmp:
        for model, sample in MODELS:
            if args.only and model not in args.only:
                continue
            kind = model.split("_")[0]
            fn = reference.MODELS[kind]
            params = os.path.join(tmp, f"{model}.safetensors")
            out = os.path.join(tmp, f"{model}.out.jsonl")
            secs = run_tumble(exe, model, sample, out, params)
            weights = reference.load_safetensors(params)
            instances = read_jsonl(os.path.join(ROOT, sample))
            tumble_out = read_jsonl(out)

            refs = [fn(weights, inst) for inst in instances]
            lines = [reference.to_json(r) for r in refs]
            for line, r in zip(lines, refs):
                check_roundtrip(line, r)
            want = [json.loads(line) for line in lines]

            stats = {"floats": 0, "ints": 0, "max_abs": 0.0, "max_rel": 0.0}
            problems = []
            if len(tumble_out) != len(want):
                problems.append(f"{len(tumble_out)} results for {len(want)} instances")
            for i, (g, w) in enumerate(zip(tumble_out, want)):
                problems += compare(g, w, f"line {i + 1}", stats)

            extra = ""
            if kind == "birnn":
                margins = []
                for inst in instances:
                    lg = np.sort(reference.birnn_logits(weights, inst), axis=1)
                    margins.append((lg[:, -1] - lg[:, -2]).min())
                extra = f", smallest top-2 logit margin {min(margins):.3g}"
            log(
                f"{model:15s} {len(want)} instances ({secs:.1f} s in tumble): "
                f"{stats['floats']} floats, max |diff| {stats['max_abs']:.3g}, "
                f"max rel {stats['max_rel']:.3g}; {stats['ints']} ints"
                + (" all equal" if stats["ints"] else "")
                + extra
            )
            if problems:
                failed = True
                log(f"  DISAGREES with numpy ({len(problems)} problems); golden not written:")
                for p in problems[:10]:
                    log(f"    {p}")
                continue
            golden = os.path.join(HERE, f"{model}.jsonl")
            with open(golden, "w") as f:
                f.write("".join(line + "\n" for line in lines))
            log(f"  wrote {os.path.relpath(golden, ROOT)}")

            if not args.no_extra:
                xin = os.path.join(tmp, f"{kind}.extra.jsonl")
                with open(xin, "w") as f:
                    f.write("".join(json.dumps(x) + "\n" for x in EXTRA[kind]))
                xout = os.path.join(tmp, f"{model}.extra.out.jsonl")
                run_tumble(exe, model, xin, xout, None)
                xstats = {"floats": 0, "ints": 0, "max_abs": 0.0, "max_rel": 0.0}
                xgot = read_jsonl(xout)
                xproblems = []
                if len(xgot) != len(EXTRA[kind]):
                    xproblems.append(f"{len(xgot)} results for {len(EXTRA[kind])} instances")
                for i, (g, inst) in enumerate(zip(xgot, EXTRA[kind])):
                    w = json.loads(reference.to_json(fn(weights, inst)))
                    xproblems += compare(g, w, f"extra {i + 1}", xstats)
                log(
                    f"  extra instances ({len(EXTRA[kind])}): max |diff| {xstats['max_abs']:.3g}, "
                    f"max rel {xstats['max_rel']:.3g}" + (" DISAGREE" if xproblems else ", agree")
                )
                for p in xproblems[:10]:
                    failed = True
                    log(f"    {p}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
