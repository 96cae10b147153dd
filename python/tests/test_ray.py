"""tumble.ray.Predictor on a local Ray cluster (skipped when ray is not installed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tumble
from conftest import EXAMPLES, MODELS, read_jsonl

ray = pytest.importorskip("ray")


def test_predictor_alone_matches_model_run():
    import tumble.ray

    lines = [json.dumps(t) for t in read_jsonl(EXAMPLES / "treelstm.jsonl")]
    p = tumble.ray.Predictor(str(MODELS / "treelstm_small.rly"), random_params=0, json_column="text", batch=4)
    cols = p({"text": np.array(lines, dtype=object)})
    model = tumble.load(MODELS / "treelstm_small.rly", random_params=0)
    want = model.run(read_jsonl(EXAMPLES / "treelstm.jsonl"), batch=4, threads=1)
    np.testing.assert_array_equal(cols["output"], np.stack(want))


def test_map_batches_on_a_local_cluster():
    import tumble.ray

    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        lines = [json.dumps(t) for t in read_jsonl(EXAMPLES / "treelstm.jsonl")]
        ds = ray.data.from_items([{"text": l} for l in lines])
        out = ds.map_batches(
            tumble.ray.Predictor,
            fn_constructor_kwargs=dict(model=str(MODELS / "treelstm_small.rly"), random_params=0, json_column="text"),
            batch_size=4, concurrency=2, num_cpus=1,
        ).take_all()
        assert len(out) == len(lines)
        assert all(np.asarray(r["output"]).shape == (1, 5) for r in out)
    finally:
        ray.shutdown()
