"""Every error kind: a tumble.Error subclass whose message names the place."""

from __future__ import annotations

import numpy as np
import pytest

import tumble
from conftest import MODELS

ADD = """
def @main(%x: Tensor[(?), float32], %y: Tensor[(?), float32]) -> Tensor[(?), float32] {
  add(%x, %y)
}
"""


def test_errors_share_a_base_class():
    for cls in (tumble.CheckError, tumble.ParamError, tumble.InputError, tumble.RunError):
        assert issubclass(cls, tumble.Error)
        assert issubclass(cls, Exception)


def test_check_error_names_the_line():
    with pytest.raises(tumble.CheckError) as e:
        tumble.loads("def @main(%x: Tensor[(1), float32]) -> Tensor[(2), float32] {\n  %x\n}\n", name="bad.rly")
    assert "bad.rly:" in str(e.value)
    with pytest.raises(tumble.CheckError, match="cannot read the model"):
        tumble.load(MODELS / "no_such_model.rly")
    with pytest.raises(tumble.CheckError, match="parse|expected"):
        tumble.loads("def @main(", name="cut.rly")


def test_param_errors():
    path = MODELS / "treelstm_small.rly"
    with pytest.raises(tumble.ParamError, match="W_iou"):
        tumble.load(path, params={"W_iou": np.zeros((3, 3), np.float32)}, random_params=0)
    with pytest.raises(tumble.ParamError, match="no_such.safetensors"):
        tumble.load(path, params="no_such.safetensors")
    with pytest.raises(tumble.ParamError, match="expected a numpy array"):
        tumble.load(path, params={"emb": [[1.0]]})
    with pytest.raises(tumble.ParamError, match="expected a path"):
        tumble.load(path, params=3)
    with pytest.raises(tumble.ParamError, match="no argument `trees`"):
        tumble.load(path, random_params=0, inputs=["trees"])
    # Without weights or a seed every tensor argument is an input: naming the inputs makes the
    # weights missing parameters.
    with pytest.raises(tumble.ParamError, match="emb"):
        tumble.load(path, inputs=["tree"])


@pytest.fixture(scope="module")
def adder():
    return tumble.loads(ADD, name="add.rly")


def test_input_errors_name_the_instance_and_path(adder):
    ok = {"x": [1.0], "y": [2.0]}
    cases = [
        ({"x": [1.0]}, "missing key `y`"),
        ({"x": [1.0], "y": [2.0], "z": 1}, "unknown key `z`"),
        ({"x": [1.0, "a"], "y": [2.0]}, r"\.x\[1\]"),
        ({"x": np.array([1.0]), "y": [2.0]}, r"\.x: expected Tensor\[\(\?\), float32\], found a float64 array"),
        ({"x": np.array([1], np.uint8), "y": [2.0]}, r"\.x: a numpy array of dtype"),
        ({"x": object(), "y": [2.0]}, r"\.x: cannot take a object"),
        ({"x": [[1.0]], "y": [2.0]}, r"\.x"),
        ({"x": [float("nan")], "y": [2.0]}, r"\.x\[0\]: NaN"),
        ({1: [1.0]}, "not a string"),
    ]
    for bad, pattern in cases:
        with pytest.raises(tumble.InputError, match=pattern) as e:
            adder.run([ok, bad])
        assert e.value.instance == 1
        assert "index 1" in str(e.value)


def test_deep_instances_are_refused_not_crashing(adder):
    # A tensor nested too deep is a type error at the first level too many.
    deep: list = [1.0]
    for _ in range(20_000):
        deep = [deep]
    with pytest.raises(tumble.InputError, match=r"\.x\[0\]: expected a float32 element"):
        adder.run([{"x": deep, "y": [1.0]}])
    # A tree of a legal type but 20,000 levels deep passes the decoder's depth limit.
    model = tumble.load(MODELS / "treelstm_small.rly", random_params=0)
    tree = {"Rose": [[1], []]}
    for _ in range(20_000):
        tree = {"Rose": [[0], [tree]]}
    with pytest.raises(tumble.InputError, match="deeper than"):
        model.run([{"tree": tree}])
    # The same nesting as tumble.Ctor values.
    tree = tumble.Ctor("Rose", np.array([1], np.int32), [])
    for _ in range(20_000):
        tree = tumble.Ctor("Rose", [0], [tree])
    with pytest.raises(tumble.InputError, match="deeper than"):
        model.run([{"tree": tree}])


def test_run_error_names_the_instance_and_source(adder):
    with pytest.raises(tumble.RunError) as e:
        adder.run([{"x": [1.0], "y": [2.0]}, {"x": [1.0, 2.0], "y": [1.0, 2.0, 3.0]}], threads=1)
    assert e.value.instance == 1
    assert "add.rly" in str(e.value)


def test_bad_options_are_value_errors(adder):
    inst = [{"x": [1.0], "y": [2.0]}]
    with pytest.raises(ValueError, match="batch"):
        adder.run(inst, batch=0)
    with pytest.raises(ValueError, match="threads"):
        adder.run(inst, threads=0)
    with pytest.raises(ValueError, match="unknown scheduler"):
        adder.run(inst, scheduler="fifo")
    with pytest.raises(ValueError, match="wrap one instance in a list"):
        adder.run(inst[0])
    with pytest.raises(ValueError, match="sequence of instances"):
        adder.run(3)
    assert adder.run([]) == []
