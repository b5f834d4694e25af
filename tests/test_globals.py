"""What a worker's globals are: functions of the main script share one namespace per
worker, as when the standard library imports the script again in a worker.

Functions must be defined in a real ``__main__`` for this (cloudpickle sends them by
value), so each test writes a small script and runs it in a fresh interpreter, once with
sharexec and once with ``concurrent.futures.ProcessPoolExecutor`` under the same start
method (spawn for sharexec's default and loky's, which start fresh interpreters too).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import method_id, module_by_value

from sharexec import _wire

SCRIPT = """
import concurrent.futures
import functools
import json
import multiprocessing
import os
import sys

import sharexec

CACHE = {}
COUNT = 0
SCALE = 1


class Box:
    def __init__(self, value):
        self.value = value


def init(x):
    CACHE["x"] = x
    CACHE["box"] = Box(x)


def get(key):
    return CACHE[key]


def put(key, value):
    CACHE[key] = value


def bump(_):
    global COUNT
    COUNT += 1
    return COUNT


def count(_):
    return COUNT


def boxed(_):
    return isinstance(CACHE["box"], Box) and CACHE["box"].value


def same_class(box):
    return type(box) is type(CACHE["box"]) and isinstance(box, Box)


def late(_):
    return LATE


def scaled(x):
    return x * SCALE


def scaled_again(x):
    return x * SCALE


def helper():
    return bump(None)


def via_helper(_):
    return helper()


def pid_and_count(_):
    return os.getpid(), bump(None)


get_by_lambda = lambda key: CACHE[key]  # noqa: E731


def reader(key):
    return lambda _: CACHE[key]  # a closure: pickled with each call, never cached


def fail(_):
    raise RuntimeError("boom")  # the line its traceback shows


def traceback_of(ex):
    # What the cause of a task's exception shows: its type, the script's file and line.
    try:
        ex.submit(fail, 0).result()
    except RuntimeError as exc:
        cause = exc.__cause__
        kind = type(cause).__module__ + "." + type(cause).__qualname__
        return [kind, f'File "{__file__}"' in cause.tb, "# the line its traceback" in cause.tb]


def main(impl, method):
    if impl == "stdlib":
        context = multiprocessing.get_context("spawn" if method in ("default", "loky") else method)

        def executor(workers, **kwargs):
            return concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, **kwargs)

    else:
        mp_context = None if method == "default" else method

        def executor(workers, **kwargs):
            return sharexec.SharedProcessPoolExecutor(workers, mp_context=mp_context, **kwargs)

    out = {}

    def record(name, call):
        try:
            out[name] = call()
        except Exception as exc:
            out[name] = type(exc).__name__

    with executor(1, initializer=init, initargs=(42,)) as ex:
        # What the initializer set, seen by a task.
        record("initializer", lambda: ex.submit(get, "x").result())
        # A task's traceback names the script's file and shows its line.
        record("traceback", lambda: traceback_of(ex))
        record("class of the initializer", lambda: ex.submit(boxed, 0).result())
        record("class of an argument", lambda: ex.submit(same_class, Box(1)).result())
        # Two tasks talk through a global: a mutated dict, a rebound name.
        record("put", lambda: ex.submit(put, "y", 7).result())
        record("then get", lambda: ex.submit(get, "y").result())
        record("bumps", lambda: [ex.submit(bump, 0).result() for _ in range(3)])
        record("count", lambda: ex.submit(count, 0).result())
        # A function reached through another's globals runs in the same namespace.
        record("through a helper", lambda: ex.submit(via_helper, 0).result())
        # Partials of the script's functions.
        record("partial put", lambda: ex.submit(functools.partial(put, "z"), 8).result())
        record("partial get", lambda: ex.submit(functools.partial(get, "z")).result())
        record("map", lambda: list(ex.map(get, ["x", "y", "z"], chunksize=2)))
        # A name the worker has keeps the worker's value: the parent's later change of a
        # global is not seen (the worker imported or forked the script before it).
        record("scale before", lambda: ex.submit(scaled, 3).result())
        global SCALE
        SCALE = 10
        record("scale after", lambda: ex.submit(scaled_again, 3).result())
        if impl == "sharexec":  # the standard pickler cannot send these
            record("lambda", lambda: ex.submit(get_by_lambda, "z").result())
            record("inline lambda", lambda: ex.submit(lambda k: CACHE[k], "y").result())
            record("closure", lambda: ex.submit(reader("x"), 0).result())
            # A global the worker lacks is added (spawn's import of the script would
            # not define it: it is set under the main guard).
            global LATE
            LATE = 9
            record("late global", lambda: ex.submit(late, 0).result())
    SCALE = 1

    # A recycled worker starts fresh, and its initializer runs again.
    if method != "fork":  # max_tasks_per_child needs another start method
        with executor(1, initializer=init, initargs=(5,), max_tasks_per_child=1) as ex:
            record("recycled put", lambda: ex.submit(put, "x", 6).result())
            record("recycled get", lambda: ex.submit(get, "x").result())
            record("recycled count", lambda: [ex.submit(bump, 0).result() for _ in range(2)])

    # Many tiny calls (sent together by sharexec): every worker counts its own.
    n = 2000
    with executor(2) as ex:
        futures = [ex.submit(pid_and_count, i) for i in range(n)]
        last = {}
        for future in futures:
            pid, seen = future.result()
            last[pid] = max(last.get(pid, 0), seen)
        out["tiny calls counted"] = sum(last.values()) == n
        if impl == "sharexec":  # and they were sent together
            out["batched"] = ex.statistics().tasks_batched > 0
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
"""


def run_script(path: Path, impl: str, method: str) -> dict[str, Any]:
    """Run the script with ``impl`` under ``method``; its records, by name."""
    done = subprocess.run(
        [sys.executable, str(path), impl, method],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    records: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return records


@pytest.mark.timeout(320)
def test_functions_of_the_script_share_one_namespace_per_worker(
    start_method: str | None, tmp_path: Path, no_leaks: None
) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    method = method_id(start_method)
    ours = run_script(script, "sharexec", method)
    theirs = run_script(script, "stdlib", method)

    assert ours["initializer"] == 42
    assert ours["traceback"] == ["concurrent.futures.process._RemoteTraceback", True, True]
    assert ours["class of the initializer"] == 42
    assert ours["class of an argument"] is True
    assert ours["then get"] == 7
    assert ours["bumps"] == [1, 2, 3]
    assert ours["count"] == 3
    assert ours["through a helper"] == 4
    assert ours["partial get"] == 8
    assert ours["map"] == [42, 7, 8]
    assert ours["scale before"] == ours["scale after"] == 3
    assert ours["lambda"] == 8
    assert ours["inline lambda"] == 7
    assert ours["closure"] == 42
    assert ours["late global"] == 9
    if start_method != "fork":
        assert ours["recycled get"] == 5
        assert ours["recycled count"] == [1, 1]
    assert ours["tiny calls counted"] is True
    assert ours["batched"] is True
    # And all of it as the standard library's executor does.
    assert {name: ours[name] for name in theirs} == theirs


MODULE = """
STATE = {"calls": 0}
LIMIT = 3


def step():
    STATE["calls"] += 1
    return STATE["calls"], LIMIT


def limit():
    return LIMIT
"""


@pytest.fixture
def by_value_module() -> Iterator[types.ModuleType]:
    """A module pickled by value (as ``__main__`` is), dropped afterwards with the
    namespace this process made of it."""
    with module_by_value(f"sharexec_test_by_value_{os.getpid()}", MODULE) as module:
        yield module


def test_the_rule_of_what_a_later_pickle_adds(by_value_module: types.ModuleType) -> None:
    # One pickle per function, as an executor sends them.
    step = _wire.dumps_sharing_globals(by_value_module.step)
    limit = _wire.dumps_sharing_globals(by_value_module.limit)
    first = pickle.loads(step)
    assert first() == (1, 3)
    by_value_module.LIMIT = 5  # the parent changes a global the receiver has
    by_value_module.STATE["calls"] = 100
    again, other = (
        pickle.loads(_wire.dumps_sharing_globals(by_value_module.step)),
        pickle.loads(limit),
    )
    # One namespace: the receiver's values stay, whatever the later pickles carried.
    assert first.__globals__ is again.__globals__ is other.__globals__
    assert again() == (2, 3)
    assert other() == 3
    assert first.__globals__ is not by_value_module.__dict__
    # A name the receiver lacks is added.
    by_value_module.ADDED = 7
    exec("def added():\n    return ADDED\n", by_value_module.__dict__)
    assert pickle.loads(_wire.dumps_sharing_globals(by_value_module.added))() == 7
    assert first.__globals__["ADDED"] == 7


def test_functions_of_no_module_keep_globals_of_their_own() -> None:
    # exec over a dict of its own: no module's namespace to share, cloudpickle's rule.
    scope: dict[str, Any] = {"__name__": "__main__", "X": 1}
    exec("def f():\n    return X\n", scope)
    one = pickle.loads(_wire.dumps_sharing_globals(scope["f"]))
    two = pickle.loads(_wire.dumps_sharing_globals(scope["f"]))
    assert one() == two() == 1
    assert one.__globals__ is not two.__globals__


LARGE_GLOBALS = """
import concurrent.futures
import json
import multiprocessing
import sys

import numpy as np

import sharexec

DATA = np.zeros(100_000)  # 800 KB: sent through shared memory
SMALL = [0.0]


def first(_):
    return float(DATA[0]), SMALL[0]


def main(impl, method):
    if impl == "stdlib":
        context = multiprocessing.get_context("spawn" if method in ("default", "loky") else method)
        ex = concurrent.futures.ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=1)
    else:
        mp_context = None if method == "default" else method
        ex = sharexec.SharedProcessPoolExecutor(1, mp_context=mp_context, max_tasks_per_child=1)
    with ex:
        out = {"first worker": ex.submit(first, 0).result()}
        DATA[0] = SMALL[0] = 5.0  # after the function was first sent
        out["next worker"] = ex.submit(first, 0).result()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
"""


@pytest.mark.timeout(200)
def test_a_function_with_large_globals_carries_them_as_first_sent(
    start_method: str | None, tmp_path: Path, no_leaks: None
) -> None:
    # Each call has a new worker (max_tasks_per_child=1): its namespace is made from the
    # globals the function had when the executor first sent it, as for any function,
    # whatever the size of its globals (an array copied once into shared memory).
    if start_method == "fork":
        pytest.skip("max_tasks_per_child is refused with fork")
    script = tmp_path / "script.py"
    script.write_text(LARGE_GLOBALS)
    method = method_id(start_method)
    ours = run_script(script, "sharexec", method)
    assert ours == {"first worker": [0.0, 0.0], "next worker": [0.0, 0.0]}
    assert ours == run_script(script, "stdlib", method)
