#!/usr/bin/env python3
"""Load test of `tumble serve`: open-loop Poisson arrivals, TreeLSTM-large on SST test trees.

Starts one server per policy (continuous, static, single) at once, then, for each rate, runs the
open-loop generator (crates/serve/examples/serve_load.rs: one instance per request, one
connection each, latency from the scheduled arrival) against each server in turn, so the three
policies see the same machine conditions at each rate. Prints a table of p50/p90/p99 latency and
throughput, writes bench/results/serve_load-<date>.{json,md} and, when matplotlib imports, a
PNG of p99 latency against throughput. `--soak N` then sends N requests to the continuous server
and reports its RSS before and after.

    bench/serve_load.py                      # rates 50..600 req/s, 10 s each
    bench/serve_load.py --rates 100,300 --seconds 5 --soak 100000 --soak-rate 400

Needs release builds (made here: `cargo build --release -p tumble-cli` and
`cargo build --release -p tumble-serve --example serve_load`; CARGO_TARGET_DIR is honored).
"""

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(HERE, ".data")
POLICIES = ["continuous", "static", "single"]


def target_dir():
    return os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")


def build():
    for args in (["-p", "tumble-cli"], ["-p", "tumble-serve", "--example", "serve_load"]):
        subprocess.run(["cargo", "build", "--release", "-q", *args], cwd=ROOT, check=True)
    rel = os.path.join(target_dir(), "release")
    return os.path.join(rel, "tumble"), os.path.join(rel, "examples", "serve_load")


def trees(tumble):
    path = os.path.join(DATA, "sst_test_tree.jsonl")
    if not os.path.exists(path):
        os.makedirs(DATA, exist_ok=True)
        subprocess.run([tumble, "data", "sst", "--split", "test", "--format", "tree", "-o", path],
                       check=True)
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tumble, policy, a):
        # "continuous@N": the continuous policy with `--cell-levels N`; "POLICY#B": the server
        # with `--max-batch B` instead of the run's; a "-nomemo" suffix: the server with
        # `--no-job-memo`; "POLICY*W": the server with `--workers W` instead of the run's
        # `--workers` — variants compared side by side like policies.
        self.policy = policy
        policy, nomemo = (policy[:-len("-nomemo")], True) if policy.endswith("-nomemo") else (policy, False)
        policy, _, workers = policy.partition("*")
        policy, _, max_batch = policy.partition("#")
        policy, _, cells = policy.partition("@")
        self.port = free_port()
        cmd = [tumble, "serve", os.path.join(ROOT, "models", "treelstm_large.rly"),
               "--random-params", "0", "--port", str(self.port), "--threads", str(a.threads),
               "--policy", policy, "--max-batch", max_batch or str(a.max_batch),
               "--max-wait-ms", str(a.max_wait_ms), "--max-queue", str(a.max_queue),
               "--timeout-ms", str(a.timeout_ms)]
        if workers or a.workers:
            cmd += ["--workers", workers or str(a.workers)]
        if nomemo:
            cmd.append("--no-job-memo")
        if policy == "continuous" and (cells or a.cell_levels):
            cmd += ["--cell-levels", cells or str(a.cell_levels)]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()
        if "listening" not in line:
            raise RuntimeError(f"{policy}: server did not start: {line}")

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def metrics(self):
        text = urllib.request.urlopen(self.url("/metrics"), timeout=30).read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(tumble_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def idle(self):
        for _ in range(600):
            m = self.metrics()
            if m.get("tumble_queue_depth", 1) == 0 and m.get("tumble_in_flight", 1) == 0:
                return
            time.sleep(0.05)

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return -1

    def stop(self):
        self.proc.terminate()
        code = self.proc.wait(timeout=120)
        rest = self.proc.stderr.read()
        if code != 0:
            raise RuntimeError(f"{self.policy}: exit status {code}: {rest}")


def load(gen, server, path, rate, seconds, seed, max_requests=None):
    args = [gen, f"127.0.0.1:{server.port}", "treelstm_large", path, str(rate), str(seconds),
            str(seed)]
    if max_requests:
        args.append(str(max_requests))
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def fmt(x):
    return "—" if x is None else f"{x:.1f}"


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def report(rows, args, stem):
    """Table (median over rounds per rate and policy) to stdout and STEM.md; plot to STEM.png."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    rates = sorted({r["rate"] for r in rows})
    points = []
    for rate in rates:
        for pol in policies:
            rs = [r for r in rows if r["rate"] == rate and r["policy"] == pol]
            if not rs:
                continue
            pt = {k: median([r[k] for r in rs]) for k in ("throughput", "p50", "p90", "p99", "mean_batch")}
            pt.update(rate=rate, policy=pol, errors=sum(r["errors"] for r in rs), n=len(rs))
            points.append(pt)
    lines = ["| rate (req/s) | policy | throughput (req/s) | p50 (ms) | p90 (ms) | p99 (ms) | errors | mean batch | rounds |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in points:
        lines.append(f"| {r['rate']:.0f} | {r['policy']} | {fmt(r['throughput'])} | {fmt(r['p50'])} | "
                     f"{fmt(r['p90'])} | {fmt(r['p99'])} | {r['errors']} | {fmt(r['mean_batch'])} | {r['n']} |")
    table = "\n".join(lines)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot", file=sys.stderr)
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    for pol in policies:
        pts = [r for r in points if r["policy"] == pol and r["p99"] is not None]
        line, = ax.plot([r["throughput"] for r in pts], [r["p99"] for r in pts], "o-", label=f"{pol} p99")
        ax.plot([r["throughput"] for r in pts], [r["p50"] for r in pts], "x--", alpha=0.5,
                color=line.get_color(), label=f"{pol} p50")
        for r in pts:
            ax.annotate(f"{r['rate']:.0f}", (r["throughput"], r["p99"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        bx.plot([r["rate"] for r in pts], [r["throughput"] for r in pts], "o-", label=pol)
    ax.set_yscale("log")
    ax.set_xlabel("throughput (requests/s, 1 tree each); labels: offered rate")
    ax.set_ylabel("latency (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    bx.plot(rates, rates, ":", color="grey", label="offered")
    bx.set_xlabel("offered rate (requests/s)")
    bx.set_ylabel("throughput (requests/s)")
    bx.grid(True, alpha=0.3)
    bx.legend(fontsize=7)
    fig.suptitle(f"tumble serve, TreeLSTM-large, SST test trees, {args.get('threads')} threads "
                 f"(median of {max(r['n'] for r in points)} round(s))")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    print(f"wrote {stem}.png")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="50,100,200,300,400,500,600")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-wait-ms", type=int, default=10)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--timeout-ms", type=int, default=30000)
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated; continuous@N is the continuous policy with --cell-levels N, "
                        "POLICY*W the server with --workers W, "
                        "a -nomemo suffix the server with --no-job-memo")
    p.add_argument("--workers", type=int, default=0,
                   help="every server's --workers (0: tumble serve's default, one per thread)")
    p.add_argument("--cell-levels", type=int, default=0,
                   help="the continuous server's --cell-levels (0: whole flushes, its default)")
    p.add_argument("--soak", type=int, default=0, help="requests of the soak run (0: none)")
    p.add_argument("--soak-rate", type=float, default=400)
    p.add_argument("--rounds", type=int, default=1,
                   help="sweeps over the rates; the table shows each point's median over rounds")
    p.add_argument("--out", default=None, help="results stem (default bench/results/serve_load-DATE)")
    p.add_argument("--tumble", default=None, metavar="BIN",
                   help="the tumble binary to serve with (default: this checkout's release build)")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only redo the table and plot of an earlier run's JSON")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            saved = json.load(f)
        report(saved["rows"], saved["args"], a.replot[:-len(".json")])
        return

    tumble, gen = build()
    tumble = a.tumble or tumble
    path = trees(tumble)
    policies = a.policies.split(",")
    rates = [float(r) for r in a.rates.split(",")]
    servers = {pol: Server(tumble, pol, a) for pol in policies}
    rows = []
    try:
        for s in servers.values():
            load(gen, s, path, 50, 2, 99)  # warm-up: packed weights, allocator, caches
            s.idle()
        sweep = [(rnd, rate) for rnd in range(a.rounds) for rate in rates]
        for k, (rnd, rate) in enumerate(sweep):
            order = policies[k % len(policies):] + policies[:k % len(policies)]
            for pol in order:
                s = servers[pol]
                before = s.metrics()
                r = load(gen, s, path, rate, a.seconds, k)
                s.idle()
                after = s.metrics()
                steps = after.get("tumble_steps_total", 0) - before.get("tumble_steps_total", 0)
                inst = after.get("tumble_batch_size_sum", 0) - before.get("tumble_batch_size_sum", 0)
                r.update(policy=pol, round=rnd, mean_batch=(inst / steps if steps else None))
                rows.append(r)
                print(f"{pol:>10} rate {rate:6.0f}: thr {r['throughput']:7.1f}/s  "
                      f"p50 {fmt(r['p50'])}  p90 {fmt(r['p90'])}  p99 {fmt(r['p99'])} ms  "
                      f"errors {r['errors']} {r['codes']}  mean batch {fmt(r['mean_batch'])}",
                      flush=True)
        soak = None
        soak_server = next((p for p in policies if p.startswith("continuous")), None)
        if a.soak and soak_server:
            s = servers[soak_server]
            rss0 = s.rss_kib()
            seconds = a.soak / a.soak_rate * 1.5 + 10
            r = load(gen, s, path, a.soak_rate, seconds, 7, a.soak)
            s.idle()
            rss1 = s.rss_kib()
            soak = dict(requests=r["sent"], ok=r["ok"], errors=r["errors"], rate=a.soak_rate,
                        throughput=r["throughput"], p50=r["p50"], p99=r["p99"],
                        rss_before_kib=rss0, rss_after_kib=rss1)
            print(f"soak: {soak}", flush=True)
    finally:
        for s in servers.values():
            s.stop()

    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    stem = a.out or os.path.join(HERE, "results", f"serve_load-{stamp}")
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(dict(args=vars(a), rows=rows, soak=soak, cpu=os.cpu_count()), f, indent=1)

    report(rows, vars(a), stem)


if __name__ == "__main__":
    main()
