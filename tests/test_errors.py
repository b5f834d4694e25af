"""Bad input gets a clear error, and only its own future fails: nothing else is lost."""

from __future__ import annotations

import os
import pickle
import threading

import numpy as np
import pytest
import workers

import sharexec

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]


def test_unpicklable_argument_fails_only_its_future(executor):
    before = executor.submit(workers.total, np.ones(300_000))
    bad = executor.submit(workers.identity, (np.ones(300_000), threading.Lock()))
    after = executor.submit(workers.total, np.ones(300_000))
    with pytest.raises(pickle.PicklingError, match="Could not pickle the task") as info:
        bad.result()
    assert "lock" in str(info.value.__cause__).lower()
    assert before.result() == after.result() == 300_000.0


def test_unpicklable_result_fails_only_its_future(executor):
    bad = executor.submit(_returns_generator, np.ones(300_000))
    with pytest.raises(TypeError, match="generator"):
        bad.result()
    assert executor.submit(workers.total, np.ones(300_000)).result() == 300_000.0


def _returns_generator(a):
    return a * 2, (x for x in range(3))


class _OnlyInWorkers:
    """Rebuilds anywhere but in the process ``parent``: its result cannot come back."""

    def __init__(self, parent: int, payload: np.ndarray) -> None:
        self.parent = parent
        self.payload = payload

    def __reduce__(self):
        return _rebuild_only_in_workers, (self.parent, self.payload)


def _rebuild_only_in_workers(parent, payload):
    if os.getpid() == parent:
        raise RuntimeError("cannot be rebuilt in the parent")
    return _OnlyInWorkers(parent, payload)


def test_result_that_fails_to_rebuild_fails_only_its_future(executor):
    bad = executor.submit(_OnlyInWorkers, os.getpid(), np.ones(300_000))
    with pytest.raises(sharexec.ResultError, match="could not be rebuilt") as info:
        bad.result()
    assert isinstance(info.value.__cause__, RuntimeError)
    # the pool is not broken, and the large payload's segment was not leaked (teardown)
    assert executor.submit(workers.total, np.ones(300_000)).result() == 300_000.0


def test_task_exception_with_unpicklable_exception(executor):
    bad = executor.submit(_raise_unpicklable)
    with pytest.raises(Exception, match=r"cannot pickle|unpicklable|lock"):
        bad.result()
    assert executor.submit(workers.identity, 5).result() == 5


class _UnpicklableError(Exception):
    def __init__(self):
        super().__init__("unpicklable")
        self.lock = threading.Lock()


def _raise_unpicklable():
    raise _UnpicklableError()


class _FailsInWorkers(np.ndarray):
    """An array subclass that pickles in the parent (``parent``) and fails to rebuild in
    any other process."""

    parent = 0

    def __array_finalize__(self, obj):
        if os.getpid() != _FailsInWorkers.parent:
            raise ValueError("this array cannot be rebuilt in a worker")


def test_argument_that_fails_to_rebuild_fails_only_its_future(executor):
    _FailsInWorkers.parent = os.getpid()  # before the first submit: forked workers too
    before = executor.submit(workers.total, np.ones(300_000))
    bad = executor.submit(
        workers.identity, (np.ones(300_000), np.ones(300_000).view(_FailsInWorkers))
    )
    after = executor.submit(workers.total, np.ones(300_000))
    with pytest.raises(ValueError, match="cannot be rebuilt in a worker") as info:
        bad.result()
    assert "__array_finalize__" in str(info.value.__cause__)  # the worker's traceback
    # the pool is not broken, and the copy of the large argument was not leaked (teardown)
    assert before.result() == after.result() == 300_000.0
    assert executor.submit(workers.total, np.ones(300_000)).result() == 300_000.0
