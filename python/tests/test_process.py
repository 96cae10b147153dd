"""The package inside a Python process: Ctrl-C, fork, numpy scalars and arrays it cannot
allocate, outputs deeper than Python's recursion limit (a read-only audit's finds; each test
failed before its fix)."""

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tumble


def run_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `body` in a fresh interpreter (signals, rlimits and forks stay out of pytest's)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ctrl_c_stops_a_run_that_never_ends_and_later_runs_work():
    # A recursion without a base case in constant memory: only an interrupt stops it.
    r = run_script(
        """
        import os, signal, threading, time
        import tumble
        m = tumble.loads('''
        def @loop(%n: Tensor[(), int32]) -> Tensor[(), int32] { if (%n < 0) { %n } else { @loop(%n) } }
        def @main(%n: Tensor[(), int32]) -> Tensor[(), int32] { @loop(%n) }
        ''')
        def ctrl_c():
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=ctrl_c, daemon=True).start()
        t0 = time.monotonic()
        try:
            m.run([{"n": 1}], threads=1)
            print("finished?")
        except KeyboardInterrupt:
            print("interrupted after", round(time.monotonic() - t0, 1))
        # The interrupt ended with the call: the next one runs.
        print(m.run([{"n": -3}])[0].tolist())
        """,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    assert lines[0].startswith("interrupted after"), r.stdout
    assert float(lines[0].split()[-1]) < 10
    assert lines[1] == "-3", r.stdout


LOOP = """
def @loop(%n: Tensor[(), int32]) -> Tensor[(), int32] { if (%n < 0) { %n } else { @loop(%n) } }
def @main(%n: Tensor[(), int32]) -> Tensor[(), int32] { @loop(%n) }
"""


def test_a_timeout_stops_one_run_and_later_runs_work():
    m = tumble.loads(LOOP)
    for workers in (1, 2):
        # Two mini-batches on two workers: both stop (a worker polls the call's own stop too).
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"within its timeout of 300 ms \(timeout=\)"):
            m.run([{"n": 1}, {"n": 2}], batch=1, threads=2, workers=workers, timeout=0.3)
        assert time.monotonic() - t0 < 10
    # A run that finishes in time is not affected, nor is the next call.
    assert m.run([{"n": -3}], timeout=30.0)[0].tolist() == -3
    assert m.run([{"n": -4}])[0].tolist() == -4
    for bad in (0, -1.0, float("nan"), float("inf"), 1e300, 10**400):
        with pytest.raises(ValueError, match="timeout: expected a positive number of seconds") as e:
            m.run([{"n": -1}], timeout=bad)
        assert len(str(e.value)) < 200, str(e.value)
    for bad in (True, "1", [1.0]):
        with pytest.raises(TypeError, match="timeout: expected a positive number of seconds"):
            m.run([{"n": -1}], timeout=bad)
    # A call that fails for its own reason is not a timeout, even past its deadline (it was
    # reported as one whenever the deadline had passed).
    with pytest.raises(ValueError, match="threads"):
        m.run([{"n": -1}], threads=0, timeout=1e-6)


def test_a_timeout_stops_a_job_of_many_short_instances():
    # Thousands of programs of a few steps each never reached the evaluator's safe point (every
    # 4,096 steps of one instance): the call ran to its end past its deadline.
    m = tumble.loads(LOOP)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        m.run([{"n": -1}] * 200_000, batch=50_000, threads=1, timeout=0.05)
    assert time.monotonic() - t0 < 5


def test_ctrl_c_stops_the_interrupted_call_only():
    # A run in another thread goes on while the main thread's call is interrupted (a Ctrl-C
    # stopped every run of the process): Python raises KeyboardInterrupt in one thread.
    r = run_script(
        """
        import os, signal, threading, time
        import tumble
        m = tumble.loads(%r)
        other = {}
        def background():
            try:
                m.run([{"n": 1}], threads=1, timeout=2.0)
                other["r"] = "finished?"
            except TimeoutError:
                other["r"] = "timed out"
            except KeyboardInterrupt:
                other["r"] = "interrupted"
        t = threading.Thread(target=background)
        t.start()
        def ctrl_c():
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=ctrl_c, daemon=True).start()
        try:
            m.run([{"n": 2}], threads=1)
            print("finished?")
        except KeyboardInterrupt:
            print("interrupted")
        t.join()
        print(other["r"])
        """
        % LOOP,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["interrupted", "timed out"], r.stdout


def test_a_forked_child_runs_models_its_parent_ran():
    r = run_script(
        """
        import multiprocessing as mp
        import tumble
        m = tumble.loads("def @main(%x: Tensor[(?), float32]) -> Tensor[(?), float32] { add(%x, %x) }")
        print(m.run([{"x": [1.0]}], threads=2)[0].tolist(), flush=True)
        # A product large enough to split across threads, in the parent and then in the child.
        big = tumble.loads("def @main(%x: Tensor[(256, 256), float32], %w: Tensor[(512, 256), float32]) { nn.dense(%x, %w) }",
                           random_params=0, inputs=["x"])
        x = [{"x": [[1.0] * 256] * 256}]
        want = big.run(x, threads=2)[0]
        def child(q):
            q.put((m.run([{"x": [2.0]}], threads=2)[0].tolist(),
                   bool((big.run(x, threads=2)[0] == want).all())))
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        p.join(20)
        if p.is_alive():
            p.kill()
            print("hung")
        else:
            print(q.get())
        """,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[2.0]", "([4.0], True)"], r.stdout


def test_long_double_scalars_are_read_as_float64_and_complex_ones_refused():
    m = tumble.loads("def @main(%x: Tensor[(), float32]) -> Tensor[(), float32] { %x }")
    assert m.run([{"x": np.longdouble(1.5)}])[0].tolist() == 1.5
    assert m.run([{"x": np.float16(2.5)}])[0].tolist() == 2.5
    with pytest.raises(tumble.InputError, match="clongdouble"):
        m.run([{"x": np.clongdouble(1.5)}])
    # A date is not a number (its `.item()` is an int of nanoseconds).
    with pytest.raises(tumble.InputError, match="datetime64"):
        m.run([{"x": np.datetime64("2020-01-01T00:00:00", "ns")}])
    b = tumble.loads("def @main(%x: Tensor[(), bool]) -> Tensor[(), bool] { %x }")
    assert b.run([{"x": np.bool_(True)}])[0].tolist() is True


def test_an_output_numpy_cannot_allocate_is_a_memory_error():
    # Under an address-space limit numpy cannot make the third 400 MB output.
    r = run_script(
        """
        import resource
        import numpy as np
        import tumble
        resource.setrlimit(resource.RLIMIT_AS, (3_000_000_000, 3_000_000_000))
        tumble.set_max_memory(None)
        m = tumble.loads("def @main(%x: Tensor[(?), float32]) -> Tensor[(?), float32] { %x }")
        big = np.ones(100_000_000, np.float32)
        try:
            m.run([{"x": big}] * 3)
            print("ran")
        except MemoryError:
            print("MemoryError")
        except BaseException as e:
            print(type(e).__name__, e)
        """,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("MemoryError", "ran"), r.stdout + r.stderr
    assert "panicked" not in r.stderr, r.stderr


def test_large_outputs_equal_small_ones():
    m = tumble.loads(
        "def @main(%x: Tensor[(?, 3), float32]) -> (Tensor[(?, 3), float32], Tensor[(?, 3), int32]) "
        "{ (multiply(%x, 2f), cast(%x, dtype=\"int32\")) }"
    )
    for n in (2, 200_000):  # 24 B and 2.4 MB: both ways of making a numpy array
        x = np.arange(3 * n, dtype=np.float32).reshape(n, 3)
        [(y, i)] = m.run([{"x": x}])
        assert y.dtype == np.float32 and y.shape == (n, 3)
        assert np.array_equal(y, x * 2)
        assert i.dtype == np.int32 and np.array_equal(i, x.astype(np.int32))


def test_deep_outputs_convert_to_json_and_compare():
    deep = tumble.Ctor("Nil")
    other = tumble.Ctor("Nil")
    for i in range(5000):
        deep = tumble.Ctor("Cons", np.array([i], np.float32), deep)
        other = tumble.Ctor("Cons", np.array([i], np.float32), other)
    assert deep == other
    j, depth = tumble.to_json(deep), 0
    while "Cons" in j:
        assert j["Cons"][0] == [4999 - depth]
        j, depth = j["Cons"][1], depth + 1
    assert depth == 5000 and j == {"Nil": []}
    # NaN and infinities as the CLI writes them; a NaN output equals itself.
    assert tumble.to_json([np.array([np.nan, 1.0, -np.inf]), np.float32("nan"), (1, 2)]) == [
        [None, 1.0, None],
        None,
        [1, 2],
    ]
    assert tumble.Ctor("A", np.array([np.nan])) == tumble.Ctor("A", np.array([np.nan]))
    assert tumble.Ctor("A", [1]) != tumble.Ctor("A", (1,))


def test_an_instance_nested_past_the_limit_gets_a_short_message():
    # 20,000 constructors deep: the decoder stops at its depth limit and shows the path by its
    # ends (the message was 60 KB of `.Cons[1]`).
    tree = tumble.Ctor("Nil")
    for _ in range(20_000):
        tree = tumble.Ctor("Cons", np.float32(1.0), tree)
    deep = tumble.loads(
        "def @main(%t: List[Tensor[(), float32]]) -> Tensor[(), float32] { 0f }"
    )
    with pytest.raises(tumble.InputError) as e:
        deep.run([{"t": tree}])
    assert "nests deeper than" in str(e.value) and "steps)" in str(e.value)
    assert len(str(e.value)) < 2000, len(str(e.value))


def test_numpy_inputs_are_held_to_the_memory_budget_as_they_are_copied():
    # 10 arrays of 10 MB under a 40 MB budget: the copy that would pass it is refused.
    r = run_script(
        """
        import numpy as np
        import tumble
        m = tumble.loads("def @main(%x: Tensor[(?), float32]) -> Tensor[(?), float32] { %x }")
        arrays = [np.ones(2_500_000, np.float32) for _ in range(10)]
        tumble.set_max_memory("40M")
        try:
            m.run([{"x": a} for a in arrays], batch=10)
            print("ran")
        except tumble.Error as e:
            print(type(e).__name__, e)
        """
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "cannot be copied in" in out and "tumble.set_max_memory" in out, out
    assert "--max-memory" not in out, out
