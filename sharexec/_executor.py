"""SharedProcessPoolExecutor: loky's process pool with a shared-memory transport.

Data flow, in the order a submitted call travels (the queues and threads are loky's,
themselves those of CPython's ``concurrent.futures.process``; what sharexec changes of
them, and every use of loky's internals, is in :mod:`sharexec._loky`)::

  submit(fn, *args, **kwargs)                                   user thread
    │  wraps the call in a _transport.Task; nothing is copied yet
    ▼
  pending work items ──▶ call queue ──(feeder thread pickles)──▶ pipe ──▶ worker
     (the manager thread moves them, queued calls of short functions several in one
      call item: _batching, _worker.run_batch)
                          │
                          └▶ Task.__reduce__: plain arguments ─▶ the standard pickler;
                             else one cloudpickle pass (_reduction, a ForwardSink)
                               shared array view  ─▶ by reference: (name, geometry)
                               large private buffer ─▶ a live copy of the same bytes, or
                                                       copied once into a warm segment of
                                                       the pool or a new one
                                                       (_tracking.new_private,
                                                        _segments.create + fallocate)
                               anything else      ─▶ pickled, in the payload
                             the Task keeps its segments alive until its future is done

  worker (_worker: no NumPy imported until a call or a result holds an array):
           load_call: copies mapped copy-on-write, shared segments mapped shared, both
                      through the worker's kept mappings
           run: result = fn(*args, **kwargs)
                a plain result goes back as it is; any other in a _wire.Reply, through
                the backward pass (_reduction, a BackwardSink) if it may hold an array:
                large results copied into the segments the parent lent the task (warm,
                from its pool) or into fresh ones whose ownership passes to the parent
    │
    ▼
  result queue ──▶ executor manager thread (unpickles) ──▶ future.set_result
                    └▶ _wire.load_result: rebuilds the arrays zero-copy over the result's
                       segments, handed to the executor's ResultLoans (now the parent's;
                       pooled once the result is collected)
  future done ──▶ Task.release(): the call's copies are let go of: pooled if no task
                   holds them and every worker released them, else dropped and unlinked
                   (_tracking.Segment)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FuturesTimeoutError
from functools import partial
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from . import _session
from ._api import Statistics, map_calls
from ._batching import Batching
from ._config import Options
from ._loky import (
    LokyExecutor,
    LokyFuture,
    PoolFuture,
    cpu_count,
    fork_server_folder,
    get_context,
    warm_context,
)
from ._transport import Task, Transport, pooled_everywhere
from ._wire import Delivered, Failure, dumps_sharing_globals
from ._worker import run, run_batch, run_chunk, run_initializer

if TYPE_CHECKING:  # imported by get_executor only: asyncio and all, ~0.1 s
    from ._cluster import ClusterExecutor

__all__ = ["SharedProcessPoolExecutor", "Statistics", "get_executor"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
F = TypeVar("F", bound=PoolFuture)


def _resolve_context(mp_context: BaseContext | str | None) -> BaseContext:
    if mp_context is None:
        # Forks of sharexec's warm server (see _loky.warm_context), started now so that
        # it imports while the caller goes on: the first worker is a fork of it.
        context: BaseContext = warm_context()
        context.start_server()  # type: ignore[attr-defined]
        return context
    if isinstance(mp_context, str):
        if mp_context == "fork":
            # loky's get_context warns on "fork"; the stdlib's does not, nor do we.
            return multiprocessing.get_context("fork")
        return _with_fork_server_folder(get_context(mp_context))
    if not hasattr(mp_context, "Process") or not hasattr(mp_context, "get_start_method"):
        raise TypeError(
            "mp_context must be a multiprocessing context or a start-method name, "
            f"got {mp_context!r}"
        )
    return _with_fork_server_folder(mp_context)


def _with_fork_server_folder(context: BaseContext) -> BaseContext:
    """``context``; a forkserver one once its server has a folder for its socket (made
    in /dev/shm where no temporary folder is writable: see _loky.fork_server_folder)."""
    if context.get_start_method() == "forkserver":
        fork_server_folder()
    return context


class SharedProcessPoolExecutor(LokyExecutor):
    """A :class:`concurrent.futures.ProcessPoolExecutor` that shares large arrays.

    Same constructor, methods and exceptions as the standard library's executor. Large
    NumPy arrays (and other protocol-5 buffers) among the arguments and results travel
    through shared memory instead of a pipe: a private array is copied once into a
    segment and seen copy-on-write by the worker; an array allocated with
    :func:`sharexec.empty` and friends (or any view of one) travels by reference, so
    workers write into it in place. PyTorch tensors keep torch's semantics: a CPU
    tensor passed to a task is shared with it (moved into a segment first if it was
    private), as through the standard library's executor.

    Parameters
    ----------
    max_workers : int, optional
        Number of worker processes; defaults to the number of usable CPUs.
    mp_context : multiprocessing context or str, optional
        A :mod:`multiprocessing` context, or a start method name (``"spawn"``,
        ``"fork"``, ``"forkserver"``, ``"loky"``). By default, workers are forks of a
        server of sharexec's own, started once per process, that imported sharexec's
        worker side and NumPy: no fork of this process, warm workers. Workers start on
        demand (a call finding no idle worker starts one, up to ``max_workers``), but
        under ``"fork"`` all start at the first call, as in the standard library.
    initializer : callable, optional
        Called in each new worker with ``initargs``; its arguments are shared like a
        task's.
    initargs : tuple, default ()
        Arguments of ``initializer``.
    max_tasks_per_child : int, optional
        Each worker runs at most this many tasks, then is replaced by a new one. As in
        the standard library, it needs a start method other than ``fork``, and defaults
        to ``spawn`` when ``mp_context`` is not given.
    **options
        sharexec options: ``min_share_bytes`` (buffers at least this large go through
        shared memory; default 256 KiB, or ``SHAREXEC_MIN_SHARE_BYTES``),
        ``temp_folder`` (where segments spill when shared memory is full; default the
        system's temporary folder, or ``SHAREXEC_TEMP_FOLDER``), ``batching``
        (default True, or ``SHAREXEC_BATCHING``: queued calls of functions measured
        short go to a worker several in one message; each still gets its own future,
        result and exception) and ``tensor_sharing`` (how private PyTorch tensors are
        shared with tasks: ``"sharexec"``, moved into segments, the default; or
        ``"torch"``, torch's own reducers; or ``SHAREXEC_TENSOR_SHARING``). An unknown
        option is a :class:`~sharexec.ConfigError`.
    """

    _worker_env: dict[str, str] | None = None  # the workers' environment (loky's method)
    _started = 0  # the workers it started so far

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: BaseContext | str | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[object, ...] = (),
        *,
        max_tasks_per_child: int | None = None,
        **options: object,
    ) -> None:
        self._options = Options.resolve(options)
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
            if mp_context is None:
                mp_context = "spawn"  # as the standard library
        context = _resolve_context(mp_context)
        if max_tasks_per_child is not None and context.get_start_method() == "fork":
            raise ValueError(
                "max_tasks_per_child is incompatible with the 'fork' multiprocessing "
                "start method; supply a different mp_context."
            )
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        self._transport = Transport(self._options)
        # Every worker runs run_initializer: it watches this process (and exits with it),
        # then runs the user's initializer, whose call is shared like a task's, pickled at
        # each worker start: it lives as long as the executor.
        self._init_task: Task | None = None
        if initializer is not None:
            self._init_task = Task(initializer, tuple(initargs), {}, self._transport)
        # Under fork the initializer's call is inherited, not pickled: its function is
        # pickled into this list once, at the first submit, before any worker forks (see
        # _submit), so that each worker runs it in the namespace the calls' functions
        # share (run_initializer), e.g. [b"\x80\x05..."].
        self._init_pickled: list[bytes] = []
        self._forks = context.get_start_method() == "fork"
        initargs = (os.getpid(), self._init_task, _session.SweeperAddress(), self._init_pickled)
        initializer = run_initializer
        self._sweeper_reached = False  # see submit
        # One lock guards the state of the futures of this executor that have none of
        # their own yet (see LokyFuture).
        self._new_future = partial(_Future, lock=threading.RLock())
        workers = cpu_count() if max_workers is None else max_workers
        # Queued calls of functions measured short travel together (see _batching);
        # not with max_tasks_per_child, which counts what a worker takes.
        batching = None
        if self._options.batching and max_tasks_per_child is None and workers > 0:
            batching = Batching(self._transport, workers, run, run_batch)
        self._batching = batching
        super().__init__(
            max_workers=max_workers,
            context=context,
            initializer=initializer,
            initargs=initargs,
            env=self._worker_env,
            max_tasks_per_child=max_tasks_per_child,
            batching=batching,
            # What workers handed over for results never read is freed then, not at exit.
            results_closed=partial(_session.receiver_closed, self._transport.token),
        )
        # Its pool of warm segments and the initializer's copies go at shutdown, or as
        # soon as this object is collected if it never was (dropped, as a standard
        # library executor may be, whose workers then exit and which holds nothing): not
        # when the pool's idle timer fires, nor when the garbage collector next breaks
        # the cycles the transport is in. The calls still in flight keep their own
        # segments; what comes back to the closed pool is dropped.
        self._close_transport = weakref.finalize(
            self, _close_transport, self._transport, self._init_task, self._pending_work_items
        )

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` in a worker; return its future.

        Large array arguments are moved into shared memory when the call is sent to a
        worker, and large array results come back the same way.
        """
        # The future is ours from the start (not loky's, as its submit would make): the
        # task is complete before the feeder thread can pickle it, and no more objects
        # than loky's own are left for the garbage collector per pending call.
        future: Future[T] = self._submit(fn, args, self._new_future, kwargs)
        return future

    def _submit(
        self,
        fn: Callable[..., object],
        args: tuple[object, ...],
        outcome: Callable[[Task], F],
        kwargs: dict[str, object] | None = None,
    ) -> F:
        """Queue the call; its outcome goes to ``outcome(task)``: a future, or a slot."""
        if not self._sweeper_reached:
            # Before the first workers start: forked, they must know the sweeper's
            # address (see run_initializer), and every call carries it anyway.
            self._transport.context()
            if self._init_task is not None and self._forks:
                with contextlib.suppress(Exception):  # unpicklable: it runs as inherited
                    self._init_pickled.append(dumps_sharing_globals(self._init_task.fn))
            self._sweeper_reached = True
        task = Task(fn, args, kwargs, self._transport)
        future = outcome(task)
        self._enqueue(future, run, (task,))  # counted there (statistics: _pool_submitted)
        return future

    def _workers_started(self, pids: list[int]) -> None:
        # The sweeper ends them if they outlive this process (stopped, they cannot).
        _session.workers_started(pids)
        self._started += len(pids)

    def statistics(self) -> Statistics:
        """What this executor moved, and how: proof that sharing happens.

        Returns
        -------
        Statistics
            Counts since the executor was created, and the segments held right now
            (live data apart from the warm pool); each field is described there.
        """
        counts = self._transport.counts
        pooled, pooled_bytes = self._transport.pool.totals()
        # The process's own segments less every executor's pool: those holding data.
        owned, owned_bytes = _session.live()
        everywhere, everywhere_bytes = pooled_everywhere()
        return Statistics(
            segments_live=max(0, owned - everywhere),
            bytes_in_shared_memory=max(0, owned_bytes - everywhere_bytes),
            segments_pooled=pooled,
            bytes_pooled=pooled_bytes,
            bytes_copied=counts["bytes_copied"],
            bytes_reused=counts["bytes_reused"],
            bytes_by_reference=counts["bytes_by_reference"],
            fallbacks=counts["fallbacks"],
            tasks_submitted=self._pool_submitted,
            tasks_done=counts["tasks_done"],
            tasks_batched=counts["tasks_batched"],
            batches=counts["batches"],
        )

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[T]:
        """Return an iterator of ``fn`` applied to the items of ``iterables``, in order.

        As :meth:`concurrent.futures.ProcessPoolExecutor.map` of Python 3.14, on every
        Python sharexec supports. The chunks of a large array passed as items
        (``np.array_split(a, 64)``) are each copied once into shared memory.

        Parameters
        ----------
        fn : callable
            Called as ``fn(*items)``, one item of each iterable.
        *iterables : iterable
            Consumed in step, until the shortest ends.
        timeout : float, optional
            Seconds, from this call, within which every result must be ready:
            :class:`TimeoutError` when one is not.
        chunksize : int, default 1
            Calls sent to a worker together, in one task.
        buffersize : int, optional
            At most this many tasks (of ``chunksize`` calls) are submitted ahead of the
            results consumed: ``map`` over a huge or endless iterator takes items as
            results are taken. By default every call is submitted at once.

        Returns
        -------
        iterator
            The results, in the order of the items. A call's exception is raised when its
            result is reached; closing the iterator cancels the calls not started.
        """
        # A call per item is submitted as it is, so that calls with plain arguments skip
        # the pickling pass (see Transport.plain_call) and calls of a function measured
        # short travel in batches; each with a slot, not a future (no user sees it: a
        # tenth of a future's cost).
        submit_one = partial(_submit_slot, _MapRun(), fn)
        chunk = partial(run_chunk, fn)
        return map_calls(self, iterables, timeout, chunksize, buffersize, submit_one, chunk)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Free the workers and the segments of the executor (without ``wait``, those of
        the calls still pending as each is done).

        As :meth:`concurrent.futures.Executor.shutdown`: with ``cancel_futures``, the
        calls not yet started are cancelled.
        """
        if cancel_futures:
            self._cancel_pending()  # and the calls a worker hands back later
        if self._started and self._context is warm_context() and not self._pool_shut_down:
            # A program that made a pool may make another: its workers will start
            # without waiting for a fork of the warm server (see _WarmServer.ahead),
            # forked while this one's workers exit.
            self._context.fork_ahead(min(self._started, self._pool_max_workers))  # type: ignore[attr-defined]
        super().shutdown(wait=wait)
        self._close_transport()  # with wait, no call is pending any more

    def terminate_workers(self) -> None:
        """Terminate every live worker now (SIGTERM), and shut the executor down.

        As :meth:`concurrent.futures.ProcessPoolExecutor.terminate_workers` of Python
        3.14: the calls not started are cancelled, those running fail with
        :class:`~concurrent.futures.process.BrokenProcessPool`, and no call may be
        submitted afterwards. Their segments are freed as for any dead worker.
        """
        self._force_shutdown(kill=False)

    def kill_workers(self) -> None:
        """Kill every live worker now (SIGKILL), and shut the executor down.

        As :meth:`concurrent.futures.ProcessPoolExecutor.kill_workers` of Python 3.14,
        otherwise as :meth:`terminate_workers`.
        """
        self._force_shutdown(kill=True)

    def _force_shutdown(self, kill: bool) -> None:
        # The processes first: shutting down forgets them. Not waiting: a worker that
        # would not exit would hold us forever.
        processes = self._pool_processes()
        self.shutdown(wait=False, cancel_futures=True)
        signum = signal.SIGKILL if kill else signal.SIGTERM
        for process in processes:
            try:
                pid = process.pid
                if pid is not None and process.is_alive():  # not reaped: its pid is its own
                    os.kill(pid, signum)  # loky's processes have no kill()
            except (ValueError, ProcessLookupError):  # closed, or gone meanwhile
                continue


class _WorkItem(Protocol):
    """loky's record of a call not done yet, in its table of pending calls."""

    @property
    def future(self) -> PoolFuture: ...


def _close_transport(
    transport: Transport, init_task: Task | None, pending: Mapping[int, _WorkItem]
) -> None:
    """An executor is shut down or collected: drop its pool of warm segments, and once
    the calls ``pending`` (loky's work items, by id) are done, the segments of its
    functions and the initializer's call (its copies).

    Shut down, the pool starts a worker (which needs the initializer's call, and maps
    the functions' segments) only to replace one while calls are pending: none is,
    after the last of them. Not before: that would keep them in /dev/shm for as long
    as the executor lives.
    """
    transport.close()
    futures = [item.future for item in list(pending.values())]
    left = [len(futures)]
    lock = threading.Lock()

    def all_done() -> None:
        transport.done()
        if init_task is not None:
            init_task.release()

    def one_done(_: object) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            all_done()

    if not futures:
        all_done()
    for future in futures:
        future.add_done_callback(one_done)  # at once if it is done already


# ---------------------------------------------------------------------------------------
# The calls of map(): slots instead of futures
# ---------------------------------------------------------------------------------------

_PENDING, _RUNNING, _DONE, _CANCELLED = range(4)


class _MapRun:
    """What the calls of one ``map`` share: a lock over their slots' states, and the
    condition its iterator waits on (for the slot it wants next: ``waiting``)."""

    __slots__ = ("condition", "waiting")

    def __init__(self) -> None:
        self.condition = threading.Condition(threading.Lock())
        self.waiting: _Slot[object] | None = None


def _submit_slot(
    run: _MapRun,
    fn: Callable[..., T],
    executor: SharedProcessPoolExecutor,
    args: tuple[object, ...],
) -> _Slot[T]:
    """Queue ``fn(*args)`` for ``map``, its outcome to a slot of ``run``."""
    slot: _Slot[T] = executor._submit(fn, args, partial(_Slot, run=run))
    return slot


class _Slot(Generic[T_co]):
    """Where a call of ``map`` gets its outcome: what the pool needs of a future
    (``set_running_or_notify_cancel``, ``set_pending_again``, ``set_result``,
    ``set_exception``, ``cancel``, ``done``, ``add_done_callback``), and ``result`` for
    map's iterator.

    A future per call costs about ten objects (a condition, its lock, lists) and a lock
    taken at each step; map's calls are seen by no one but its iterator, so they share
    one lock and one condition (:class:`_MapRun`). As a future, a slot releases its
    task's segments before its outcome is seen, and raises a result that failed to
    rebuild.
    """

    __slots__ = ("_callbacks", "_error", "_run", "_state", "_value", "task")

    def __init__(self, task: Task, run: _MapRun) -> None:
        self.task: Task | None = task
        self._run = run
        self._state = _PENDING
        self._value: object = None  # the call's result, once done
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[_Slot[T_co]], object]] | None = None

    def set_running_or_notify_cancel(self) -> bool:
        with self._run.condition:
            if self._state == _CANCELLED:
                return False
            self._state = _RUNNING
            return True

    def set_pending_again(self) -> None:
        """Its call was handed back unstarted: it may be cancelled again."""
        with self._run.condition:
            if self._state == _RUNNING:
                self._state = _PENDING

    def set_result(self, result: object) -> None:
        if type(result) is Failure:
            self.set_exception(result.error)
        elif type(result) is Delivered:
            self._release(result)
            self._finish(result.value, None)
        else:  # a plain value, sent back as it is (see _worker.run)
            self._release(None)
            self._finish(result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        self._release(None)
        self._finish(None, exception)

    def cancel(self) -> bool:
        if self._state >= _DONE:  # final: no lock needed (map cancels each after use)
            return self._state == _CANCELLED
        with self._run.condition:
            if self._state != _PENDING:
                return self._state == _CANCELLED
            self._state = _CANCELLED
            if self._run.waiting is self:
                self._run.condition.notify_all()
        self._release(None)
        self._call_back()
        return True

    def done(self) -> bool:
        return self._state >= _DONE

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def add_done_callback(self, fn: Callable[[_Slot[T_co]], object]) -> None:
        with self._run.condition:
            if self._state < _DONE:
                self._callbacks = [*(self._callbacks or ()), fn]
                return
        fn(self)

    def result(self, timeout: float | None = None) -> T_co:
        """The call's result (or its exception raised), waiting ``timeout`` seconds."""
        if self._state < _DONE:
            run = self._run
            end = None if timeout is None else time.monotonic() + timeout
            with run.condition:
                run.waiting = self
                try:
                    while self._state < _DONE:
                        left = None if end is None else end - time.monotonic()
                        if left is not None and left <= 0:
                            # concurrent.futures' own (the builtin one only from 3.11)
                            raise FuturesTimeoutError
                        run.condition.wait(left)
                finally:
                    run.waiting = None
        if self._state == _CANCELLED:
            raise CancelledError
        error, self._error = self._error, None
        if error is not None:
            try:
                raise error
            finally:
                del error  # breaks the cycle of its traceback with this frame
        value, self._value = self._value, None  # held by the caller only
        return cast("T_co", value)  # what fn returned, unpickled

    def _finish(self, value: object, error: BaseException | None) -> None:
        run = self._run
        with run.condition:
            if self._state >= _DONE:
                return  # cancelled (or failed by a broken pool) already
            self._value, self._error, self._state = value, error, _DONE
            if run.waiting is self:
                run.condition.notify_all()
        self._call_back()

    def _call_back(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)

    def _release(self, delivered: Delivered | None) -> None:
        """Release the task's segments, once, before the outcome is seen."""
        with self._run.condition:
            task, self.task = self.task, None
        if task is not None:
            task.release(delivered)
            task.transport.counts.add("tasks_done")


class _Future(LokyFuture):
    """loky's future, which releases its task's segments as soon as it is done, and raises
    a result that failed to rebuild instead of returning it.

    The manager thread's ``set_result`` fails this one future instead of the whole pool.
    No reference to the executor, so that a future never keeps it alive.
    """

    def __init__(self, task: Task, lock: threading.RLock | None = None) -> None:
        super().__init__(lock)
        self.task: Task | None = task  # until released

    def set_result(self, result: object) -> None:
        if type(result) is Failure:
            self.set_exception(result.error)
        elif type(result) is Delivered:
            self._release(result)
            super().set_result(result.value)
        else:  # a plain value, sent back as it is (see _worker.run)
            self._release(None)
            super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self._release(None)
        super().set_exception(exception)

    def cancel(self) -> bool:
        cancelled: bool = super().cancel()
        if cancelled:
            self._release(None)
        return cancelled

    def _release(self, delivered: Delivered | None) -> None:
        """Release the task's segments, once, before the future is seen done."""
        lock = self._take_lock()
        try:
            task, self.task = self.task, None
        finally:
            lock.release()
        if task is not None:
            task.release(delivered)
            task.transport.counts.add("tasks_done")


# ---------------------------------------------------------------------------------------
# One executor per process, for library authors
# ---------------------------------------------------------------------------------------

# The environment variables through which BLAS and OpenMP libraries size their pools.
_THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


class _ProcessWideExecutor(SharedProcessPoolExecutor):
    """The executor of get_executor(): loky's start method, BLAS/OpenMP pools limited.

    loky's start method sets the workers' environment before they import anything, so
    the limit holds even for numpy imported at start-up (threadpoolctl would need numpy
    loaded first, and is not a dependency). Variables the user set are left alone.
    """

    def __init__(self, max_workers: int, **options: Any) -> None:  # the constructor's
        threads = str(max(1, cpu_count() // max_workers))
        self._worker_env = {v: threads for v in _THREAD_VARIABLES if v not in os.environ}
        super().__init__(max_workers, mp_context="loky", **options)


_process_wide_lock = threading.Lock()
_process_wide: _ProcessWideExecutor | None = None


def get_executor(
    max_workers: int | None = None, **options: object
) -> SharedProcessPoolExecutor | ClusterExecutor:
    """The process-wide executor, for library code that wants to parallelize.

    Within a :func:`sharexec.use_cluster` block, the user's choice: that block's
    :class:`ClusterExecutor`, whatever the arguments (the cluster's size is the user's).

    Created at the first call and reused by every later one, from any thread: libraries
    share one pool of workers instead of each starting its own. Each worker's BLAS and
    OpenMP thread pools are limited to ``cores // max_workers`` threads, so that workers
    times threads do not oversubscribe the machine. Don't shut it down: let the process
    exit, or call :func:`get_executor` again, which replaces it if it was shut down or
    broken.

    Parameters
    ----------
    max_workers : int, optional
        Workers wanted; by default, the current executor's, or the number of cores. A
        different number replaces the executor with one of that size (calls already
        submitted to the old one still complete).
    **options
        sharexec options (e.g. ``min_share_bytes``); different options also replace it.

    Returns
    -------
    SharedProcessPoolExecutor or ClusterExecutor
        The executor; use ``submit`` and ``map`` as usual.
    """
    global _process_wide
    from ._cluster import chosen  # here, not at import: a pool's start does not wait for it

    cluster = chosen()
    if cluster is not None:
        return cluster
    settings = Options.resolve(options)
    with _process_wide_lock:
        current = _process_wide
        if max_workers is None:
            max_workers = current._pool_max_workers if current is not None else cpu_count()
        usable = (
            current is not None
            and current._pool_broken is None
            and not current._pool_shut_down
            and current._pool_max_workers == max_workers
            and current._options == settings
        )
        if not usable:
            if current is not None:
                current.shutdown(wait=False)  # its pending calls still complete
            _process_wide = current = _ProcessWideExecutor(max_workers, **options)
        assert current is not None
        return current
