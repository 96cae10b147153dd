"""Several Python threads may run one model at once; the GIL is released while a batch runs."""

from __future__ import annotations

import threading
import time

import numpy as np

import tumble
from conftest import EXAMPLES, MODELS, read_jsonl


def test_two_threads_share_a_model():
    model = tumble.load(MODELS / "treelstm_small.rly", random_params=0)
    trees = read_jsonl(EXAMPLES / "treelstm.jsonl")
    expected = model.run(trees, threads=1)
    results: dict = {}
    errors: list = []

    def work(k: int) -> None:
        try:
            for _ in range(3):
                results[k] = model.run(trees, batch=4, threads=1)
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k in range(2):
        for x, y in zip(expected, results[k]):
            np.testing.assert_array_equal(x, y)


def test_other_python_threads_run_during_a_batch():
    model = tumble.load(MODELS / "treelstm_small.rly", random_params=0)
    trees = read_jsonl(EXAMPLES / "treelstm.jsonl") * 16
    ticks = 0
    done = threading.Event()

    def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.0005)

    t = threading.Thread(target=ticker)
    t.start()
    start = time.perf_counter()
    before = ticks
    model.run(trees, threads=1)
    elapsed = time.perf_counter() - start
    during = ticks - before
    done.set()
    t.join()
    # Holding the GIL for the whole run would leave the ticker at most a tick or two (the switch
    # interval is 5 ms); released, it ticks about once per millisecond.
    if elapsed > 0.05:
        assert during >= 5, (during, elapsed)
