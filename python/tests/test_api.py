"""The Python face: loading, parameters, encodings of instances and outputs."""

from __future__ import annotations

import numpy as np
import pytest

import tumble
from conftest import EXAMPLES, MODELS, read_jsonl

# Lists, tuples, an Option and a parameter in one small model.
SUM = """
def @main(%xs: List[Tensor[(1, 2), float32]], %w: Tensor[(2, 2), float32])
    -> (Tensor[(1, 2), float32], Option[Tensor[(1, 2), float32]], List[Tensor[(1, 2), float32]]) {
  let %s = @foldl(fn (%acc: Tensor[(1, 2), float32], %x: Tensor[(1, 2), float32]) {
    add(%acc, nn.dense(%x, %w))
  }, zeros(shape=[1, 2], dtype="float32"), %xs);
  let %h = match (%xs) {
    Cons(%x, _) => Some(%x),
    Nil => None,
  };
  (%s, %h, %xs)
}
"""

W = np.array([[1.0, 0.0], [0.0, 2.0]], dtype=np.float32)


@pytest.fixture(scope="module")
def summer():
    return tumble.loads(SUM, params={"w": W}, name="sum.rly")


def test_model_describes_itself(summer):
    assert summer.parameters == {"w": ((2, 2), "float32")}
    assert list(summer.inputs) == ["xs"]
    assert "List" in summer.inputs["xs"]
    assert "@main" in summer.check()
    assert "kernel plan" in summer.explain()
    assert "sum.rly" in repr(summer)
    np.testing.assert_array_equal(summer.parameter("w"), W)
    with pytest.raises(tumble.ParamError, match="no parameter `v`"):
        summer.parameter("v")


def test_outputs_keep_their_shapes(summer):
    [out] = summer.run([{"xs": [np.array([[1, 2]], np.float32), np.array([[3, 4]], np.float32)]}])
    assert isinstance(out, tuple) and len(out) == 3
    total, head, xs = out
    assert isinstance(total, np.ndarray) and total.dtype == np.float32 and total.shape == (1, 2)
    np.testing.assert_array_equal(total, [[4.0, 12.0]])
    assert isinstance(head, tumble.Ctor) and head.name == "Some"
    np.testing.assert_array_equal(head.fields[0], [[1.0, 2.0]])
    assert isinstance(xs, list) and len(xs) == 2
    assert tumble.to_json(out) == [[[4.0, 12.0]], {"Some": [[[1.0, 2.0]]]}, [[[1.0, 2.0]], [[3.0, 4.0]]]]


def test_empty_list_and_nullary_constructor(summer):
    [out] = summer.run([{"xs": []}])
    assert out[1] == tumble.Ctor("None")
    assert out[2] == []


def test_every_encoding_of_a_tensor_gives_the_same_result(summer):
    row = [[1.5, -2.0]]
    forms = [
        {"xs": [np.array(row, np.float32)]},
        {"xs": [row]},
        {"xs": [{"shape": [1, 2], "data": [1.5, -2.0]}]},
        {"xs": (np.array(row, np.float32),)},  # a tuple where a list is expected: still a list
        [np.array(row, np.float32)],  # a bare value: @main takes one argument from instances
        {"xs": [np.asfortranarray(np.array(row, np.float32))]},  # not C-contiguous
        {"xs": [np.array([[1.5, 0.0, -2.0]], np.float32)[:, ::2]]},  # a strided view
    ]
    outs = summer.run(forms)
    for o in outs[1:]:
        assert tumble.to_json(o) == tumble.to_json(outs[0])


def test_scalars_numpy_scalars_and_python_numbers():
    model = tumble.loads(
        """
def @main(%x: Tensor[(), float32], %n: Tensor[(), int32], %b: Tensor[(), bool]) -> Tensor[(), float32] {
  if (%b) { multiply(%x, cast(%n, dtype="float32")) } else { %x }
}
"""
    )
    outs = model.run(
        [
            {"x": 2.5, "n": 3, "b": True},
            {"x": np.float32(2.5), "n": np.int64(3), "b": np.bool_(True)},
            {"x": np.array(2.5, np.float32), "n": np.array(3, np.int32), "b": np.array(False)},
        ]
    )
    assert [float(o) for o in outs] == [7.5, 7.5, 2.5]
    assert outs[0].shape == ()


def test_bool_arrays_of_any_bytes_and_unaligned_arrays_are_read_by_value():
    # numpy keeps neither bool bytes of 0/1 nor alignment; both were read as Rust slices (a
    # `bool` byte of 2, a misaligned `&[f32]`: undefined behaviour).
    model = tumble.loads(
        """
def @main(%x: Tensor[(4), float32], %b: Tensor[(4), bool]) -> Tensor[(4), float32] {
  where(%b, %x, negative(%x))
}
"""
    )
    raw = np.frombuffer(bytes(1) + np.arange(1, 5, dtype=np.float32).tobytes(), np.float32, offset=1)
    assert not raw.flags.aligned
    odd_bools = np.array([2, 0, 255, 0], np.uint8).view(bool)
    strided = np.array([7, 9, 0, 9, 1, 9, 0, 9], np.uint8).view(bool)[::2]
    out = model.run(
        [
            {"x": raw, "b": odd_bools},
            {"x": raw[::-1].copy(), "b": strided},
            {"x": np.arange(1, 5, dtype=np.float32), "b": np.array([True, False, True, False])},
        ]
    )
    assert out[0].tolist() == [1.0, -2.0, 3.0, -4.0]
    assert out[1].tolist() == [4.0, -3.0, 2.0, -1.0]
    assert out[2].tolist() == out[0].tolist()


def test_constructors_as_ctor_or_dict():
    model = tumble.load(MODELS / "treelstm_small.rly", random_params=0)
    assert list(model.inputs) == ["tree"]
    leaf = lambda w: tumble.Ctor("Rose", np.array([w], np.int32), [])  # noqa: E731
    as_ctor = {"tree": tumble.Ctor("Rose", np.array([0], np.int32), [leaf(12), leaf(7)])}
    as_dict = {"tree": {"Rose": [[0], [{"Rose": [[12], []]}, {"Rose": [[7], []]}]]}}
    a, b = model.run([as_ctor, as_dict], threads=1)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.float32


def test_batches_threads_and_workers_do_not_change_results():
    model = tumble.load(MODELS / "treelstm_small.rly", random_params=0)
    trees = read_jsonl(EXAMPLES / "treelstm.jsonl")
    base = model.run(trees, threads=1)
    for kw in (dict(batch=3, threads=2), dict(batch=1, threads=1), dict(batch=4, workers=2, threads=2)):
        outs = model.run(trees, **kw)
        for x, y in zip(base, outs):
            np.testing.assert_array_equal(x, y)


def test_profile_and_params_files(tmp_path):
    model = tumble.load(MODELS / "treelstm_small.rly", random_params=0)
    trees = read_jsonl(EXAMPLES / "treelstm.jsonl")
    assert model.last_profile is None
    outs = model.run(trees, batch=4, threads=1, profile=True)
    assert "launch" in model.last_profile
    # The generated weights, saved as .npy files, load back as a params directory.
    for name in model.parameters:
        np.save(tmp_path / f"{name}.npy", model.parameter(name))
    again = tumble.load(MODELS / "treelstm_small.rly", params=tmp_path)
    assert all(not g for g in [again.warnings])
    for x, y in zip(outs, again.run(trees, threads=1)):
        np.testing.assert_array_equal(x, y)
    # ... and as a dict of arrays.
    as_dict = tumble.load(
        str(MODELS / "treelstm_small.rly"),
        params={n: model.parameter(n) for n in model.parameters},
    )
    np.testing.assert_array_equal(as_dict.run(trees[:1])[0], outs[0])


def test_random_draws_follow_the_seed():
    model = tumble.loads(
        """
def @main(%x: Tensor[(), float32]) -> Tensor[(), int32] {
  random.db_uniform(low=0, high=1000000, out_shape=[], out_dtype="int32")
}
"""
    )
    a = model.run([{"x": 0.0}] * 4, seed=1)
    b = model.run([{"x": 0.0}] * 4, seed=1, batch=1)
    c = model.run([{"x": 0.0}] * 4, seed=2)
    assert [int(x) for x in a] == [int(x) for x in b]
    assert [int(x) for x in a] != [int(x) for x in c]
