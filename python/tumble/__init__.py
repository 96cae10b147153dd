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
    """Structural equality over outputs: arrays by shape, dtype and values."""
    if isinstance(a, _np.ndarray) or isinstance(b, _np.ndarray):
        return (
            isinstance(a, _np.ndarray)
            and isinstance(b, _np.ndarray)
            and a.dtype == b.dtype
            and _np.array_equal(a, b)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


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


def to_json(value: Any) -> Any:
    """An output in the JSON encoding of ``tumble run`` (arrays as nested lists, constructors as
    ``{"Name": [fields]}``, tuples and lists as lists), e.g. to compare with the CLI's output."""
    if isinstance(value, _np.ndarray):
        return value.tolist()
    if isinstance(value, Ctor):
        return {value.name: [to_json(f) for f in value.fields]}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


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
