"""What the two executors show alike, so that :func:`sharexec.get_executor` may return
either: the :class:`Statistics` record and ``Executor.map`` as the standard library's of
Python 3.14 has it (its argument checks, items in chunks, results taken ``buffersize``
calls ahead), which older Pythons lack.

:mod:`sharexec._executor` and :mod:`sharexec._cluster` build on it; it imports nothing of
sharexec.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Protocol, TypeVar

__all__ = ["Pending", "Statistics", "map_calls", "submit_future"]

E = TypeVar("E", bound=Executor)
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
X = TypeVar("X")

# The items of one call of ``map``, one of each iterable, e.g. (3, "a").
Items = tuple[object, ...]


class Pending(Protocol[T_co]):
    """What submitting one of ``map``'s calls gives: its future (or ``_executor._Slot``)."""

    def result(self, timeout: float | None = None) -> T_co: ...

    def cancel(self) -> bool: ...


@dataclass(frozen=True)
class Statistics:
    """A snapshot of what an executor moved through shared memory, and what is held now.

    The byte counts are of the data itself (no pickle framing) and run from the
    executor's creation; the segment counts are of this moment. A worked example whose
    numbers the test suite checks is in the documentation (*How it works*, "Reading
    statistics()").

    Attributes
    ----------
    segments_live : int
        Segments of this process that hold live data now: shared arrays (from
        :func:`sharexec.zeros` and friends, of any executor or none), copies of the
        arguments of tasks in flight, segments lent to tasks in flight for their results,
        and results not yet garbage-collected. Warm segments kept in pools for reuse are
        not counted here (see `segments_pooled`). Counted for the whole process: a
        shared array belongs to no executor.
    bytes_in_shared_memory : int
        The total size of the `segments_live` (including, after a fallback, file-backed
        segments on disk).
    segments_pooled : int
        Warm segments this executor keeps for its next copies and results: no data of
        yours lives in them, and they are freed after 10 s unused, at shutdown, or as
        soon as the executor is garbage-collected without one.
    bytes_pooled : int
        Their total size: at most a quarter of the shared-memory folder, and 1 GiB.
    bytes_copied : int
        Bytes of arguments copied into shared memory, one memcpy each: a large private
        array (or its part a task can see) once per copy made, a gappy view
        (``img[:1024, :1024]``) once, compactly; and a function sent by value with large
        globals (its pickle, the arrays among them), once per executor.
    bytes_reused : int
        Bytes of arguments sent from a copy that already held them, instead of copying
        them again: the same unchanged array submitted again while its copy lived, or
        a second view of one base in the same call (``f(a, a.T)``). Copies avoided; never
        overlaps `bytes_copied` for the same send.
    bytes_by_reference : int
        Bytes of shared arrays and views passed to tasks by reference (nothing copied),
        summed over calls: what each task can reach through the views it was given
        (``out[:1000]``: 1000 elements; at most the segment's size). An array passed to
        ten tasks counts ten times: this is the pickling avoided, not memory in use.
    fallbacks : int
        Times shared memory fell short for an argument: a file on disk, or pickling, was
        used instead.
    tasks_submitted, tasks_done : int
        Calls submitted, and calls whose future is done (result, exception or
        cancelled).
    tasks_batched : int
        Calls that went to a worker together with others, in one message (see *How it
        works*, "Many small calls"): queued calls of functions measured short. Zero
        with ``batching=False``.
    batches : int
        The messages those calls went in: ``tasks_batched / batches`` calls each, on
        average.
    """

    segments_live: int
    bytes_in_shared_memory: int
    segments_pooled: int
    bytes_pooled: int
    bytes_copied: int
    bytes_reused: int
    bytes_by_reference: int
    fallbacks: int
    tasks_submitted: int
    tasks_done: int
    tasks_batched: int
    batches: int


def map_calls(
    executor: E,
    iterables: tuple[Iterable[object], ...],
    timeout: float | None,
    chunksize: int,
    buffersize: int | None,
    submit_one: Callable[[E, Items], Pending[T]],
    run_chunk: Callable[[list[Items]], list[T]],
) -> Iterator[T]:
    """``executor.map``: one call per item through ``submit_one(executor, items)``, or,
    with a ``chunksize`` above 1, one call of ``run_chunk(chunk)`` per chunk of them,
    submitted as :meth:`~concurrent.futures.Executor.submit` does."""
    check_map(chunksize, buffersize)
    calls = zip(*iterables, strict=False)  # to the shortest, as map()
    if chunksize == 1:
        return results(executor, submit_one, calls, timeout, buffersize)
    chunks = ((chunk,) for chunk in batched(calls, chunksize))
    submit_chunk = partial(submit_future, run_chunk)
    return flatten(results(executor, submit_chunk, chunks, timeout, buffersize))


def check_map(chunksize: int, buffersize: int | None) -> None:
    """Refuse ``map``'s arguments as the standard library's of Python 3.14 does, before
    any item is taken."""
    if buffersize is not None:
        if not isinstance(buffersize, int):
            raise TypeError("buffersize must be an integer or None")
        if buffersize < 1:
            raise ValueError("buffersize must be None or > 0")
    if chunksize < 1:
        raise ValueError("chunksize must be >= 1.")


def batched(items: Iterator[X], n: int) -> Iterator[list[X]]:
    """``items`` in lists of ``n`` (the last may be shorter), as they are taken."""
    while chunk := list(islice(items, n)):
        yield chunk


def submit_future(fn: Callable[..., T], executor: E, args: Items) -> Future[T]:
    return executor.submit(fn, *args)


def results(
    executor: E,
    submit: Callable[[E, Items], Pending[T]],
    calls: Iterator[Items],
    timeout: float | None,
    buffersize: int | None,
) -> Iterator[T]:
    """Submit the calls (all now, or ``buffersize`` ahead) and iterate their results.

    The standard library's ``Executor.map`` of Python 3.14, which older Pythons lack
    (for this module's executor and the cluster's). ``submit(executor, args)`` queues
    one call and returns its future (or ``_Slot``).
    """
    end = None if timeout is None else timeout + time.monotonic()
    futures = deque(submit(executor, args) for args in islice(calls, buffersize))
    # Weakly: an executor is collected (and shut down) as usual while this iterator lives.
    owner = weakref.ref(executor)

    def iterate() -> Iterator[T]:
        try:
            while futures:
                if buffersize is not None:
                    alive = owner()
                    args = next(calls, None) if alive is not None else None
                    if args is not None and alive is not None:
                        futures.append(submit(alive, args))
                    del alive
                # Not a name for the future: a reference kept here would keep its
                # result (and a traceback cycle) alive while the caller holds the value.
                if end is None:
                    yield _result_or_cancel(futures.popleft())
                else:
                    yield _result_or_cancel(futures.popleft(), end - time.monotonic())
        finally:
            for future in futures:
                future.cancel()

    return iterate()


def _result_or_cancel(future: Pending[T], timeout: float | None = None) -> T:
    try:
        try:
            return future.result(timeout)
        finally:
            future.cancel()
    finally:
        del future  # breaks the cycle of an exception's traceback with this frame


def flatten(chunks: Iterator[list[T]]) -> Iterator[T]:
    """The items of each chunk's list of results, holding none once yielded."""
    for chunk in chunks:
        chunk.reverse()
        while chunk:
            yield chunk.pop()
