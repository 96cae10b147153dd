"""tumble: run dynamic deep-learning models (Relay text format) with automatic batching.

>>> import numpy as np, tumble
>>> model = tumble.load("models/treelstm_small.rly", random_params=0)
>>> leaf = lambda w: tumble.Ctor("Rose", np.array([w], dtype=np.int32), [])
>>> tree = tumble.Ctor("Rose", np.array([0], dtype=np.int32), [leaf(12), leaf(7)])
>>> [logits] = model.run([{"tree": tree}], batch=64, threads=1)

Instances are shaped like the JSON the ``tumble run`` CLI reads: a dict per instance keyed by
``@main``'s argument names; numpy arrays (the declared dtype) or nested lists / Python numbers for
tensors; lists for ``List[T]``; tuples (or lists) for tuples; ``tumble.Ctor(name, *fields)`` or
``{"Name": [fields...]}`` for other constructors. Outputs come back the same way, tensors as numpy
arrays and constructors as ``tumble.Ctor``.
"""

from __future__ import annotations

import math as _math
from typing import Any

import numpy as _np


class Ctor:
    """A value of an algebraic data type: constructor ``name`` applied to ``fields``.

    ``Ctor("Rose", np.array([3], np.int32), [])`` is the tree leaf the JSON encoding writes as
    ``{"Rose": [[3], []]}``. Equality compares names and fields (numpy arrays by value).
    """

    __slots__ = ("name", "fields")
    __match_args__ = ("name", "fields")

    def __init__(self, name: str, *fields: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Ctor: the constructor name must be a str, not {type(name).__name__}")
        self.name = name
        self.fields = tuple(fields)

    def __repr__(self) -> str:
        inner = ", ".join([repr(self.name)] + [repr(f) for f in self.fields])
        return f"Ctor({inner})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ctor):
            return NotImplemented
        return self.name == other.name and _equal(self.fields, other.fields)

    __hash__ = None  # type: ignore[assignment]


def _equal(a: Any, b: Any) -> bool:
    """Structural equality over outputs: arrays by shape, dtype and values (NaN equal to NaN, as
    the same output computed twice is). Iterative: outputs nest as deep as the trees a model
    builds, far past Python's recursion limit."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if isinstance(x, _np.ndarray) or isinstance(y, _np.ndarray):
            if not (
                isinstance(x, _np.ndarray)
                and isinstance(y, _np.ndarray)
                and x.dtype == y.dtype
                and _np.array_equal(x, y, equal_nan=x.dtype.kind in "fc")
            ):
                return False
        elif isinstance(x, Ctor) or isinstance(y, Ctor):
            if not (isinstance(x, Ctor) and isinstance(y, Ctor) and x.name == y.name):
                return False
            stack.append((x.fields, y.fields))
        elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if type(x) is not type(y) or len(x) != len(y):
                return False
            stack.extend(zip(x, y))
        elif isinstance(x, dict) or isinstance(y, dict):
            if not (isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys()):
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif not (x == y or (x != x and y != y)):
            return False
    return True


from ._tumble import (  # noqa: E402  (Ctor must exist before the extension looks it up)
    CheckError,
    Error,
    InputError,
    Model,
    ParamError,
    RunError,
    load,
    loads,
    set_max_memory,
)


def _array_json(a: _np.ndarray) -> Any:
    if a.dtype.kind == "f" and not _np.isfinite(a).all():
        # JSON has no NaN or infinity: the CLI writes them as null.
        o = a.astype(object)
        o[~_np.isfinite(a)] = None
        return o.tolist()
    return a.tolist()


def to_json(value: Any) -> Any:
    """An output in the JSON encoding of ``tumble run`` (arrays as nested lists, constructors as
    ``{"Name": [fields]}``, tuples and lists as lists, NaN and infinities as ``None``, as the CLI
    writes them), e.g. to compare with the CLI's output. Iterative, for outputs of any depth."""
    # A stack of (value, the list its conversion goes into, the index there): a container's
    # converted form is placed first, its elements filled in as they come off the stack.
    root: list = [None]
    stack: list = [(value, root, 0)]
    while stack:
        v, parent, i = stack.pop()
        if isinstance(v, _np.ndarray):
            parent[i] = _array_json(v)
        elif isinstance(v, (float, _np.floating)):
            parent[i] = float(v) if _math.isfinite(v) else None
        elif isinstance(v, Ctor):
            fields: list = [None] * len(v.fields)
            parent[i] = {v.name: fields}
            stack.extend((f, fields, j) for j, f in enumerate(v.fields))
        elif isinstance(v, (list, tuple)):
            items: list = [None] * len(v)
            parent[i] = items
            stack.extend((x, items, j) for j, x in enumerate(v))
        else:
            parent[i] = v
    return root[0]


__all__ = [
    "CheckError",
    "Ctor",
    "Error",
    "InputError",
    "Model",
    "ParamError",
    "RunError",
    "load",
    "loads",
    "set_max_memory",
    "to_json",
]
