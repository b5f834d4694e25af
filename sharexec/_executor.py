"""SharedProcessPoolExecutor: loky's process pool with a shared-memory transport.

Data flow, in the order a submitted call travels (the queues and threads are loky's,
themselves those of CPython's ``concurrent.futures.process``)::

  submit(fn, *args, **kwargs)                                   user thread
    │  wraps the call in a _reduction.Task; nothing is copied yet
    ▼
  pending work items ──▶ call queue ──(feeder thread pickles)──▶ pipe ──▶ worker
                          │
                          └▶ Task.__reduce__: one cloudpickle pass (_reduction)
                               shared array view  ─▶ by reference: (name, geometry)
                               large private buffer ─▶ copied once into a segment
                                                       (_tracking.new_private,
                                                        _segments.create + fallocate)
                               anything else      ─▶ pickled, in the payload
                             the Task keeps its segments alive until its future is done

  worker (_worker: no NumPy imported until a call or a result holds an array):
           load_call: copies mapped copy-on-write, shared segments mapped shared
           run: result = fn(*args, **kwargs)
                Reply: a plain result goes back as it is; any other takes the backward
                pass (_reduction): large results copied into fresh segments whose
                ownership passes to the parent
    │
    ▼
  result queue ──▶ executor manager thread (unpickles) ──▶ future.set_result
                    └▶ load_result: maps each result segment, unlinks it at once,
                       rebuilds the arrays zero-copy
  future done ──▶ Task.release(): the call's segments are dropped, and a segment whose
                   last user is gone is unlinked (_tracking.Segment)
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

from loky import ProcessPoolExecutor as _LokyExecutor
from loky import cpu_count
from loky import process_executor as _loky_executor
from loky._base import Future as _LokyFuture
from loky.backend.context import get_context as _loky_context
from loky.process_executor import _WorkItem

from . import _tracking
from ._config import Options
from ._queues import CallQueue, ResultQueue
from ._transport import Task, Transport, pooled_everywhere
from ._wire import Delivered, RebuildFailure
from ._worker import run, run_initializer

__all__ = ["SharedProcessPoolExecutor", "Statistics", "get_executor"]

T = TypeVar("T")
_NO_KEYWORDS: dict[str, Any] = {}  # loky's keywords for run(task): never changed


def _resolve_context(mp_context: BaseContext | str | None) -> BaseContext:
    if mp_context is None:
        context: BaseContext = _loky_context()  # loky's own start method
        return context
    if isinstance(mp_context, str):
        if mp_context == "fork":
            # loky's get_context warns on "fork"; the stdlib's does not, nor do we.
            return multiprocessing.get_context("fork")
        context = _loky_context(mp_context)
        return context
    if not hasattr(mp_context, "Process") or not hasattr(mp_context, "get_start_method"):
        raise TypeError(
            "mp_context must be a multiprocessing context or a start-method name, "
            f"got {mp_context!r}"
        )
    return mp_context


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
        yours lives in them, and they are freed after 10 s unused or at shutdown.
    bytes_pooled : int
        Their total size: at most a quarter of the shared-memory folder, and 1 GiB.
    bytes_copied : int
        Bytes of arguments copied into shared memory, one memcpy each: a large private
        array (or its part a task can see) once per copy made, a gappy view
        (``img[:1024, :1024]``) once, compactly.
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


class SharedProcessPoolExecutor(_LokyExecutor):  # type: ignore[misc]
    """A :class:`concurrent.futures.ProcessPoolExecutor` that shares large arrays.

    Same constructor, methods and exceptions as the standard library's executor. Large
    NumPy arrays (and other protocol-5 buffers) among the arguments and results travel
    through shared memory instead of a pipe: a private array is copied once into a
    segment and seen copy-on-write by the worker; an array allocated with
    :func:`sharexec.empty` and friends (or any view of one) travels by reference, so
    workers write into it in place.

    Parameters
    ----------
    max_workers : int, optional
        Number of worker processes; defaults to the number of usable CPUs.
    mp_context : multiprocessing context or str, optional
        A :mod:`multiprocessing` context, or a start method name (``"spawn"``,
        ``"fork"``, ``"forkserver"``, ``"loky"``). Defaults to loky's start method.
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
        shared memory; default 256 KiB, or ``SHAREXEC_MIN_SHARE_BYTES``) and
        ``temp_folder`` (where segments spill when shared memory is full; default the
        system's temporary folder, or ``SHAREXEC_TEMP_FOLDER``). An unknown option is a
        :class:`~sharexec.ConfigError`.
    """

    _worker_env: dict[str, str] | None = None  # the workers' environment (loky's method)

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: BaseContext | str | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        max_tasks_per_child: int | None = None,
        **options: Any,
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
        self._max_tasks_per_child = max_tasks_per_child
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        self._transport = Transport(self._options)
        # Every worker runs run_initializer: it watches this process (and exits with it),
        # then runs the user's initializer, whose call is shared like a task's, pickled at
        # each worker start: it lives as long as the executor.
        self._init_task: Task | None = None
        if initializer is not None:
            self._init_task = Task(initializer, tuple(initargs), {}, self._transport)
        initializer, initargs = run_initializer, (os.getpid(), self._init_task)
        super().__init__(
            max_workers=max_workers,
            context=context,
            initializer=initializer,
            initargs=initargs,
            env=self._worker_env,
        )

    def _setup_queues(
        self, job_reducers: Any, result_reducers: Any, queue_size: int | None = None
    ) -> None:
        super()._setup_queues(job_reducers, result_reducers, queue_size)
        # Same queues, with a cheaper envelope and worker recycling (see _queues). Set
        # before anything is put on them: the call queue's feeder starts at the first put.
        self._call_queue.__class__ = CallQueue
        self._call_queue.max_tasks = self._max_tasks_per_child
        self._result_queue.__class__ = ResultQueue

    def _start_executor_manager_thread(self) -> None:
        super()._start_executor_manager_thread()
        if self._max_tasks_per_child is not None:
            # Recycling is asked for: loky's warning about a recycled worker (meant for
            # its memory-leak recycling) would be noise. Set before any worker can have
            # finished its tasks, hence before the manager thread can read it.
            self._executor_manager_thread.recycling_warned = True

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` in a worker; return its future.

        Large array arguments are moved into shared memory when the call is sent to a
        worker, and large array results come back the same way.
        """
        # loky's submit, except that the future is ours from the start: the task is
        # complete before the feeder thread can pickle it, and no more objects than
        # loky's own are left for the garbage collector per pending call.
        task = Task(fn, args, kwargs, self._transport)
        future: _Future = _Future(task)
        flags = self._flags
        with flags.shutdown_lock:
            if flags.broken is not None:
                raise flags.broken
            if flags.shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _loky_executor._global_shutdown:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            work_id: int = self._queue_count  # type: ignore[has-type]
            self._pending_work_items[work_id] = _WorkItem(future, run, (task,), _NO_KEYWORDS)
            self._work_ids.put(work_id)
            self._queue_count = work_id + 1
            self._executor_manager_thread_wakeup.wakeup()  # it queues the call for a worker
            self._ensure_executor_running()
        self._transport.counts.add("tasks_submitted")
        return future

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
        owned, owned_bytes = _tracking.live()
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
            tasks_submitted=counts["tasks_submitted"],
            tasks_done=counts["tasks_done"],
        )

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
    ) -> Iterator[T]:
        """Return an iterator of ``fn`` applied to the items of ``iterables``, in order.

        As :meth:`concurrent.futures.Executor.map`. The chunks of a large array passed
        as items (``np.array_split(a, 64)``) are each copied once into shared memory.
        """
        if chunksize == 1:
            # A call per item, submitted as it is: loky (as the stdlib) would wrap each in
            # a one-item chunk, a partial that no call with plain arguments could skip the
            # pickling pass with (see Transport.plain_call).
            return Executor.map(self, fn, *iterables, timeout=timeout)
        results: Iterator[T] = super().map(fn, *iterables, timeout=timeout, chunksize=chunksize)
        return results

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Free the workers and, with ``wait``, the segments of the executor.

        As :meth:`concurrent.futures.Executor.shutdown`: with ``cancel_futures``, the
        calls not yet started are cancelled.
        """
        if cancel_futures:
            for work_item in list(self._pending_work_items.values()):
                work_item.future.cancel()
        super().shutdown(wait=wait)
        self._transport.close()
        if wait and self._init_task is not None:
            self._init_task.release()


class _Future(_LokyFuture):  # type: ignore[misc]
    """loky's future, which releases its task's segments as soon as it is done, and raises
    a result that failed to rebuild instead of returning it.

    The manager thread's ``set_result`` fails this one future instead of the whole pool.
    No reference to the executor, so that a future never keeps it alive.
    """

    def __init__(self, task: Task) -> None:
        super().__init__()
        self.task: Task | None = task  # until released

    def set_result(self, result: Any) -> None:
        if type(result) is RebuildFailure:
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
        with self._condition:
            task, self.task = self.task, None
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

    def __init__(self, max_workers: int, **options: Any) -> None:
        threads = str(max(1, cpu_count() // max_workers))
        self._worker_env = {v: threads for v in _THREAD_VARIABLES if v not in os.environ}
        super().__init__(max_workers, mp_context="loky", **options)


_process_wide_lock = threading.Lock()
_process_wide: _ProcessWideExecutor | None = None


def get_executor(max_workers: int | None = None, **options: Any) -> SharedProcessPoolExecutor:
    """The process-wide executor, for library code that wants to parallelize.

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
    SharedProcessPoolExecutor
        The executor; use ``submit`` and ``map`` as usual.
    """
    global _process_wide
    settings = Options.resolve(options)
    with _process_wide_lock:
        current = _process_wide
        if max_workers is None:
            max_workers = current._max_workers if current is not None else cpu_count()
        usable = (
            current is not None
            and current._flags.broken is None
            and not current._flags.shutdown
            and current._max_workers == max_workers
            and current._options == settings
        )
        if not usable:
            if current is not None:
                current.shutdown(wait=False)  # its pending calls still complete
            _process_wide = current = _ProcessWideExecutor(max_workers, **options)
        assert current is not None
        return current
