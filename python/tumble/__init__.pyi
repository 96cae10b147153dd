"""Type stubs of the tumble package (see the module docstring of tumble/__init__.py)."""

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

_Params = Union[str, os.PathLike, Mapping[str, np.ndarray], None]

class Ctor:
    """A value of an algebraic data type: constructor ``name`` applied to ``fields``."""

    name: str
    fields: Tuple[Any, ...]
    __match_args__ = ("name", "fields")
    def __init__(self, name: str, *fields: Any) -> None: ...

class Error(Exception):
    """Base class of tumble's errors; the message names the place."""

class CheckError(Error):
    """The model does not parse or type-check, or cannot be read."""

class ParamError(Error):
    """A parameter is missing, mistyped or misshapen, or the weights file is bad."""

class InputError(Error):
    """An instance does not match @main's argument types."""

    instance: int

class RunError(Error):
    """Running an instance failed."""

    instance: int

class Model:
    """A loaded model, its parameters bound. Safe to share between threads."""

    @property
    def parameters(self) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """name -> (shape, dtype name) of each parameter."""
    @property
    def inputs(self) -> Dict[str, str]:
        """name -> declared type of each argument the instances give."""
    @property
    def output_type(self) -> str: ...
    @property
    def warnings(self) -> List[str]: ...
    @property
    def name(self) -> str: ...
    @property
    def last_profile(self) -> Optional[str]:
        """The batching profile of the last ``run(..., profile=True)``."""
    def run(
        self,
        instances: Sequence[Any],
        batch: Optional[int] = None,
        threads: Optional[int] = None,
        workers: Optional[int] = None,
        seed: int = 0,
        scheduler: str = "inline",
        profile: bool = False,
        timeout: Optional[float] = None,
    ) -> List[Any]:
        """Runs every instance (mini-batches of ``batch`` — default: equal ones of at most 128,
        one or more per worker when each gets at least 32, as ``tumble run`` — on ``threads``
        threads, default $TUMBLE_NUM_THREADS or every core) with the GIL released; returns one
        output per instance, in order: numpy arrays, tuples, lists and ``Ctor`` values.

        Raises InputError (a bad instance: ``.instance`` and the path in the message), RunError
        (a run-time failure), ValueError (bad options), MemoryError (an output numpy cannot
        allocate), TimeoutError (``timeout`` seconds passed: the run was stopped at its next
        safe point — between instances, launches and evaluation steps, not inside one product;
        later calls run). Ctrl-C stops this call's run at its next safe point and raises
        KeyboardInterrupt (once the instance being converted from Python objects, which holds the
        GIL, is done); runs of other threads go on. Mini-batches under
        32 instances run the program ``tumble run`` runs for them (compiled on first use, without
        block merging), so the results equal the CLI's bit for bit."""
    def check(self) -> str:
        """Each user function with its inferred type, as ``tumble check`` prints them."""
    def explain(self) -> str:
        """Static optimizations, blocks, kernel plans and reuse decisions."""
    def parameter(self, name: str) -> np.ndarray:
        """A copy of a parameter's values (e.g. generated weights, to save them)."""

def load(
    path: Union[str, os.PathLike],
    params: _Params = None,
    random_params: Optional[int] = None,
    inputs: Optional[Sequence[str]] = None,
    entry: str = "main",
) -> Model:
    """Loads, checks and compiles the model at ``path`` and binds its parameters.

    ``params``: a safetensors file, a ``.npy`` file, a directory of ``.npy`` files, or a dict
    name -> numpy array; ``random_params``: a seed filling the parameters not given (normal,
    1/sqrt(fan-in)). ``inputs``: the @main arguments each instance gives (default: the ones the
    params do not give; with ``random_params``, the ones that are not tensors)."""

def loads(
    text: str,
    params: _Params = None,
    random_params: Optional[int] = None,
    inputs: Optional[Sequence[str]] = None,
    entry: str = "main",
    name: str = "<string>",
) -> Model:
    """``load`` from the model's text; ``name`` is what messages call it."""

def set_max_memory(limit: Union[int, str, None]) -> None:
    """Memory budget of runs: bytes, a size like ``"4G"``, or None for no limit."""

def to_json(value: Any) -> Any:
    """An output in the JSON encoding of ``tumble run``."""
