"""TreeLSTM over SST training trees with Ray Data: one loaded model per actor.

    pip install ./python "ray[data]"
    tumble data sst --split train --format tree -o /tmp/sst_train.jsonl   # 8,544 trees
    python examples/ray_batch_inference.py /tmp/sst_train.jsonl [--limit N]

Starts a local Ray cluster (or joins one: RAY_ADDRESS=auto, see README), runs the trees with 1 and
then 2 actors of one CPU each, and prints the throughput of each.
"""

import argparse
import time
from pathlib import Path

import ray

import tumble.ray

root = Path(__file__).resolve().parents[1]

parser = argparse.ArgumentParser()
parser.add_argument("trees", help="JSON Lines of SST trees (tumble data sst --format tree)")
parser.add_argument("--limit", type=int, default=None, help="use only the first N trees")
parser.add_argument("--model", default=str(root / "models/treelstm_small.rly"))
parser.add_argument("--batch", type=int, default=64, help="instances per tumble mini-batch")
args = parser.parse_args()

lines = [l for l in Path(args.trees).read_text().splitlines() if l.strip()]
if args.limit:
    lines = lines[: args.limit]

ray.init(include_dashboard=False, ignore_reinit_error=True)
for actors in (1, 2):
    ds = ray.data.from_items([{"instance": l} for l in lines])
    out = ds.map_batches(
        tumble.ray.Predictor,
        fn_constructor_kwargs=dict(
            model=args.model, random_params=0, json_column="instance", batch=args.batch, threads=1
        ),
        batch_size=256,
        concurrency=actors,
        num_cpus=1,
    )
    start = time.perf_counter()
    n = 0
    for batch in out.iter_batches(batch_size=1024, batch_format="numpy"):
        n += len(batch["output"])
    elapsed = time.perf_counter() - start
    print(f"{actors} actor(s): {n} trees in {elapsed:.2f} s = {n / elapsed:.0f} trees/s "
          "(includes actor start-up and model loading)")
