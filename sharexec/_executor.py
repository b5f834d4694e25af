"""SharedProcessPoolExecutor: loky's process pool with a shared-memory transport.

Data flow, in the order a submitted call travels (the queues and threads are loky's,
themselves those of CPython's ``concurrent.futures.process``; what sharexec changes of
them, and every use of loky's internals, is in :mod:`sharexec._loky`)::

  submit(fn, *args, **kwargs)                                   user thread
    │  wraps the call in a _transport.Task; nothing is copied yet
    ▼
  pending work items ──▶ call queue ──(feeder thread pickles)──▶ pipe ──▶ worker
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

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

from . import _tracking
from ._config import Options
from ._loky import LokyExecutor, LokyFuture, cpu_count, get_context
from ._transport import Task, Transport
from ._wire import Delivered, RebuildFailure
from ._worker import run, run_initializer

__all__ = ["SharedProcessPoolExecutor", "Statistics", "get_executor"]

T = TypeVar("T")


def _resolve_context(mp_context: BaseContext | str | None) -> BaseContext:
    if mp_context is None:
        context: BaseContext = get_context()  # loky's own start method
        return context
    if isinstance(mp_context, str):
        if mp_context == "fork":
            # loky's get_context warns on "fork"; the stdlib's does not, nor do we.
            return multiprocessing.get_context("fork")
        context = get_context(mp_context)
        return context
    if not hasattr(mp_context, "Process") or not hasattr(mp_context, "get_start_method"):
        raise TypeError(
            "mp_context must be a multiprocessing context or a start-method name, "
            f"got {mp_context!r}"
        )
    return mp_context


@dataclass(frozen=True)
class Statistics:
    """A snapshot of what an executor moved through shared memory.

    Attributes
    ----------
    segments_live : int
        Shared-memory segments this process holds now: shared arrays, copies of
        arguments in flight, results not yet collected, warm segments pooled for reuse.
    bytes_in_shared_memory : int
        Their total size.
    bytes_copied : int
        Argument bytes this executor copied into shared memory (one memcpy each).
    bytes_reused : int
        Argument bytes served by a copy already in shared memory: copies avoided.
    bytes_by_reference : int
        Bytes of shared arrays passed by reference (nothing copied).
    fallbacks : int
        Times shared memory fell short: a file on disk, or pickling, was used instead.
    tasks_submitted, tasks_done : int
        Calls submitted, and calls whose future is done.
    """

    segments_live: int
    bytes_in_shared_memory: int
    bytes_copied: int
    bytes_reused: int
    bytes_by_reference: int
    fallbacks: int
    tasks_submitted: int
    tasks_done: int


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
        shared memory; default 256 KiB, or ``SHAREXEC_MIN_SHARE_BYTES``),
        ``temp_folder`` (where segments spill when shared memory is full; default the
        system's temporary folder, or ``SHAREXEC_TEMP_FOLDER``) and ``tensor_sharing``
        (how private PyTorch tensors are shared with tasks: ``"sharexec"``, moved into
        segments, the default; or ``"torch"``, torch's own reducers; or
        ``SHAREXEC_TENSOR_SHARING``). An unknown option is a
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
            max_tasks_per_child=max_tasks_per_child,
        )

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` in a worker; return its future.

        Large array arguments are moved into shared memory when the call is sent to a
        worker, and large array results come back the same way.
        """
        # The future is ours from the start (not loky's, as its submit would make): the
        # task is complete before the feeder thread can pickle it, and no more objects
        # than loky's own are left for the garbage collector per pending call.
        task = Task(fn, args, kwargs, self._transport)
        future: _Future = _Future(task)
        self._enqueue(future, run, (task,))
        self._transport.counts.add("tasks_submitted")
        return future

    def statistics(self) -> Statistics:
        """What this executor moved, and how: proof that sharing happens.

        Returns
        -------
        Statistics
            Counts since the executor was created, and the segments this process
            holds right now.
        """
        counts = self._transport.counts
        segments, size = _tracking.live()
        return Statistics(
            segments_live=segments,
            bytes_in_shared_memory=size,
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
            for future in self._pending_futures():
                future.cancel()
        super().shutdown(wait=wait)
        self._transport.close()
        if wait and self._init_task is not None:
            self._init_task.release()


class _Future(LokyFuture):
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
        with self._state_lock:
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
