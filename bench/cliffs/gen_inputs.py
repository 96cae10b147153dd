#!/usr/bin/env python3
"""Inputs of the programs in bench/cliffs/ (see cliffs_ab.sh), written to bench/.data/cliffs/:
seq256.jsonl (256 token lists of 5-40 tokens from a 1,000-word vocabulary), expr64.jsonl (64
expression trees of 5-40 literals, operators Add/Mul/Neg), gate256.jsonl (256 vectors of 512
normals with a threshold), loop256.jsonl (256 vectors of 64 normals, each with a trip count of
1-50), mem256.jsonl (256 memories of 5-50 words with a query word and 1-4 hops); and for the
forty-seventh session's programs: graph256.jsonl (256 graphs of 5-40 nodes, each node its index
and a list of 0-4 neighbours), ptr256.jsonl (256 sources of 5-40 tokens, at most 30 steps),
s2s256.jsonl (256 sources of 5-40 tokens, 1-20 target steps), short128.jsonl (128 sentences
of 3-16 tokens), rows128.jsonl (128 graphs of 5-40 nodes by word id, each node a list of 0-6 neighbours),
beam64.jsonl (64 sources of 5-30 tokens, 3-12 steps of a beam of four), ids128.jsonl (128 sentences of
5-40 word ids as one tensor each); and for the forty-eighth session's: frames128.jsonl (128
utterances of 8-64 frames of 40 normals, with their count), btree128.jsonl (128 binary trees of 5-15
leaves from a 1,000-word vocabulary), caps256.jsonl (256 sets of 32 eight-wide capsules, three
routing iterations); and for the forty-ninth session's: kv128.jsonl (128 prompts of 3-30 token ids
below 2,000 with 5-25 decoding steps); and for the training programs in bench/cliffs/train/: seq256l.jsonl (256
sentences of 5-30 tokens with a 5-class label), wide256.jsonl (256 matrices of 15 rows of 128
normals); and for the fifty-first session's: count256.jsonl (seq256's sentences as one tensor of
ids each with its length), typed128.jsonl (128 graphs of 8-20 nodes, each node its index, 1-4
incoming edges' sources and types in 0-3 as tensors, and their count) and typedl128.jsonl (the
same graphs, each node's edges a list of (source, type) pairs).
Seeded: the same files every time."""
import json
import os
import random

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".data", "cliffs")
os.makedirs(out, exist_ok=True)
R = random.Random(1)
with open(os.path.join(out, "seq256.jsonl"), "w") as f:
    for _ in range(256):
        f.write(json.dumps({"tokens": [[R.randrange(2, 1000)] for _ in range(R.randint(5, 40))]}) + "\n")


def expr(n):
    if n <= 1:
        return {"Lit": [[R.randrange(2, 1000)]]}
    if R.random() < 0.2:
        return {"Neg": [expr(n - 1)]}
    k = R.randint(1, n - 1)
    return {R.choice(["Add", "Mul"]): [expr(k), expr(n - k)]}


with open(os.path.join(out, "expr64.jsonl"), "w") as f:
    for _ in range(64):
        f.write(json.dumps({"expr": expr(R.randint(5, 40))}) + "\n")
with open(os.path.join(out, "gate256.jsonl"), "w") as f:
    for _ in range(256):
        x = [round(R.gauss(0, 1), 6) for _ in range(512)]
        f.write(json.dumps({"x": [x], "thr": round(512 * R.uniform(0.2, 0.6), 3)}) + "\n")
with open(os.path.join(out, "loop256.jsonl"), "w") as f:
    for _ in range(256):
        x = [round(R.gauss(0, 1), 6) for _ in range(64)]
        f.write(json.dumps({"x": [x], "n": R.randint(1, 50)}) + "\n")
with open(os.path.join(out, "mem256.jsonl"), "w") as f:
    for _ in range(256):
        mem = [R.randrange(2, 1000) for _ in range(R.randint(5, 50))]
        f.write(json.dumps({"mem": mem, "query": [R.randrange(2, 1000)], "hops": R.randint(1, 4)}) + "\n")

R = random.Random(2)
with open(os.path.join(out, "graph256.jsonl"), "w") as f:
    for _ in range(256):
        n = R.randint(5, 40)
        nodes = [[[v], sorted(R.sample(range(n), min(n, R.randint(0, 4))))] for v in range(n)]
        f.write(json.dumps({"feat": [R.randrange(2, 1000) for _ in range(n)], "nodes": nodes}) + "\n")


def tokens(lo, hi):
    return [[R.randrange(2, 1000)] for _ in range(R.randint(lo, hi))]


with open(os.path.join(out, "ptr256.jsonl"), "w") as f:
    for _ in range(256):
        f.write(json.dumps({"src": tokens(5, 40), "maxlen": 30}) + "\n")
with open(os.path.join(out, "s2s256.jsonl"), "w") as f:
    for _ in range(256):
        f.write(json.dumps({"src": tokens(5, 40), "tlen": R.randint(1, 20)}) + "\n")
with open(os.path.join(out, "short128.jsonl"), "w") as f:
    for _ in range(128):
        f.write(json.dumps({"tokens": tokens(3, 16)}) + "\n")
with open(os.path.join(out, "rows128.jsonl"), "w") as f:
    for _ in range(128):
        n = R.randint(5, 40)
        nbrs = [sorted(R.sample(range(n), R.randint(0, min(n, 6)))) for _ in range(n)]
        f.write(json.dumps({"ids": [R.randrange(2, 1000) for _ in range(n)], "nbrs": nbrs}) + "\n")
with open(os.path.join(out, "beam64.jsonl"), "w") as f:
    for _ in range(64):
        f.write(json.dumps({"src": tokens(5, 30), "maxlen": R.randint(3, 12)}) + "\n")
with open(os.path.join(out, "ids128.jsonl"), "w") as f:
    for _ in range(128):
        f.write(json.dumps({"toks": [R.randrange(2, 1000) for _ in range(R.randint(5, 40))]}) + "\n")
with open(os.path.join(out, "frames128.jsonl"), "w") as f:
    for _ in range(128):
        n = R.randint(8, 64)
        f.write(json.dumps({"frames": [[round(R.gauss(0, 1), 4) for _ in range(40)] for _ in range(n)], "n": n}) + "\n")


def btree(n):
    if n == 1:
        return {"Rose": [[R.randrange(1, 1000)], []]}
    k = R.randint(1, n - 1)
    return {"Rose": [[0], [btree(k), btree(n - k)]]}


with open(os.path.join(out, "btree128.jsonl"), "w") as f:
    for _ in range(128):
        f.write(json.dumps({"tree": btree(R.randint(5, 15))}) + "\n")
with open(os.path.join(out, "caps256.jsonl"), "w") as f:
    for _ in range(256):
        f.write(json.dumps({"u": [[round(R.gauss(0, 1), 4) for _ in range(8)] for _ in range(32)], "iters": 3}) + "\n")
with open(os.path.join(out, "seq256l.jsonl"), "w") as f:
    for _ in range(256):
        f.write(json.dumps({"tokens": [[R.randrange(2, 1000)] for _ in range(R.randint(5, 30))], "label": R.randrange(5)}) + "\n")
with open(os.path.join(out, "wide256.jsonl"), "w") as f:
    for _ in range(256):
        f.write(json.dumps({"x": [[round(R.gauss(0, 1), 3) for _ in range(128)] for _ in range(15)]}) + "\n")

R = random.Random(5)
with open(os.path.join(out, "kv128.jsonl"), "w") as f:
    for _ in range(128):
        f.write(json.dumps({"prompt": [R.randrange(2, 2000) for _ in range(R.randint(3, 30))], "steps": R.randint(5, 25)}) + "\n")

with open(os.path.join(out, "seq256.jsonl")) as src, open(os.path.join(out, "count256.jsonl"), "w") as f:
    for line in src:
        toks = [t[0] for t in json.loads(line)["tokens"]]
        f.write(json.dumps({"toks": toks, "n": len(toks)}) + "\n")

R = random.Random(51)
typed, typedl = [], []
for _ in range(128):
    n = R.randint(8, 20)
    feat = [R.randrange(100) for _ in range(n)]
    nodes, lnodes = [], []
    for v in range(n):
        k = R.randint(1, 4)
        src = [R.randrange(n) for _ in range(k)]
        typ = [R.randrange(4) for _ in range(k)]
        nodes.append([[v], src, typ, k])
        lnodes.append([[v], [[[s], t] for s, t in zip(src, typ)]])
    typed.append({"feat": feat, "nodes": nodes})
    typedl.append({"feat": feat, "nodes": lnodes})
for name, rows in (("typed128.jsonl", typed), ("typedl128.jsonl", typedl)):
    with open(os.path.join(out, name), "w") as f:
        for g in rows:
            f.write(json.dumps(g) + "\n")

# The fifty-eighth session's: mod256.jsonl (256 vectors of 256 normals with a 5-class label, for
# mod_depths_256.rly) and typedg256.jsonl (256 typed-edge graphs of 2-12 nodes whose features are
# ids below 10, each node 1-3 incoming edges of types 0-2, for typed_loss_256.rly);
# clockwork_256.rly reads seq256l.jsonl.
R = random.Random(58)
with open(os.path.join(out, "mod256.jsonl"), "w") as f:
    for _ in range(256):
        f.write(json.dumps({"x": [[round(R.gauss(0, 1), 5) for _ in range(256)]], "label": R.randrange(5)}) + "\n")
with open(os.path.join(out, "typedg256.jsonl"), "w") as f:
    for g in range(256):
        n = 2 + g % 5 + g % 7
        nodes = []
        for v in range(n):
            e = 1 + (v + g) % 3
            nodes.append([[v], [(v + j + 1) % n for j in range(e)], [(g + v + j) % 3 for j in range(e)], e])
        f.write(json.dumps({"feat": [(g * 3 + v) % 10 for v in range(n)], "nodes": nodes}) + "\n")

# The fifty-ninth session's: deep20000.jsonl (one instance of a 20,000-step residual recursion
# that branches on a computed sum at every step, and 15 of 50 steps, for branch_depth_12.rly).
R = random.Random(59)
with open(os.path.join(out, "deep20000.jsonl"), "w") as f:
    for k in range(16):
        x = [[round(R.gauss(0, 1), 4) for _ in range(12)]]
        f.write(json.dumps({"x": x, "n": 20000 if k == 0 else 50, "target": x}) + "\n")
