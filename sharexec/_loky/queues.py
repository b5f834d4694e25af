"""The call and result queues, and what a worker sends on them.

Replaces loky 3.7's ``_SafeQueue`` (the call queue) and ``SimpleQueue`` (the result
queue) with subclasses, made in loky's ``_setup_queues`` hook. loky pickles every item
with a fresh cloudpickle pickler (about 15 µs of set-up, more than the rest of a tiny
task's trip); the calls and replies sharexec puts there are reduced to bytes and segment
names already, so the call queue's feeder thread (multiprocessing's, rebuilt on the
queue's inner parts: :func:`_feed`) and the result queue's ``put`` pickle those
envelopes with the standard pickler, and anything else (a task's exception, loky's own
messages) as loky does. Worker recycling (``max_tasks_per_child``, which loky's
constructor lacks) rides on loky's clean-exit protocol, quietly. In a worker:
:func:`send_outcome` sends part of a batch's outcome early, and :func:`note_run_seconds`
the run time of the call about to be sent back.
"""

from __future__ import annotations

import errno
import multiprocessing
import pickle
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from multiprocessing import queues as mp_queues
from multiprocessing import util as mp_util
from multiprocessing.synchronize import BoundedSemaphore
from typing import Any

from loky import process_executor
from loky.backend import queues as loky_queues
from loky.backend import reduction as loky_reduction

from .batching import _NO_KEYWORDS, AlreadyDone, BatchOutcome, CallBatch
from .reducers import Reducers

# In a worker: how long the last call it ran took, sent with its result (_ResultQueue).
_run_seconds: float | None = None


def send_outcome(outcome: BatchOutcome) -> None:
    """In a worker: send part of a batch's outcome now, before the batch ends (the rest
    comes back as the batch's result). Through this worker's result queue, loky's
    argument of its worker loop (``_process_worker(call_queue, result_queue, ...)``),
    which every start method hands the worker process in its ``_args``."""
    result_queue = multiprocessing.current_process()._args[1]  # type: ignore[attr-defined]
    first = outcome[0][0] if outcome else outcome.returned[0]
    result_queue.put(process_executor._ResultItem(first, result=outcome))


def note_run_seconds(seconds: float) -> None:
    """In a worker: the call about to be sent back ran for ``seconds``."""
    global _run_seconds
    _run_seconds = seconds


# In a worker: set once it has taken its last task (max_tasks_per_child).
_recycling = False


class _CallQueue(process_executor._SafeQueue):  # type: ignore[misc]
    """loky's call queue, fed by a thread of ours, which may stop a worker after a while.

    With ``max_tasks``, a worker whose ``get`` returns None leaves by loky's clean path:
    it sends its pid on the result queue, and the executor replaces it if work is
    pending (or at the next submit). ``get`` only runs once the previous result is
    sent, so no task is lost.
    """

    max_tasks: int | None = None
    _taken = 0  # tasks this worker has taken (each worker unpickles its own copy)

    def __getstate__(self) -> tuple[object, ...]:
        return (*super().__getstate__(), self.max_tasks)

    def __setstate__(self, state: tuple[Any, ...]) -> None:  # loky's state, then ours
        super().__setstate__(state[:-1])
        self.max_tasks = state[-1]

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        global _recycling
        if self.max_tasks is not None and self._taken >= self.max_tasks:
            _recycling = True
            return None
        item = super().get(block, timeout)
        if item is not None:
            self._taken += 1
        return item

    def _start_thread(self) -> None:
        # The feeder starts at the first put, in the process that made the queue (the
        # executor's): workers only read this queue. Its arguments are the queue's
        # parts, as loky's are, not the queue itself, so the queue can be collected.
        self._buffer.clear()
        self._thread = threading.Thread(
            target=_feed,
            args=(
                self._buffer,
                self._notempty,
                self._send_bytes,
                self._wlock,
                self._writer.close,
                self._reducers,
                self._ignore_epipe,
                self._on_queue_feeder_error,
                self._sem,
            ),
            name="QueueFeederThread",
            daemon=True,
        )
        self._thread.start()
        # Wakes the feeder with the sentinel (and so closes the pipe) once the queue
        # is collected or the process exits, as multiprocessing's queues do.
        self._close = mp_util.Finalize(
            self,
            mp_queues.Queue._finalize_close,  # type: ignore[attr-defined]
            [self._buffer, self._notempty],
            exitpriority=10,
        )


def _feed(
    buffer: deque[Any],  # loky's call items (untyped), None, or the sentinel
    notempty: threading.Condition,
    send_bytes: Callable[[bytes], None],
    writelock: AbstractContextManager[object],
    close: Callable[[], None],
    reducers: Reducers | None,
    ignore_epipe: bool,
    onerror: Callable[[BaseException, object], None],
    queue_sem: BoundedSemaphore,
) -> None:
    """The feeder thread: pickle each item put on the call queue, and send it."""
    sentinel: object = mp_queues._sentinel  # type: ignore[attr-defined]
    call_item = process_executor._CallItem
    while True:
        with notempty:
            while not buffer:
                notempty.wait()
            item = buffer.popleft()
        if item is sentinel:
            close()
            return
        try:
            # Pickled outside the lock: a task copies its large arguments here.
            if type(item) is call_item or item is None:
                data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
            else:  # pragma: no cover - the executor only puts call items and None
                data = loky_reduction.dumps(item, reducers=reducers)
            with writelock:
                send_bytes(data)
        except BaseException as exc:
            if ignore_epipe and getattr(exc, "errno", 0) == errno.EPIPE:
                return  # a worker was killed: the executor notices by itself
            if mp_util.is_exiting():
                return  # the interpreter is tearing down what sending would need
            if type(item) is call_item and item.args and type(item.args[0]) is CallBatch:
                rest = _without_failures(item, onerror)
                if rest is not None:  # the batch less the calls that failed alone
                    buffer.appendleft(rest)  # in its place in the queue, and its slot
                    del item, rest
                    continue
                queue_sem.release()  # nothing of it went: its slot is free again
            else:
                queue_sem.release()  # the item never went: its slot is free again
                if not isinstance(exc, AlreadyDone):
                    onerror(exc, item)  # fails that item's future (loky's _SafeQueue)
        del item


def _without_failures(
    item: process_executor._CallItem, onerror: Callable[[BaseException, object], None]
) -> process_executor._CallItem | None:
    """A batch that failed to pickle: each of its calls is pickled alone, and one that
    fails gets its own error (``onerror``); the others are returned as a call item again,
    to be sent in the batch's place (the same place in the call queue: the same slot of
    its semaphore). A call already done (:class:`AlreadyDone`) is dropped. None if no
    call is left (so is each call of a batch already made of calls that each pickled
    alone: it failed anyway)."""
    batch = item.args[0]
    ids, calls = [], []
    for work_id, (fn, args) in zip(batch.ids, batch.calls, strict=True):
        single = process_executor._CallItem(work_id, fn, args, _NO_KEYWORDS)
        try:
            pickle.dumps(single, protocol=pickle.HIGHEST_PROTOCOL)
            if batch.checked:
                raise RuntimeError("a batch whose calls pickled one by one failed to pickle")
        except AlreadyDone:
            continue  # its outcome is in: nothing to send, nothing to fail
        except BaseException as exc:
            onerror(exc, single)
        else:
            ids.append(work_id)
            calls.append((fn, args))
    if not ids:
        return None
    rest = CallBatch(ids, calls, batch.policy)
    rest.checked = True
    return process_executor._CallItem(ids[0], item.fn, (rest,), _NO_KEYWORDS)


class _ResultQueue(loky_queues.SimpleQueue):  # type: ignore[misc]
    """loky's result queue: a worker's results in a plain envelope, its exit marked.

    A result (a batch's outcome too, and a task's exception, sent as a result: see
    ``_worker.run``) is made to pickle by plain pickle; only what loky sends itself (an
    exception raised outside any call) takes loky's pickler. A worker leaving because of
    ``max_tasks_per_child`` sends its pid marked as loky's recycled worker: the executor
    replaces it without a warning.
    """

    def put(self, obj: Any) -> None:  # loky's result items (untyped), or a pid
        if type(obj) is process_executor._ResultItem:
            if _run_seconds is not None:  # how long the call ran (not a batch: per call)
                obj.seconds = _run_seconds
            if obj.exception is None:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                with self._wlock:
                    self._writer.send_bytes(data)
                return
        if _recycling and type(obj) is int:
            obj = process_executor._RecycledWorkerPid(obj)
        super().put(obj)
