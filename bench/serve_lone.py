#!/usr/bin/env python3
"""Latency of lone requests: one `tumble serve` per command in turn, each sent N sequential
one-instance requests (the first two dropped as warm-up), median / min / max latency in ms.

For the batch threads' lending (bench/RESULTS.md, forty-fifth session): a lone request on a
compute-heavy model should run on every core whatever `--workers` is.

    bench/serve_lone.py [--model berxit_small] [--threads 2] [--requests 12] [--rounds 2] \
        'target/release/tumble' 'target/release/tumble --workers 1' ...

A command is a binary and optional `tumble serve` flags. The model's weights and instances are
the suite's (bench/.data: run `bench/run` once): berxit_small reads
bench/.data/berxit_8.first8.jsonl, treelstm_* bench/.data/sst_test_tree.jsonl.
"""
import argparse
import http.client
import json
import os
import shlex
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "bench", ".data")
INSTANCES = {"berxit": "berxit_8.first8.jsonl", "treelstm": "sst_test_tree.jsonl"}


def one_server(cmd, model, threads, requests):
    kind = model.split("_")[0]
    with open(os.path.join(DATA, INSTANCES[kind])) as f:
        inst = [json.loads(line) for _, line in zip(range(64), f)]
    argv = shlex.split(cmd)
    argv[1:1] = ["serve", os.path.join(ROOT, "models", f"{model}.rly"), "--params",
                 os.path.join(DATA, "weights", f"{model}.seed0.safetensors"),
                 "--port", "0", "--threads", str(threads)]
    p = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stderr.readline()
        if "listening on http://" not in line:
            raise RuntimeError(f"{cmd}: server did not start: {line}")
        host_port = line.split("http://")[1].split("/")[0]
        host, port = host_port.rsplit(":", 1)
        lat = []
        for k in range(requests):
            body = json.dumps({"instances": [inst[k % len(inst)]]})
            c = http.client.HTTPConnection(host, int(port), timeout=120)
            t = time.perf_counter()
            c.request("POST", f"/v1/models/{model}:predict", body,
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            r.read()
            lat.append((time.perf_counter() - t) * 1e3)
            if r.status != 200:
                raise RuntimeError(f"{cmd}: status {r.status}")
        return lat[2:]
    finally:
        p.terminate()
        p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("commands", nargs="+")
    ap.add_argument("--model", default="berxit_small")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for r in range(a.rounds):
        for cmd in a.commands:
            lat = one_server(cmd, a.model, a.threads, a.requests)
            print(f"round {r + 1}  {cmd:<48} median {statistics.median(lat):7.1f} ms"
                  f"  min {min(lat):6.1f}  max {max(lat):6.1f}")


if __name__ == "__main__":
    main()
