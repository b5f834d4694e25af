"""What fails on its way between the parent and a worker fails one future.

* A call's exception that cannot be pickled in the worker, or pickled but cannot be
  rebuilt in the parent, fails its own future only (with an error that names its type
  and carries the worker's traceback as text), alone or in a batch: the worker lives,
  the pool is not broken, the other calls of the batch get their results. So do an
  argument or a result that fails to pickle or to rebuild.

Under the default start method and spawn: what a worker has imported at its start is
all that differs between start methods here, and these two are its extremes (forks of a
server that preloaded NumPy; a fresh interpreter).
"""

from __future__ import annotations

import os
import pickle
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import get_context
from typing import Any

import pytest
import transit_workers
from conftest import method_id

import sharexec

pytestmark = pytest.mark.timeout(120)

METHODS = pytest.mark.parametrize("start_method", ["spawn", None], ids=method_id)

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


@METHODS
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


@METHODS
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
