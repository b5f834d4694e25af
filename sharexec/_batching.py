"""When queued calls travel together: run times measured per function, and a batch's size.

A tiny call costs the pool far more than it runs: the stdlib spends about 100 µs per call
on queues, pickles, pipes and thread switches, for a function that runs 1 µs. When calls
queue up faster than the workers take them, the manager thread of the pool
(``_loky.batching._Manager``) may send several of them in one message, and their outcomes come
back in one: what a message costs is then shared by its calls. This module decides
which calls may go together; ``_loky`` moves them, ``_transport.Transport.reduce_batch``
pickles them, ``_worker.run_batch`` runs them.

The rules, for the promises that must hold (docs/how-it-works.md, "When calls travel
together"): tiny calls may travel together, never wait together.

* A call goes alone unless its function was **measured** short: every call's run time
  is measured in its worker and sent back with its result; a function never measured
  yet (its first call, a new lambda) goes alone, and so does one whose estimate is above
  :data:`SHORT_SECONDS`. The estimate follows the measures down slowly and up at once
  (one long run makes it long), so a function that turns slow goes alone from its next
  call on.
* A batch holds at most :data:`BATCH_SECONDS` of estimated run time and
  :data:`BATCH_CALLS` calls, and no more than a share of the calls waiting
  (:meth:`Batching.limit`), so that every worker gets some while a backlog drains: its
  calls' results come back together at the batch's end, which is bounded by that time.
  Should a batch run longer after all (a call turned slow, or waits for a later call
  of its batch), its worker hands back the calls not started after 5 ms
  (``_worker._Streamer``), with the outcomes ended so far, and ``_loky``'s manager
  queues them again: no call waits behind another for longer.
* Only calls waiting in the queue are batched, and each becomes running as it joins a
  batch, pending again if it is handed back: a call still queued can be cancelled, as
  with the stdlib.
* No batching with ``max_tasks_per_child`` (a worker counts tasks), nor with the
  ``batching=False`` option.

The estimates are keyed by function (module, qualified name and first line; a partial by
its function), so two lambdas of one module are told apart by their line.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from functools import partial
from typing import cast

from ._loky import CallBatch
from ._reduction import Reduced
from ._transport import FunctionKey, Task, Transport

__all__ = ["BATCH_CALLS", "BATCH_SECONDS", "SHORT_SECONDS", "Batching"]

# A batch holds at most this much estimated run time: what the first result of a batch
# may wait for the last call's end.
BATCH_SECONDS = 0.002
# A function measured above this goes alone: batching it would save little (a message
# costs ~100 µs) and hold others.
SHORT_SECONDS = 0.0002
# At most this many calls in one batch: a message of 256 tiny calls is ~15 KB.
BATCH_CALLS = 256
# What a worker spends per call of a batch besides the function (unpickling, packing):
# counted in the budget, so a batch of tiny calls stays within BATCH_SECONDS too.
PER_CALL_SECONDS = 5e-6
# Functions whose estimate is kept (the oldest forgotten first).
FUNCTIONS_KEPT = 1024
# An estimate moves this share of the way down to each shorter measure (up: at once).
DECAY = 0.25


class Batching:
    """The batching policy of one executor (``_loky.BatchPolicy``), used by its manager
    thread only: no lock.

    ``run``: the function every queued call runs in a worker (``_worker.run``), its
    argument a :class:`~sharexec._transport.Task`; ``run_batch``: what a worker runs for
    a batch (``_worker.run_batch``).
    """

    budget = BATCH_SECONDS

    def __init__(
        self,
        transport: Transport,
        workers: int,
        run: Callable[..., object],
        run_batch: Callable[..., object],
    ) -> None:
        self._transport = transport
        self._workers = workers
        self._run = run
        self.run_batch = run_batch
        # Estimated run time in seconds by function key, oldest first, e.g.
        # {("bench.tasks", "inc", 47): 3.1e-07}.
        self._seconds: dict[FunctionKey, float] = {}

    def cost(self, fn: Callable[..., object], args: tuple[object, ...]) -> float | None:
        """The estimated run time of a queued call, or None if it goes alone."""
        if fn is not self._run:
            return None
        task = args[0]
        if type(task) is not Task or task.fn is None:
            return None
        key = task.key
        if key is None:
            key = task.key = _key(task.fn)
        seconds = self._seconds.get(key)
        if seconds is None or seconds > SHORT_SECONDS:
            return None
        return seconds + PER_CALL_SECONDS

    def limit(self, queued: int) -> int:
        """Calls one batch may take when ``queued`` wait: ``queued // (2 * workers)``
        (so that each worker gets a share while they drain: with 2 workers, a quarter of
        them), and BATCH_CALLS at most."""
        return min(BATCH_CALLS, queued // (2 * self._workers))

    def measured(
        self, fn: Callable[..., object], args: tuple[object, ...], seconds: float
    ) -> None:
        """A queued call ran ``seconds`` in its worker."""
        if fn is not self._run or type(args[0]) is not Task:
            return
        task = args[0]
        key = task.key
        if key is None:
            if task.fn is None:
                return
            key = task.key = _key(task.fn)
        table = self._seconds
        old = table.get(key)
        if old is None:
            if len(table) >= FUNCTIONS_KEPT:
                del table[next(iter(table))]
            table[key] = seconds
        elif seconds >= old:
            table[key] = seconds
        else:
            table[key] = old + (seconds - old) * DECAY

    def batched(self, calls: int) -> None:
        counts = self._transport.counts
        counts.add("batches")
        counts.add("tasks_batched", calls)

    def handed_back(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        """A batched call was handed back unstarted: its next send is the same transfer
        (its copies stay valid for it, nothing counted twice)."""
        task = args[0]
        if type(task) is Task:
            task.again = True

    def reduce_batch(self, batch: CallBatch) -> Reduced:
        # cost() lets only calls of a Task into a batch
        tasks = cast("list[Task]", [args[0] for _, args in batch.calls])
        return self._transport.reduce_batch(batch.ids, tasks)


def _key(fn: Callable[..., object]) -> FunctionKey:
    """What a function's run times are kept under."""
    if type(fn) is types.FunctionType:
        return (fn.__module__, fn.__qualname__, fn.__code__.co_firstlineno)
    if type(fn) is partial:
        return ("partial", _key(fn.func), *(_key(a) for a in fn.args if callable(a)))
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return (
        getattr(fn, "__module__", None),
        name if isinstance(name, str) else type(fn).__qualname__,
        getattr(code, "co_firstlineno", None),
    )
