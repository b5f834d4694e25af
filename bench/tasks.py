"""What the workers run: the workloads' functions, and the hand-written shared-memory side.

Every function lives at module level so that workers started with ``spawn`` or
``forkserver`` import it by name (``bench/`` is on the workers' ``sys.path``, inherited from
the parent that runs ``bench/run.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------
# The workloads' functions (the same for every system)
# ---------------------------------------------------------------------------------------


def total(a: np.ndarray) -> float:
    """W1: the sum of the whole array."""
    return float(a.sum())


def first(a: np.ndarray) -> float:
    """W1s, dispatch only: O(1) work, so the time left is the transport's."""
    return float(a[0])


def chunk_sum(a: np.ndarray) -> float:
    """W2: the sum of one chunk."""
    return float(a.sum())


def fresh(n: int, value: float) -> np.ndarray:
    """W3 and W4 (returning systems): a fresh array of ``n`` float64 equal to ``value``."""
    return np.full(n, value, dtype=np.float64)


def fill(out: np.ndarray, value: float) -> None:
    """W4 (writing systems): write ``value`` into the slice ``out`` in place."""
    out.fill(value)


def inc(i: int) -> int:
    """W5: a tiny task."""
    return i + 1


# ---------------------------------------------------------------------------------------
# Hand-written multiprocessing.shared_memory: the worker's side
#
# A handle is (segment name, length, dtype string) of a 1-D array; a task gets the array's
# slice [lo:hi]. The parent creates and unlinks the segments of the arguments; a worker
# creates the segment of a result and the parent, having copied it out, unlinks it.
# ---------------------------------------------------------------------------------------


def _no_register(name: str, rtype: str) -> None:
    """Stands in for ``resource_tracker.register`` while a worker attaches a segment."""


def attach(name: str) -> shared_memory.SharedMemory:
    """Attach an existing segment without registering it with the resource tracker.

    Before Python 3.13, ``SharedMemory(name=...)`` registers the segment with the attaching
    process's tracker, which unlinks it when that tracker exits. The usual fix, calling
    ``resource_tracker.unregister`` after attaching, is wrong for a pool's workers: they
    share the parent's tracker, so it removes the creator's own registration (its crash
    protection), and the creator's ``unlink`` then makes the tracker print a KeyError. A
    careful user skips the registration instead (3.13 spells it ``track=False``).
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    register = resource_tracker.register
    resource_tracker.register = _no_register
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def on_segment(
    fn: Callable[..., Any], name: str, n: int, dtype: str, lo: int, hi: int, *args: Any
) -> Any:
    """Run ``fn(view, *args)`` on the slice ``[lo:hi]`` of a segment's array."""
    segment = attach(name)
    view = np.ndarray((n,), dtype, buffer=segment.buf)[lo:hi]
    try:
        return fn(view, *args)
    finally:
        del view  # the mapping cannot close while an array still exports it
        segment.close()


def via_segment(fn: Callable[..., np.ndarray], *args: Any) -> tuple[str, int, str]:
    """Run ``fn(*args)`` and hand its 1-D array result back in a new segment.

    The segment is registered with the tracker the worker shares with its parent, so it is
    swept if the parent dies before unlinking it; the parent copies the data out and
    unlinks it.
    """
    result = np.ascontiguousarray(fn(*args))
    segment = shared_memory.SharedMemory(create=True, size=max(result.nbytes, 1))
    out = np.ndarray(result.shape, result.dtype, buffer=segment.buf)
    out[...] = result
    del out
    segment.close()
    return segment.name, result.shape[0], result.dtype.str
