"""The queues between the executor and its workers: loky's, with a cheaper envelope.

Loky pickles every item it puts on a queue with a new cloudpickle pickler, whose set-up
(a copied dispatch table) costs about 15 µs: more than the rest of a tiny task's trip on
either side. What sharexec puts there needs none of it: a call item carries a
:class:`~sharexec._reduction.Task`, which our own pass has already reduced to bytes and
segment names, and a result item carries a ``Reply`` made the same way. So the call
queue's feeder thread and the result queue's ``put`` pickle those envelopes with the
standard pickler, and anything else (a task's exception, loky's messages) as loky does.

They also carry worker recycling (``max_tasks_per_child``) on loky's own clean-exit
protocol. This module imports no numpy: every worker unpickles both queues at start-up.
"""

from __future__ import annotations

import errno
import pickle
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing import util
from multiprocessing.queues import Queue as _MpQueue
from multiprocessing.queues import _sentinel  # type: ignore[attr-defined]
from typing import Any

from loky.backend.queues import SimpleQueue as _LokySimpleQueue
from loky.backend.reduction import dumps as _loky_dumps
from loky.process_executor import _CallItem, _RecycledWorkerPid, _ResultItem, _SafeQueue

__all__ = ["CallQueue", "ResultQueue"]

# In a worker: set once it has taken its last task (max_tasks_per_child).
_recycling = False


class CallQueue(_SafeQueue):  # type: ignore[misc]
    """loky's call queue, fed by a thread of ours, which may stop a worker after a while.

    With ``max_tasks``, a worker whose ``get`` returns None leaves by loky's clean path:
    it sends its pid on the result queue, and the executor replaces it if work is
    pending (or at the next submit). ``get`` only runs once the previous result is
    sent, so no task is lost.
    """

    max_tasks: int | None = None
    _taken = 0  # tasks this worker has taken (each worker unpickles its own copy)

    def __getstate__(self) -> tuple[Any, ...]:
        return (*super().__getstate__(), self.max_tasks)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        super().__setstate__(state[:-1])
        self.max_tasks = state[-1]

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
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
        self._close = util.Finalize(
            self,
            _MpQueue._finalize_close,  # type: ignore[attr-defined]
            [self._buffer, self._notempty],
            exitpriority=10,
        )


def _feed(
    buffer: deque[Any],
    notempty: threading.Condition,
    send_bytes: Callable[[bytes], None],
    writelock: Any,
    close: Callable[[], None],
    reducers: Any,
    ignore_epipe: bool,
    onerror: Callable[[BaseException, Any], None],
    queue_sem: Any,
) -> None:
    """The feeder thread: pickle each item put on the call queue, and send it."""
    while True:
        with notempty:
            while not buffer:
                notempty.wait()
            item = buffer.popleft()
        if item is _sentinel:
            close()
            return
        try:
            # Pickled outside the lock: a Task copies its large arguments here.
            if type(item) is _CallItem or item is None:
                data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
            else:  # pragma: no cover - the executor only puts call items and None
                data = _loky_dumps(item, reducers=reducers)
            with writelock:
                send_bytes(data)
        except BaseException as exc:
            if ignore_epipe and getattr(exc, "errno", 0) == errno.EPIPE:
                return  # a worker was killed: the executor notices by itself
            if util.is_exiting():
                return  # the interpreter is tearing down what sending would need
            queue_sem.release()  # the item never went: its slot is free again
            onerror(exc, item)  # fails that item's future (loky's _SafeQueue)
        del item


class ResultQueue(_LokySimpleQueue):  # type: ignore[misc]
    """loky's result queue: a worker's results in a plain envelope, its exit marked.

    A worker leaving because of ``max_tasks_per_child`` sends its pid marked as loky's
    recycled worker: the executor replaces it without a warning.
    """

    def put(self, obj: Any) -> None:
        if type(obj) is _ResultItem and obj.exception is None:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            with self._wlock:
                self._writer.send_bytes(data)
            return
        if _recycling and type(obj) is int:
            obj = _RecycledWorkerPid(obj)
        super().put(obj)
