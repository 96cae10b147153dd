"""Batch inference with Ray Data: one loaded model per actor, instances in, outputs as columns.

    import ray, tumble.ray
    ds = ray.data.read_text("train_trees.jsonl")            # a column "text": one JSON instance per row
    out = ds.map_batches(
        tumble.ray.Predictor,
        fn_constructor_kwargs=dict(model="models/treelstm_small.rly", random_params=0,
                                   json_column="text", batch=64, threads=1),
        batch_size=256, concurrency=2, num_cpus=1,            # 2 actors, one model each
    )

Rows give instances either as JSON text in ``json_column`` (trees and other nested values, whose
varying depth Arrow cannot store as columns) or as one column per ``@main`` input (tensors and
numbers). Each output becomes a column ``output`` (a tuple output: ``output_0``, ``output_1``,
...); tensors of one shape are stacked into one n-d column, anything else is stored as its JSON
text. Input columns are dropped unless ``keep_columns`` names them.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Sequence

import numpy as np

import tumble


def _plain(value: Any) -> Any:
    """A Ray/Arrow cell as an instance value (arrays stay arrays; JSON text is parsed)."""
    if isinstance(value, (str, bytes)):
        return json.loads(value)
    return value


def _column(values: list) -> np.ndarray:
    if values and all(isinstance(v, np.ndarray) for v in values):
        if len({(v.shape, v.dtype) for v in values}) == 1:
            return np.stack(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = json.dumps(tumble.to_json(v))
    return out


class Predictor:
    """A callable class for ``Dataset.map_batches``: loads the model once per actor."""

    def __init__(
        self,
        model: str,
        *,
        params: Any = None,
        random_params: Optional[int] = None,
        inputs: Optional[Sequence[str]] = None,
        json_column: Optional[str] = None,
        batch: int = 64,
        threads: int = 1,
        keep_columns: Sequence[str] = (),
        output_column: str = "output",
    ) -> None:
        self.model = tumble.load(
            model, params=params, random_params=random_params,
            inputs=list(inputs) if inputs is not None else None,
        )
        self.json_column = json_column
        self.batch = batch
        self.threads = threads
        self.keep_columns = list(keep_columns)
        self.output_column = output_column

    def instances(self, columns: Dict[str, np.ndarray]) -> list:
        if self.json_column is not None:
            return [_plain(v) for v in columns[self.json_column]]
        names = list(self.model.inputs)
        missing = [n for n in names if n not in columns]
        if missing:
            raise tumble.InputError(
                f"the batch has no column for @main's input(s) {', '.join(missing)}; it has "
                f"{', '.join(columns)} (or pass json_column= for rows of JSON instances)"
            )
        n = len(columns[names[0]]) if names else 0
        return [{k: _plain(columns[k][i]) for k in names} for i in range(n)]

    def __call__(self, columns: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        outs = self.model.run(self.instances(columns), batch=self.batch, threads=self.threads)
        result = {k: columns[k] for k in self.keep_columns}
        if outs and all(isinstance(o, tuple) for o in outs):
            for j in range(len(outs[0])):
                result[f"{self.output_column}_{j}"] = _column([o[j] for o in outs])
        else:
            result[self.output_column] = _column(outs)
        return result
