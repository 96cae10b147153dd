#!/usr/bin/env python3
"""Whether a benchmark peer keeps using CPU after it has answered (spinning OpenMP threads would
slow whatever the suite runs next): starts one peer from bench/peers/ as the suite does, asks it
for Berxit-small b8 twice, and after each answer prints the CPU time all its threads used since,
every 250 ms for 2 s (issue 17; bench/RESULTS.md, sixtieth session).

Usage: bench/.venv/bin/python bench/peer_idle_cpu.py PEER [THREADS]
  PEER: torch_eager, torch_batched or dynet_auto (run `bench/run` once first for bench/.data)."""
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpu_seconds(pid):
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    name, threads = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "1"
    peer = subprocess.Popen([sys.executable, os.path.join(HERE, "peers", f"{name}.py"), "--serve",
                             "--threads", threads], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    if not peer.stdout.readline():
        sys.exit(f"{name}: the peer did not start")
    req = dict(model="berxit_small", params="bench/.data/weights/berxit_small.seed0.safetensors",
               inputs="bench/.data/berxit_64.first8.jsonl", batch=8, out=None)
    for r in range(2):
        peer.stdin.write(json.dumps(req) + "\n")
        peer.stdin.flush()
        peer.stdout.readline()
        c0, t0 = cpu_seconds(peer.pid), time.time()
        for _ in range(8):
            time.sleep(0.25)
            print(f"request {r + 1}: +{time.time() - t0:.2f} s after the answer, "
                  f"{cpu_seconds(peer.pid) - c0:.2f} s of CPU used since", flush=True)
    peer.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
    peer.stdin.flush()
    peer.wait()


if __name__ == "__main__":
    main()
