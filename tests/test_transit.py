"""What fails on its way between the parent and a worker fails one future, and what the
standard pickler finds by name travels by name.

* A call's exception that cannot be pickled in the worker, or pickled but cannot be
  rebuilt in the parent, fails its own future only (with an error that names its type
  and carries the worker's traceback as text), alone or in a batch: the worker lives,
  the pool is not broken, the other calls of the batch get their results. So do an
  argument or a result that fails to pickle or to rebuild.
* A class or function whose module was not imported yet, but which the standard
  pickler finds by importing it (``np.recarray``, of ``numpy.rec``), arrives as itself,
  not as a copy made by value: checked in a fresh interpreter that never imports that
  module.

Transport semantics (``conftest``): under the default start method and spawn. What a
worker has imported at its start is all that differs between start methods here, and
these two are its extremes (forks of a server that preloaded NumPy; a fresh interpreter).
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pytest
import transit_workers
from conftest import method_id

import sharexec

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]

# What goes wrong with the bad call -> the error its future raises, and its message.
EXPECTED: dict[str, tuple[type[BaseException], str]] = {
    "unrebuildable exception": (
        sharexec.ResultError,
        r"the task raised transit_workers\.RebuildFails, which could not be rebuilt here",
    ),
    "unpicklable exception": (
        RuntimeError,
        r"the task raised transit_workers\.HoldsLock: holds a lock, which cannot be sent back",
    ),
    "unpicklable result": (TypeError, "generator"),
    "unrebuildable result": (sharexec.ResultError, "could not be rebuilt here"),
    "unpicklable argument": (pickle.PicklingError, "Could not pickle the task"),
    "unrebuildable argument": (ValueError, "cannot be rebuilt in a worker"),
}


def bad_call(case: str) -> tuple[Any, ...]:
    """The arguments of ``transit_workers.outcome`` for a call that fails as ``case`` says."""
    parent = os.getpid()
    if case == "unpicklable argument":
        return (0, threading.Lock())
    if case == "unrebuildable argument":
        return (0, transit_workers.OnlyInParent(parent))
    return (0, case, parent)


def check_failure(error: BaseException | None, case: str) -> None:
    """``error`` is what ``case`` expects; an exception of the task's names its type and
    carries the worker's traceback, as text, down its chain of causes."""
    kind, message = EXPECTED[case]
    assert error is not None, f"{case}: the call did not fail"
    assert type(error) is kind, f"{case}: {error!r}"
    assert re.search(message, str(error)), f"{case}: {error!r}"
    if case.endswith("exception"):
        causes = []
        cause = error.__cause__
        while cause is not None:
            causes.append(str(cause))
            cause = cause.__cause__
        remote = "\n".join(causes)
        raised = "RebuildFails" if case.startswith("unrebuildable") else "HoldsLock"
        assert f"transit_workers.{raised}" in remote, remote  # the worker's traceback
        assert 'transit_workers.py", line' in remote and "in outcome" in remote, remote


@contextmanager
def workers_held(ex: sharexec.SharedProcessPoolExecutor) -> Iterator[None]:
    """Both workers run a call that blocks until the block ends: calls submitted inside
    queue up, and leave in batches once the workers are free."""
    with get_context("spawn").Manager() as manager:
        started, go = manager.Queue(), manager.Event()
        blockers = [ex.submit(transit_workers.started_then_wait, started, go) for _ in range(2)]
        try:
            for _ in blockers:
                started.get(timeout=60)
            yield
        finally:
            go.set()
            assert [b.result(timeout=60) for b in blockers] == [True, True]


@pytest.mark.parametrize("case", list(EXPECTED))
@pytest.mark.timeout(60)
def test_a_call_failing_in_transit_fails_its_own_future(executor, case):
    before = executor.submit(transit_workers.outcome, 1)
    bad = executor.submit(transit_workers.outcome, *bad_call(case))
    after = executor.submit(transit_workers.outcome, 2)
    check_failure(bad.exception(timeout=30), case)
    assert (before.result(timeout=30), after.result(timeout=30)) == (1, 2)
    # The pool goes on (and the executor fixture checks it was never broken).
    assert executor.submit(transit_workers.outcome, 3).result(timeout=30) == 3


@pytest.mark.parametrize("case", list(EXPECTED))
@pytest.mark.timeout(90)
def test_a_call_failing_in_transit_fails_alone_in_its_batch(executor, case):
    assert executor.submit(transit_workers.outcome, 0).result(timeout=30) == 0  # measured
    calls, bad = 400, 200  # when the bad call leaves, 200 calls wait: it goes in a batch
    with workers_held(executor):
        futures = [
            executor.submit(transit_workers.outcome, *(bad_call(case) if i == bad else (i,)))
            for i in range(calls)
        ]
    for i, future in enumerate(futures):
        if i == bad:
            check_failure(future.exception(timeout=60), case)
        else:
            assert future.result(timeout=60) == i
    assert executor.statistics().tasks_batched >= calls // 2
    assert executor.submit(transit_workers.outcome, 3).result(timeout=30) == 3


# ---------------------------------------------------------------------------------------
# Classes and functions of modules not imported yet
# ---------------------------------------------------------------------------------------

# A package whose public names live in a module that importing the package leaves out,
# as numpy.rec's do; and a class whose module does not exist (it goes by value).
LAZY_PACKAGE = {
    "__init__.py": """
        class Point:
            __module__ = "lazypkg.public"  # where users import it from, as numpy does

            def __init__(self, x):
                self.x = x


        def norm(p):
            return abs(p.x)


        norm.__module__ = "lazypkg.public"


        class Ghost:
            __module__ = "lazypkg_no_such_module"

            def __init__(self, x):
                self.x = x
    """,
    "public.py": """
        from lazypkg import Point, norm
    """,
}

SCRIPT = """
    import sys

    import numpy as np

    import lazypkg
    import sharexec


    def make_recarray():
        return np.zeros(3, dtype=[("a", "i8"), ("b", "f8")]).view(np.recarray)


    def first_row(r):
        return type(r).__module__, type(r).__name__, r[1].tolist(), int(r.a.sum())


    def what_arrived(p, fn, ghost):
        import lazypkg.public

        return type(p) is lazypkg.public.Point, fn is lazypkg.public.norm, fn(p), ghost.x


    if __name__ == "__main__":
        method = None if sys.argv[1] == "default" else sys.argv[1]
        assert "numpy.rec" not in sys.modules and "lazypkg.public" not in sys.modules
        with sharexec.SharedProcessPoolExecutor(1, mp_context=method) as ex:
            # Made by a worker that never imported numpy.rec, indexed here.
            r = ex.submit(make_recarray).result(timeout=60)
            assert type(r) is np.recarray, type(r)
            assert r[1].tolist() == (0, 0.0) and int(r.a.sum()) == 0
            # Sent from here (numpy.rec imported meanwhile, or not: a fresh array).
            r = np.ones(3, dtype=[("a", "i8"), ("b", "f8")]).view(np.recarray)
            got = ex.submit(first_row, r).result(timeout=60)
            assert got == ("numpy.rec", "recarray", (1, 1.0), 3), got
            got = ex.submit(
                what_arrived, lazypkg.Point(-2), lazypkg.norm, lazypkg.Ghost(5)
            ).result(timeout=60)
            assert got == (True, True, 2, 5), got
        print("ok")
"""


@pytest.mark.timeout(100)
def test_classes_of_modules_not_imported_travel_by_name(start_method, tmp_path, no_leaks):
    package = tmp_path / "lazypkg"
    package.mkdir()
    for name, text in LAZY_PACKAGE.items():
        (package / name).write_text(textwrap.dedent(text))
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script), method_id(start_method)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=Path(tmp_path),
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
