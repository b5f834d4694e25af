"""The future of sharexec's executor, and the remote traceback of a task's exception.

Replaces loky 3.7's ``Future`` (itself ``concurrent.futures.Future``) with
:class:`LokyFuture`, whose lock (``Future._condition``, which ``wait`` and
``as_completed`` take) is made when first asked for; until then the futures of one
executor share one, so that a tiny call costs fewer objects. :func:`remote_traceback`
gives the ``__cause__`` of a task's exception of the standard library's type
(``concurrent.futures.process._RemoteTraceback``), where loky gives its own class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import _base as futures_base
from concurrent.futures import process as futures_process
from typing import Protocol

import loky

_FINISHED = futures_base.FINISHED  # the state of a future with its outcome
# The states of a future that is done (cancelled, or with its outcome).
_CANCELLED = frozenset({futures_base.CANCELLED, futures_base.CANCELLED_AND_NOTIFIED})
_DONE = _CANCELLED | {_FINISHED}


class PoolFuture(Protocol):
    """What the pool needs of the future of a call, to which it gives the call's outcome:
    a :class:`LokyFuture`, or a slot of ``map`` (``_executor._Slot``)."""

    def set_running_or_notify_cancel(self) -> bool: ...

    def set_pending_again(self) -> None: ...

    def set_result(self, result: object) -> None: ...

    def set_exception(self, exception: BaseException | None) -> None: ...

    def cancel(self) -> bool: ...

    def done(self) -> bool: ...

    def add_done_callback(self, fn: Callable[[object], object]) -> None: ...


class _Waiter(Protocol):
    """What ``concurrent.futures.wait`` puts in a future's waiters (and ``result()``:
    :class:`_Awaited`), told when the future is done."""

    def add_result(self, future: LokyFuture) -> None: ...

    def add_exception(self, future: LokyFuture) -> None: ...

    def add_cancelled(self, future: LokyFuture) -> None: ...


class _Awaited:
    """What ``result()`` and ``exception()`` of a pending future wait on, in its list of
    waiters (as ``concurrent.futures.wait`` puts its own): a lock held until the future
    is done, or cancelled."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held = threading.Lock()
        self._held.acquire()

    def wait(self, timeout: float | None) -> None:
        if timeout is None:
            self._held.acquire()
        else:
            self._held.acquire(True, max(timeout, 0))

    def wake(self, future: object = None) -> None:
        """Let the waiting thread go (called with the future's state locked)."""
        if self._held.locked():
            self._held.release()

    add_result = add_exception = add_cancelled = wake  # a waiter's methods


class LokyFuture(loky.Future):  # type: ignore[misc]
    """loky's future (the standard library's, whose callbacks log what they raise), made
    for many calls at once.

    A future is made per call, and ten thousand tiny calls keep ten thousand pending, so
    each costs the garbage collector as few objects as may be:

    * The lock that guards its state is made when first asked for: until then, it is one
      lock shared by the futures of one executor (``lock``). ``future._condition``, the
      lock that ``concurrent.futures.wait`` and ``as_completed`` take in their order (by
      future id) over the futures they wait for, makes the future's own: a lock shared
      by several futures would make that order no order at all, and two threads waiting
      on futures of two executors deadlock. The swap is made under the shared lock, and
      what changes the state takes the shared lock first, then (released) the future's
      own if there is one (``_take_lock``).
    * Its lists of waiters (``wait`` and ``as_completed`` put theirs there) and of done
      callbacks are made when first asked for. ``result()`` and ``exception()`` that have
      to wait put a waiter of their own there too (:class:`_Awaited`, a held lock): a
      thread waiting on one future is woken by that one only.

    ``result()`` of a future done with a result, ``cancel()`` of a done one, and
    ``done()``, ``running()`` and ``cancelled()`` answer without taking the lock (ten
    thousand tiny calls take ten thousand results): they read one attribute, and a
    finished future's result is set before its state.
    """

    def __init__(self, lock: threading.RLock | None = None) -> None:
        # As concurrent.futures.Future.__init__, with a lock shared until asked for.
        self._shared_lock = threading.RLock() if lock is None else lock
        self._own_lock: threading.RLock | None = None
        self._state = futures_base.PENDING
        self._result: object = None
        self._exception: BaseException | None = None
        self._waiters_made: list[_Waiter] | None = None
        self._callbacks_made: list[Callable[[LokyFuture], object]] | None = None

    @property
    def _condition(self) -> threading.RLock:
        """The future's own lock (``concurrent.futures.Future._condition``, which the
        standard library's ``wait`` and ``as_completed`` take), made when first asked for."""
        own = self._own_lock
        if own is None:
            with self._shared_lock:
                own = self._own_lock
                if own is None:
                    own = self._own_lock = threading.RLock()
        return own

    def _take_lock(self) -> threading.RLock:
        """Take the lock that guards the future's state now, and return it (to release):
        the shared one while the future has no lock of its own. Never held while another
        future's lock is taken, but in the standard library's order."""
        shared = self._shared_lock
        shared.acquire()
        own = self._own_lock
        if own is None:
            return shared
        shared.release()  # the own lock is the future's for good
        own.acquire()
        return own

    @property
    def _waiters(self) -> list[_Waiter]:
        if self._waiters_made is None:
            self._waiters_made = []
        return self._waiters_made

    @property
    def _done_callbacks(self) -> list[Callable[[LokyFuture], object]]:
        if self._callbacks_made is None:
            self._callbacks_made = []
        return self._callbacks_made

    def _await_done(self, timeout: float | None) -> None:
        """Wait until this future is done (cancelled, or with its outcome), or ``timeout``."""
        if self._state in _DONE:
            return
        lock = self._take_lock()
        try:
            if self._state in _DONE:
                return
            awaited = _Awaited()
            self._waiters.append(awaited)
        finally:
            lock.release()
        try:
            awaited.wait(timeout)
        finally:
            lock = self._take_lock()
            try:
                self._waiters.remove(awaited)
            finally:
                lock.release()

    def result(self, timeout: float | None = None) -> object:
        if self._state == _FINISHED and self._exception is None:
            return self._result
        self._await_done(timeout)
        state = self._state  # done for good, or not done in time
        if state == _FINISHED:
            if self._exception is not None:
                try:
                    raise self._exception
                finally:
                    self = None  # type: ignore[assignment]  # no cycle through the traceback
            return self._result
        if state in _DONE:
            raise futures_base.CancelledError()
        raise futures_base.TimeoutError()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._await_done(timeout)
        state = self._state
        if state == _FINISHED:
            return self._exception
        if state in _DONE:
            raise futures_base.CancelledError()
        raise futures_base.TimeoutError()

    def done(self) -> bool:
        return self._state in _DONE

    def running(self) -> bool:
        return bool(self._state == futures_base.RUNNING)

    def cancelled(self) -> bool:
        return self._state in _CANCELLED

    def add_done_callback(self, fn: Callable[[LokyFuture], object]) -> None:
        lock = self._take_lock()
        try:
            if self._state not in _DONE:
                self._done_callbacks.append(fn)
                return
        finally:
            lock.release()
        try:
            fn(self)
        except Exception:
            futures_base.LOGGER.exception("exception calling callback for %r", self)

    def cancel(self) -> bool:
        if self._state == _FINISHED:
            return False
        lock = self._take_lock()
        try:
            if self._state in (futures_base.RUNNING, _FINISHED):
                return False
            if self._state in _DONE:  # cancelled already
                return True
            self._state = futures_base.CANCELLED
            for waiter in self._waiters_made or ():
                if type(waiter) is _Awaited:  # wait() sees it once the executor does
                    waiter.wake()
        finally:
            lock.release()
        self._invoke_callbacks()
        return True

    def set_pending_again(self) -> None:
        """Its call was handed back unstarted (a batch's, see ``_Manager``): pending
        again, so it may be cancelled until it is handed out again."""
        lock = self._take_lock()
        try:
            if self._state == futures_base.RUNNING:
                self._state = futures_base.PENDING
        finally:
            lock.release()

    def set_running_or_notify_cancel(self) -> bool:
        lock = self._take_lock()
        try:
            if self._state == futures_base.CANCELLED:
                self._state = futures_base.CANCELLED_AND_NOTIFIED
                for waiter in self._waiters_made or ():
                    waiter.add_cancelled(self)
                return False
            if self._state == futures_base.PENDING:
                self._state = futures_base.RUNNING
                return True
            state = self._state
        finally:
            lock.release()
        raise RuntimeError(f"Future in unexpected state: {state}")

    def set_result(self, result: object) -> None:
        self._finish(result, None, "add_result")

    def set_exception(self, exception: BaseException | None) -> None:
        self._finish(None, exception, "add_exception")

    def _finish(self, result: object, exception: BaseException | None, tell: str) -> None:
        """Done with its outcome: the waiters told (``tell``, their method), then the
        callbacks called."""
        lock = self._take_lock()
        try:
            if self._state in _DONE:
                raise futures_base.InvalidStateError(f"{self._state}: {self!r}")
            self._result, self._exception = result, exception
            self._state = _FINISHED
            for waiter in self._waiters_made or ():
                getattr(waiter, tell)(self)
        finally:
            lock.release()
        self._invoke_callbacks()

    def _invoke_callbacks(self) -> None:
        if self._callbacks_made:  # loky's: each callback's exception logged
            super()._invoke_callbacks()


def remote_traceback(text: str) -> BaseException:
    """The ``__cause__`` of a task's exception: its traceback in the worker, ``text``,
    shown when the exception is printed; of the standard library's type, as its
    executor gives it (CPython's ``test_traceback`` checks the type)."""
    # (typeshed types its argument as a traceback object; CPython stores and prints text)
    cause: BaseException = futures_process._RemoteTraceback(text)  # type: ignore[arg-type]
    return cause
