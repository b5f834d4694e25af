"""The bookkeeping of a cluster executor's calls, from submit until their futures are done.

This module owns :class:`_Call` (one call: its arguments until dispatched, then its
payload, blobs and Dask future), :class:`_ClusterFuture` (the standard library's future,
which can also end cancelled while running), and :class:`Calls`: the executor's one lock,
the queue of calls not dispatched yet, the calls running (dispatched, not done), how
many of them Dask holds, the counts ``statistics()`` reports, and the executor's states
(shut down, broken). The dispatcher, results and closing threads all go through it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, Future, InvalidStateError
from typing import TypeVar

import numpy as np

from .blobs import _HostBytes
from .dask_api import DaskFuture

T = TypeVar("T")

# How often a thread waiting for calls looks again (seconds): the client may close under
# calls in flight without Dask ever calling back.
WATCH = 0.5


class _ClusterFuture(Future[T]):
    """A call's future: the standard library's, which can also end cancelled while
    running (see :meth:`cancel_running`)."""

    def cancel_running(self) -> None:
        """End the running call cancelled: its task was cancelled on the cluster, by
        someone other than this executor, as Dask's own executor's futures end then.

        The standard library's futures have no way to cancel a running call: this
        makes the transitions its ``set_running_or_notify_cancel`` makes for a call
        cancelled before it ran (waiters of ``wait`` and ``as_completed`` told, done
        callbacks called). A call not running is left as it is.
        """
        with self._condition:
            if self._state != "RUNNING":
                return
            self._state = "CANCELLED_AND_NOTIFIED"
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        invoke: Callable[[], None] = getattr(self, "_invoke_callbacks")  # noqa: B009
        invoke()


def fail(future: Future[object], error: BaseException) -> None:
    """Fail ``future`` with ``error`` unless it is done already (cancelled meanwhile, or
    ended by the executor breaking)."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


# A call as submitted: (fn, args, kwargs).
Submitted = tuple[Callable[..., object], tuple[object, ...], dict[str, object]]


class _Call:
    """A call from submit until its future is done.

    Until it is dispatched it holds its function and arguments (``call``); then its
    payload, the blobs it uses and the caller's shared views it was given; once given to
    Dask, its Dask future (``remote``).
    """

    __slots__ = ("blobs", "call", "fn_name", "future", "payload", "remote", "since", "slots")

    def __init__(self, future: _ClusterFuture[object], call: Submitted, since: int) -> None:
        self.future = future
        self.call: Submitted | None = call
        self.since = since  # the executor's clock at submit, e.g. 16
        name = getattr(call[0], "__name__", None)
        # e.g. "total": in the task's key, for Dask's dashboard
        self.fn_name = name if isinstance(name, str) and name.isidentifier() else "call"
        self.payload = b""  # e.g. b"\x80\x05…": fn, args and kwargs, blobs left out
        # The blobs it uses, in the payload's order: the digest of one sent to the
        # cluster, or one that travels in the task (zeros).
        self.blobs: list[bytes | _HostBytes] = []
        self.slots: list[np.ndarray] = []  # the caller's shared views it was given
        self.remote: DaskFuture | None = None  # e.g. <Future: pending, key: total-…-7>

    def argument_ids(self) -> frozenset[int]:
        """The ids of the arrays given as arguments themselves (not inside a container)."""
        assert self.call is not None
        _, args, kwargs = self.call
        return frozenset(id(a) for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray))


class Calls:
    """The calls of one executor: queued, running (and of those, in Dask), and counted.

    ``lock`` guards all of it (and the executor's ``Sender``); ``changed`` is notified
    when a call is queued, given to Dask or done, and at shutdown. ``on_idle`` is called
    (outside the lock) when the last call is done after ``shutdown(wait=False)``.
    """

    def __init__(self, on_idle: Callable[[], object]) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self._on_idle = on_idle
        self.queue: deque[_Call] = deque()  # calls not yet dispatched
        self.running: dict[_ClusterFuture[object], _Call] = {}  # dispatched, not done
        self.in_dask = 0  # of those, given to Dask and not yet finished there
        self.submitted = 0  # calls submitted
        self._undone: set[Future[object]] = set()  # of those, the futures not seen done
        # Why the executor is broken (see end_all), e.g. "the Dask client … is closed…".
        self.broken: str | None = None
        self.shut_down = False
        self.close_when_idle = False

    def add(self, call: _Call) -> None:
        """Queue a submitted call (under the lock)."""
        self.queue.append(call)
        self.submitted += 1
        self._undone.add(call.future)
        self.changed.notify_all()

    def seen_done(self, future: Future[object]) -> None:
        """A future's done callback: it is done (``tasks_done``)."""
        with self.lock:
            self._undone.discard(future)

    def done_count(self) -> int:
        """Calls whose future is done, the moment its state says so (before its callbacks
        are called). Under the lock."""
        return self.submitted - sum(not f.done() for f in self._undone)

    @property
    def idle(self) -> bool:
        """No call queued nor running (under the lock)."""
        return not self.running and not self.queue

    def next_call(
        self, capacity: Callable[[], int], gone: Callable[[], str | None]
    ) -> tuple[_Call | None, str | None]:
        """The next call to give Dask, marked running, once Dask holds fewer than
        ``capacity()``; or None when the dispatcher is to end, with why the executor is
        broken if it is now (``gone()``: why the client cannot go on, if it cannot)."""
        with self.lock:
            while True:
                if self.broken is not None:
                    return None, None
                if (self.queue or self.running) and (why := gone()) is not None:
                    return None, why
                if self.queue and self.in_dask < capacity():
                    call = self.queue.popleft()
                    if not call.future.set_running_or_notify_cancel():  # cancelled
                        continue
                    self.running[call.future] = call
                    self.in_dask += 1
                    return call, None
                if self.shut_down and self.idle:
                    return None, None
                self.changed.wait(WATCH if self.queue or self.running else None)

    def out_of_dask(self) -> None:
        """A call given to Dask finished there: the next may go."""
        with self.lock:
            self.in_dask -= 1
            self.changed.notify_all()

    def finished(self, call: _Call, let_go: Callable[[list[bytes | _HostBytes]], None]) -> None:
        """A running call is done (if it reached Dask, counted out of it already:
        :meth:`out_of_dask`); ``let_go`` lets go of its blobs, under the lock."""
        with self.lock:
            if call.remote is None:  # it never reached Dask
                self.in_dask -= 1
            self.running.pop(call.future, None)
            let_go(call.blobs)
            call.blobs = []
            self.changed.notify_all()
            idle = self.close_when_idle and self.idle
        if idle:  # shutdown(wait=False) was called
            self._on_idle()

    def end_all(self, why: str) -> None:
        """The executor is broken: every call not done fails with
        :class:`~concurrent.futures.BrokenExecutor` (as the standard library's when its
        pool breaks), and none may be submitted. Their tasks, if any, are lost with the
        client or the cluster: no call waits for Dask to call back any more."""
        with self.lock:
            if self.broken is None:
                self.broken = why
            why = self.broken
            ended = [call.future for call in self.queue]
            ended += self.running
            self.queue.clear()
            self.running.clear()
            self.changed.notify_all()
            idle = self.close_when_idle
        for future in ended:
            fail(future, BrokenExecutor(why))
        if idle:  # shutdown(wait=False) was called
            self._on_idle()

    def cancel_queued(self) -> list[_ClusterFuture[object]]:
        """Take every call not dispatched off the queue: their futures, to cancel (under
        the lock)."""
        queued = [call.future for call in self.queue]
        self.queue.clear()
        return queued
