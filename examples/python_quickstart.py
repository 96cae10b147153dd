"""tumble from Python: load a model, run it on numpy data, read the outputs.

    pip install ./python              # builds the package from source (needs cargo)
    python examples/python_quickstart.py
"""

from pathlib import Path

import numpy as np

import tumble

root = Path(__file__).resolve().parents[1]

# TreeLSTM over parse trees, with seeded random weights (params="w.safetensors" loads real ones).
model = tumble.load(root / "models/treelstm_small.rly", random_params=0)
print(model)
print("inputs:", model.inputs)
print("parameters:", {k: v for k, v in list(model.parameters.items())[:3]}, "...")


def leaf(word: int) -> tumble.Ctor:
    return tumble.Ctor("Rose", np.array([word], dtype=np.int32), [])


def node(*children: tumble.Ctor) -> tumble.Ctor:
    return tumble.Ctor("Rose", np.array([0], dtype=np.int32), list(children))


# An instance is a dict keyed by @main's inputs; here `tree: Tree[Tensor[(1), int32]]`.
instances = [
    {"tree": node(leaf(12), leaf(7))},
    {"tree": node(node(leaf(3), leaf(4)), leaf(5))},
    # The CLI's JSON encoding works as well.
    {"tree": {"Rose": [[0], [{"Rose": [[20], []]}, {"Rose": [[21], []]}]]}},
]
outputs = model.run(instances, batch=64, threads=1)
for i, logits in enumerate(outputs):
    print(f"instance {i}: logits {np.round(logits, 4).tolist()} -> class {int(logits.argmax())}")

# Errors name the instance and the place inside it.
try:
    model.run([{"tree": node(leaf(1), leaf(2.5))}])
except tumble.InputError as e:
    print("InputError:", e)
