"""The base of sharexec's executor: loky's ``ProcessPoolExecutor`` with a future of the
caller's class, workers started on demand, and sharexec's queues and manager thread.

Replaces, in loky 3.7's ``loky.process_executor.ProcessPoolExecutor``:

* ``submit``'s core, as ``_enqueue(future, fn, args)``: the same steps on loky's state
  (``_flags``, ``_pending_work_items``, ``_work_ids``, ``_queue_count``, the manager's
  wake-up), with the caller's future (loky's ``submit`` makes its own);
* ``_adjust_process_count``: at most one worker started per call not done (loky starts
  them all at once), as the standard library does for spawn and forkserver since 3.9;
  under fork all at the first call; a Ctrl-C held while they start;
* ``_ensure_executor_running``: the manager thread started before the first worker,
  unless under fork;
* ``_setup_queues`` (loky's hook for its queues): the same queues, of the classes of
  :mod:`sharexec._loky.queues`;
* ``_start_executor_manager_thread``: the thread loky starts, then made a
  ``batching._Manager`` (a class swap: loky makes, starts and registers it in one
  method, with no hook for its class);
* ``shutdown(cancel_futures=True)`` also reaches the calls a worker hands back later.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from types import FrameType

import loky
from loky import process_executor
from loky.backend import context as loky_context

from .batching import _NO_KEYWORDS, BatchPolicy, _CoalescedWakeup, _Manager, _WorkIds
from .futures import PoolFuture
from .queues import _CallQueue, _ResultQueue
from .reducers import Reducers

# Public loky API, offered here so that the executor needs no other door.
cpu_count: Callable[..., int] = loky.cpu_count
get_context: Callable[..., BaseContext] = loky_context.get_context


class LokyExecutor(loky.ProcessPoolExecutor):  # type: ignore[misc]
    """loky's executor, with what sharexec needs of its internals under plain names.

    ``max_tasks_per_child`` recycles each worker after that many tasks (loky's constructor
    has no such argument); ``batching``: the policy of calls sent together;
    ``results_closed``: called by the manager thread once it reads no more results (shut
    down, broken or terminated), holding no reference to the executor. The other
    arguments are loky's. The call and result queues are of :mod:`sharexec._loky.queues`'
    classes from the start.
    """

    _queue_count: int  # loky's: the work id of the next call, e.g. 17

    def __init__(
        self,
        *,
        max_workers: int | None,
        context: BaseContext,
        initializer: Callable[..., object] | None,
        initargs: tuple[object, ...],
        env: dict[str, str] | None,
        max_tasks_per_child: int | None,
        batching: BatchPolicy | None = None,
        results_closed: Callable[[], None] | None = None,
    ) -> None:
        self._max_tasks_per_child = max_tasks_per_child  # read by _setup_queues
        self._batching = batching  # read by _start_executor_manager_thread
        self._results_closed = results_closed  # and this
        super().__init__(
            max_workers=max_workers,
            context=context,
            initializer=initializer,
            initargs=initargs,
            env=env,
        )
        # Before any call is queued, so before the manager thread exists (it reads both
        # when it starts): a wake-up written only when none is pending, ids in a deque.
        # A class swap, not a construction: loky's __init__ makes the wake-up inline (no
        # hook), and hands it on to the queues _setup_queues makes (ours, below) before
        # this line runs; the object stays the same, only its methods change.
        self._executor_manager_thread_wakeup.__class__ = _CoalescedWakeup
        self._work_ids = _WorkIds()
        # Whether the calls not started are cancelled (shutdown(cancel_futures=True)),
        # those a worker hands back later included (read by the manager thread).
        self._flags.cancel_pending = False

    def _enqueue(
        self, future: PoolFuture, fn: Callable[..., object], args: tuple[object, ...]
    ) -> None:
        """Queue the call ``fn(*args)``, whose outcome ``future`` will receive.

        As loky's ``submit``, with the caller's future: raises the error that broke the
        pool, or :class:`RuntimeError` once it is shut down (the standard library's plain
        one, where loky raises its subclass) or the interpreter is exiting.
        """
        flags = self._flags
        with flags.shutdown_lock:
            if flags.broken is not None:
                raise flags.broken
            if flags.shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if process_executor._global_shutdown:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            work_id = self._queue_count
            work_item = process_executor._WorkItem(future, fn, args, _NO_KEYWORDS)
            self._pending_work_items[work_id] = work_item
            self._work_ids.put(work_id)
            self._queue_count = work_id + 1
            self._executor_manager_thread_wakeup.wakeup_for_call()  # unless it is awake
            # loky takes a process lock here at every call; only needed while the pool
            # is short of workers or has no manager thread (the manager itself replaces
            # a worker that leaves while calls are pending).
            if self._executor_manager_thread is None or len(self._processes) != int(
                self._max_workers
            ):
                with _ctrl_c_deferred():  # workers and the manager thread start together
                    self._ensure_executor_running()

    @property
    def _pool_broken(self) -> BaseException | None:
        """The error that broke the pool (a worker died...), or None while it works."""
        broken: BaseException | None = self._flags.broken
        return broken

    @property
    def _pool_submitted(self) -> int:
        """The number of calls queued so far (loky's next work id)."""
        return int(self._queue_count)

    @property
    def _pool_shut_down(self) -> bool:
        """Whether the pool is shut down (or broken): it takes no more calls."""
        return bool(self._flags.shutdown)

    @property
    def _pool_max_workers(self) -> int:
        """The number of workers the pool keeps."""
        return int(self._max_workers)

    def _pool_processes(self) -> list[BaseProcess]:
        """The worker processes alive now (a copy: shutting down empties loky's table)."""
        processes = self._processes
        return list(processes.values()) if processes else []

    def _pending_futures(self) -> list[PoolFuture]:
        """The futures of the calls not done yet."""
        return [item.future for item in list(self._pending_work_items.values())]

    def _cancel_pending(self) -> None:
        """Cancel the calls not started (``shutdown(cancel_futures=True)``): those
        pending now, and those a worker hands back from a batch from now on."""
        self._flags.cancel_pending = True  # first: a call handed back meanwhile is seen
        for future in self._pending_futures():
            future.cancel()

    def _setup_queues(
        self,
        job_reducers: Reducers | None,
        result_reducers: Reducers | None,
        queue_size: int | None = None,
    ) -> None:
        # loky's hook for its queues (its __init__ calls it): the queues loky makes, made
        # of our classes, with loky's arguments and size.
        if queue_size is None:
            queue_size = 2 * self._max_workers + process_executor.EXTRA_QUEUED_CALLS
        self._call_queue = _CallQueue(
            max_size=queue_size,
            pending_work_items=self._pending_work_items,
            running_work_items=self._running_work_items,
            thread_wakeup=self._executor_manager_thread_wakeup,
            shutdown_lock=self._shutdown_lock,
            executor_flags=self._flags,
            reducers=job_reducers,
            ctx=self._context,
        )
        # Killed workers make the feeder thread's pipe break: loky silences that, and
        # detects the death itself.
        self._call_queue._ignore_epipe = True
        self._call_queue.max_tasks = self._max_tasks_per_child
        self._result_queue = _ResultQueue(reducers=result_reducers, ctx=self._context)

    def _adjust_process_count(self) -> None:
        # loky calls this (under _processes_management_lock) at a submit while the pool
        # is not full, and in its manager thread to replace a worker that left with
        # work pending. loky would start every worker at once; here, as the standard
        # library does for spawn and forkserver since 3.9, workers start on demand: at
        # most one per call not done yet (pending or running), up to max_workers. A
        # call submitted after the previous one's result finds that worker idle and
        # starts none.
        #
        # Under fork, as in the standard library, every worker starts at the first call,
        # before the pool's threads exist: a fork taken while the feeder thread holds a
        # lock (tempfile's, on its first use, was seen) gives a worker that never gets it.
        wanted = min(self._max_workers, len(self._pending_work_items))
        if self._context.get_start_method() == "fork":
            wanted = self._max_workers
        started = []
        while len(self._processes) < wanted:
            started.append(self._start_worker())
        if started:
            # The manager thread watches the workers it listed when it last began to
            # wait: it must list the new ones too, to notice if one dies.
            self._executor_manager_thread_wakeup.wakeup()
            self._workers_started(started)

    def _ensure_executor_running(self) -> None:
        # As loky's (the workers, then the manager thread), but the manager thread first
        # unless under fork, whose workers fork before any thread of the pool exists
        # (see _adjust_process_count). Its start (the thread scheduled, the call queue's
        # feeder thread started, the first call pickled) then overlaps the first
        # worker's, instead of holding this thread while that worker starts on the
        # other core, and the next submit with it. The manager thread lists the new
        # workers when it is woken for them, as for any worker started later.
        with self._processes_management_lock:
            if self._context.get_start_method() != "fork":
                self._start_executor_manager_thread()
            if len(self._processes) != self._max_workers:
                self._adjust_process_count()
            self._start_executor_manager_thread()

    def _start_worker(self) -> int:
        """Start one worker as loky's ``_adjust_process_count`` does; its pid."""
        exit_lock = self._context.BoundedSemaphore(1)
        exit_lock.acquire()  # released by loky when the worker is to exit
        args = (
            self._call_queue,
            self._result_queue,
            self._initializer,
            self._initargs,
            self._processes_management_lock,
            self._timeout,
            exit_lock,
            process_executor._CURRENT_DEPTH + 1,
        )
        target = process_executor._process_worker
        if self._env is not None:  # loky's own start method sets it before any import
            process = self._context.Process(target=target, args=args, env=self._env)
        else:
            process = self._context.Process(target=target, args=args)
        process._worker_exit_lock = exit_lock
        process.start()
        pid: int = process.pid
        self._processes[pid] = process
        return pid

    def _workers_started(self, pids: list[int]) -> None:
        """Hook: loky started these worker processes."""

    def _start_executor_manager_thread(self) -> None:
        started = self._executor_manager_thread is None
        super()._start_executor_manager_thread()
        thread = self._executor_manager_thread
        if started:
            # Our manager from its next step on (its state set before its class: the
            # steps of _Manager read it). Until then it runs loky's steps: it sends
            # calls one by one, which a batch's outcome never needs to follow.
            # A class swap, not a construction: loky's _start_executor_manager_thread
            # makes and starts the thread inline (no hook for its class) and registers
            # it in loky's globals for the exit handler, which a construction of ours
            # would have to copy. Its attributes are those of loky's class.
            thread.policy = self._batching
            thread.carry = None
            thread.results_closed = self._results_closed
            thread.__class__ = _Manager
        if self._max_tasks_per_child is not None:
            # Recycling is asked for: loky's warning about a recycled worker (meant for
            # its memory-leak recycling) would be noise. Set before any worker can have
            # finished its tasks, hence before the manager thread can read it.
            self._executor_manager_thread.recycling_warned = True


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives in the block until it is over, then deliver it.

    Starting workers takes milliseconds, and a ``KeyboardInterrupt`` raised in the middle
    left them half started: workers without the manager thread that would have stopped
    them (seen: the program hung at exit, joining them), or could leave a worker running
    outside loky's table (it would take the shutdown sentinel of another). Python runs
    signal handlers in the main thread only, so elsewhere (the manager thread) nothing
    needs holding.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[FrameType | None] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    except ValueError:  # not the main interpreter: its signals are not ours to hold
        yield
        return
    try:
        yield
    finally:
        # None: a handler not set from Python (an embedding program's), which cannot be
        # set back; the default then, as Python's own.
        restored = signal.default_int_handler if previous is None else previous
        signal.signal(signal.SIGINT, restored)
        if held:
            if callable(restored):
                restored(signal.SIGINT, held[0])
            elif restored == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)
