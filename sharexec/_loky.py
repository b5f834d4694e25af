"""The one door to loky's internals (and to multiprocessing's and concurrent.futures').

sharexec runs on loky's process pool, and reaches below loky's public surface in five
places, and below multiprocessing's in one. Every such access is made here and nowhere
else in sharexec; the rest of the package sees the small surface below, with plain names:

* :class:`LokyExecutor`, the base of sharexec's executor: loky's ``ProcessPoolExecutor``
  with ``_enqueue(future, fn, args)``, which queues a call with a future of the caller's
  own class (loky's ``submit`` makes its own future, so ``_enqueue`` repeats its few
  lines on loky's state: ``_flags``, ``_pending_work_items``, ``_work_ids``,
  ``_queue_count``, the manager thread's wake-up); the pool's state read through
  ``_pool_broken``, ``_pool_shut_down``, ``_pool_max_workers``, ``_pool_processes()`` and
  ``_pending_futures()``; the workers it starts, on demand (loky's
  ``_adjust_process_count``, which would start them all at once, starts at most one per
  call not done, each as loky does: ``_process_worker`` and its arguments; under fork all
  at the first call; a Ctrl-C held while they and the manager thread start), reported to
  ``_workers_started(pids)``; and the two queue subclasses below, swapped in as loky
  creates its queues.
* :func:`warm_context`, sharexec's default start method: multiprocessing's forkserver
  with a server of sharexec's own (a second ``ForkServer``, preloading
  :data:`WARM_PRELOAD`), whose ``Popen`` asks that server for the fork and tells the
  child nothing of the main module.
* The queues, subclasses of loky's (:class:`_CallQueue`, :class:`_ResultQueue`): loky
  pickles every item it puts on a queue with a fresh cloudpickle pickler, whose set-up
  (a copied dispatch table) costs about 15 µs, more than the rest of a tiny task's trip
  on either side. What sharexec puts there needs none of it: a call item carries a task
  that our own pass reduces to bytes and segment names, and a result item carries a reply
  made the same way. So the call queue's feeder thread (multiprocessing's, rebuilt on the
  queue's private parts) and the result queue's ``put`` pickle those envelopes with the
  standard pickler, and anything else (a task's exception, loky's messages) as loky
  does. They also carry worker recycling (``max_tasks_per_child``) on loky's own
  clean-exit protocol, quietly: loky's warning about a recycled worker (meant for its
  leak check) is marked as given already.
* :data:`DISPATCH_TABLE`: loky's reducers, for sharexec's picklers.
* :data:`FORKING_REDUCERS`: the reducers registered with
  ``multiprocessing.reduction.ForkingPickler.register`` (torch's tensors and storages,
  multiprocessing's own connections and sockets, sharexec's shared arrays), which the
  standard library's executor pickles everything with: read live from
  ``ForkingPickler._extra_reducers`` at each lookup, since a library registers when it is
  imported (``import torch`` does), after sharexec.
* :func:`count_private_memory_only`: in sharexec's workers only (never in the parent, nor
  in a worker of another pool), loky's leak check measures private memory, not the
  shared pages a worker maps. This is the one thing of loky that is replaced: a module
  attribute of ``loky.process_executor``, in the worker process.
* :class:`LokyFuture`, the base of sharexec's future: loky's, whose lock
  (``concurrent.futures.Future._condition``, which ``wait`` and ``as_completed`` take)
  is made when first asked for; until then the futures of one executor share one.

Also offered, being public loky API: :func:`cpu_count` and :func:`get_context`.

**Versions.** sharexec supports loky :data:`SUPPORTED_LOKY` (the pin in
``pyproject.toml``). At import, this module checks that everything it uses exists, and
otherwise raises an :class:`ImportError` that names the installed loky version and the
supported ones, so that a newer loky fails at once and clearly, not with an
``AttributeError`` in a feeder thread. Checked at import, all of it:

* module and class attributes, by lookup;
* attributes that loky or the standard library set on *instances* (``self._flags = ...``
  in ``ProcessPoolExecutor.__init__``): by the names that the code of the class's methods
  (along its MRO) assigns as attributes (its ``STORE_ATTR`` instructions), so no
  instance has to be made;
* the positional parameters of what is called or replaced here;
* that what is overridden or replaced here is still used where loky uses it
  (``_setup_queues`` by the constructor, ``_start_executor_manager_thread`` by
  ``_ensure_executor_running``, ``_start_thread`` by ``Queue.put``, the recycled worker's
  mark by the manager thread, ``_get_memory_usage`` by the worker's loop): the names
  that the code of those users refers to.

This module imports no NumPy: every worker imports it at start-up (it unpickles the
queues).
"""

from __future__ import annotations

import contextlib
import dis
import errno
import gc
import importlib
import io
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import types
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from concurrent.futures import Future
from concurrent.futures import _base as futures_base
from multiprocessing import connection as mp_connection
from multiprocessing import context as mp_context
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import popen_forkserver as mp_popen_forkserver
from multiprocessing import queues as mp_queues
from multiprocessing import reduction as mp_reduction
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from typing import Any, Protocol

import loky
from loky import process_executor
from loky.backend import context as loky_context
from loky.backend import queues as loky_queues
from loky.backend import reduction as loky_reduction

__all__ = [
    "DISPATCH_TABLE",
    "FORKING_REDUCERS",
    "SUPPORTED_LOKY",
    "WARM_PRELOAD",
    "BatchOutcome",
    "BatchPolicy",
    "CallBatch",
    "LokyExecutor",
    "LokyFuture",
    "count_private_memory_only",
    "cpu_count",
    "get_context",
    "note_run_seconds",
    "remote_traceback",
    "send_outcome",
    "warm_context",
]

# The loky versions sharexec is tested with, as pyproject.toml pins them.
SUPPORTED_LOKY = ">=3.7,<3.8"

# Public loky API, offered here so that the executor needs no other door.
cpu_count: Callable[..., int] = loky.cpu_count
get_context: Callable[..., Any] = loky_context.get_context


# ---------------------------------------------------------------------------------------
# The check at import: everything below exists in the installed loky
# ---------------------------------------------------------------------------------------


def _problems() -> list[str]:
    """What this module uses that the installed loky (or Python) lacks, in words."""
    pe = process_executor
    return [
        # LokyExecutor: submit on loky's state, the pool's state, the queue swap, and
        # the quiet recycling.
        *_has(pe, "_WorkItem", "_ThreadWakeup.wakeup", "_global_shutdown"),
        *_has(pe, "_ThreadWakeup.clear", "_RemoteTraceback", "_ExecutorManagerThread"),
        *_has(
            pe,
            "ProcessPoolExecutor._setup_queues",
            "ProcessPoolExecutor._ensure_executor_running",
            "ProcessPoolExecutor._start_executor_manager_thread",
            "ProcessPoolExecutor._adjust_process_count",
        ),
        *_assigns(
            pe,
            "ProcessPoolExecutor",
            "_flags",
            "_pending_work_items",
            "_work_ids",
            "_queue_count",
            "_executor_manager_thread_wakeup",
            "_executor_manager_thread",
            "_max_workers",
            "_processes",
            "_call_queue",
            "_result_queue",
            "_processes",
        ),
        *_assigns(pe, "_ExecutorFlags", "broken", "shutdown", "shutdown_lock"),
        *_assigns(pe, "_WorkItem", "future"),
        *_assigns(
            pe,
            "_ExecutorManagerThread",
            "recycling_warned",
            "call_queue",
            "work_ids_queue",
            "pending_work_items",
            "running_work_items",
            "executor_flags",
        ),
        # Batching: the manager's two steps replaced, the wake-up coalesced, the ids
        # queue replaced (loky only puts and gets without blocking).
        *_uses(pe, "_ExecutorManagerThread._run_loop", "add_call_item_to_queue"),
        *_uses(pe, "_ExecutorManagerThread._run_loop", "process_result_item"),
        *_uses(pe, "_ExecutorManagerThread.wait_result_broken_or_wakeup", "clear"),
        *_uses(pe, "_ExecutorManagerThread._run_loop", "wait_result_broken_or_wakeup"),
        *_assigns(pe, "_ExecutorManagerThread", "thread_wakeup"),
        # Every end of the manager's loop closes the result queue in one step, where
        # what workers handed over for results not read is let go.
        *_uses(pe, "_ExecutorManagerThread._run_loop", "join_executor_internals"),
        *_uses(pe, "_ExecutorManagerThread.terminate_broken", "join_executor_internals"),
        *_uses(pe, "_ExecutorManagerThread.join_executor_internals", "close"),
        *_takes(pe, "_RemoteTraceback.__init__", "self", "tb"),
        *_takes(
            pe,
            "_process_worker",
            "call_queue",
            "result_queue",
            "initializer",
            "initargs",
            "processes_management_lock",
            "timeout",
            "worker_exit_lock",
            "current_depth",
        ),
        *_takes(pe, "_WorkItem.__init__", "self", "future", "fn", "args", "kwargs"),
        *_takes(
            pe,
            "ProcessPoolExecutor._setup_queues",
            "self",
            "job_reducers",
            "result_reducers",
            "queue_size",
        ),
        *_uses(pe, "ProcessPoolExecutor.__init__", "_setup_queues"),
        *_uses(
            pe, "ProcessPoolExecutor._ensure_executor_running", "_start_executor_manager_thread"
        ),
        *_uses(pe, "ProcessPoolExecutor._ensure_executor_running", "_adjust_process_count"),
        *_uses(pe, "_ExecutorManagerThread.process_result_item", "_adjust_process_count"),
        # Workers started on demand: one started as loky's _adjust_process_count does
        # (with _process_worker's arguments, checked above for the batches' streaming).
        *_has(pe, "_process_worker", "_CURRENT_DEPTH"),
        *_assigns(
            pe,
            "ProcessPoolExecutor",
            "_context",
            "_env",
            "_initializer",
            "_initargs",
            "_processes_management_lock",
            "_timeout",
        ),
        *_uses(pe, "_ExecutorManagerThread.process_result_item", "_worker_exit_lock"),
        *_uses(pe, "_ExecutorManagerThread.shutdown_workers", "_worker_exit_lock"),
        *_uses(pe, "_ExecutorManagerThread.wait_result_broken_or_wakeup", "processes"),
        # The warm start method: multiprocessing's forkserver, a server of our own.
        *_has(mp_context, "ForkServerContext", "ForkServerProcess", "set_spawning_popen"),
        *_has(mp_forkserver, "ForkServer.ensure_running", "read_signed", "main"),
        *_has(mp_popen_forkserver, "Popen._launch", "Popen.poll", "Popen.duplicate_for_child"),
        *_has(mp_spawn, "get_preparation_data"),
        *_has(mp_util, "close_fds", "is_abstract_socket_namespace"),
        *_has(mp_connection, "wait"),
        *_assigns(
            mp_forkserver,
            "ForkServer",
            "_forkserver_alive_fd",
            "_forkserver_pid",
            "_forkserver_address",
        ),
        *_assigns(mp_popen_forkserver, "Popen", "_fds"),
        *_takes(mp_forkserver, "ForkServer.connect_to_new_process", "self", "fds"),
        *_takes(mp_forkserver, "ForkServer.set_forkserver_preload", "self", "modules_names"),
        # The queues: loky's, multiprocessing's feeder rebuilt, recycling.
        *_has(pe, "_SafeQueue._on_queue_feeder_error", "_CallItem", "_ResultItem"),
        *_has(pe, "_RecycledWorkerPid", "_SafeQueue.__getstate__", "_SafeQueue.__setstate__"),
        *_has(mp_queues, "_sentinel", "Queue._finalize_close"),
        *_has(loky_queues, "SimpleQueue.put"),
        *_assigns(
            pe,
            "_SafeQueue",
            "_buffer",
            "_notempty",
            "_send_bytes",
            "_wlock",
            "_writer",
            "_reducers",
            "_ignore_epipe",
            "_sem",
            "_thread",
            "_close",
        ),
        *_assigns(pe, "_ResultItem", "exception"),
        *_assigns(loky_queues, "SimpleQueue", "_wlock", "_writer"),
        *_takes(pe, "_SafeQueue._on_queue_feeder_error", "self", "e", "obj"),
        *_takes(mp_queues, "Queue._finalize_close", "buffer", "notempty"),
        *_uses(mp_queues, "Queue.put", "_start_thread"),
        *_uses(pe, "_ExecutorManagerThread.process_result_item", "_RecycledWorkerPid"),
        # Pickling.
        *_has(loky_reduction, "_dispatch_table"),
        *_has(
            futures_base,
            "FINISHED",
            "PENDING",
            "RUNNING",
            "CANCELLED",
            "CANCELLED_AND_NOTIFIED",
            "InvalidStateError",
            "CancelledError",
            "TimeoutError",
            "LOGGER",
        ),
        # wait() and as_completed() take each future's _condition (see LokyFuture).
        *_uses(futures_base, "_AcquireFutures.__enter__", "_condition"),
        *_assigns(
            futures_base,
            "Future",
            "_condition",
            "_state",
            "_result",
            "_exception",
            "_waiters",
            "_done_callbacks",
        ),
        *_has(mp_reduction, "ForkingPickler._extra_reducers"),
        # The worker's leak check (its measure exists only where psutil does).
        *_has(pe, "_USE_PSUTIL"),
        *_uses(pe, "_process_worker", "_get_memory_usage"),  # looked up at each call
        *(
            _takes(pe, "_get_memory_usage", "pid", "force_gc")
            if getattr(pe, "_USE_PSUTIL", False)
            else []
        ),
        # The future.
        *_assigns(loky, "Future", "_condition", "_state", "_result", "_exception"),
    ]


_MISSING = object()


def _lookup(module: types.ModuleType, path: str) -> Any:
    """The object at ``path`` in ``module`` (``"_SafeQueue.get"``), or _MISSING."""
    found: Any = module
    for name in path.split("."):
        found = getattr(found, name, _MISSING)
        if found is _MISSING:
            break
    return found


def _has(module: types.ModuleType, *paths: str) -> list[str]:
    return [
        f"{module.__name__}.{path} is missing"
        for path in paths
        if _lookup(module, path) is _MISSING
    ]


def _assigns(module: types.ModuleType, path: str, *names: str) -> list[str]:
    """Whether the methods of the class at ``path`` assign these instance attributes."""
    cls = _lookup(module, path)
    if not isinstance(cls, type):
        return [f"{module.__name__}.{path} is missing or not a class"]
    wanted = set(names)
    assigned: set[str] = set()
    for code in _codes(cls):
        if not wanted.isdisjoint(code.co_names):  # else it cannot assign any of them
            assigned |= _stored_attributes(code)
    return [
        f"{module.__name__}.{path}: no method sets .{name} any more"
        for name in names
        if name not in assigned
    ]


_STORE_ATTR, _EXTENDED_ARG = dis.opmap["STORE_ATTR"], dis.EXTENDED_ARG


def _stored_attributes(code: types.CodeType) -> set[str]:
    """The attribute names ``code`` assigns (``x.name = ...``): its STORE_ATTR arguments.

    Read from the bytecode itself, two bytes an instruction, an argument wider than a
    byte led by EXTENDED_ARG: the same as ``dis.get_instructions`` gives (a test checks
    it), twenty times faster, which matters in every worker's start.
    """
    names = set()
    raw, extended = code.co_code, 0
    for at in range(0, len(raw), 2):
        opcode, argument = raw[at], raw[at + 1] | extended
        extended = argument << 8 if opcode == _EXTENDED_ARG else 0
        if opcode == _STORE_ATTR:
            names.add(code.co_names[argument])
    return names


def _codes(cls: type) -> Iterator[types.CodeType]:
    """The code of every function defined by ``cls`` and its bases, nested ones too."""
    for klass in cls.__mro__[:-1]:  # not object's
        for value in vars(klass).values():
            function = getattr(value, "__func__", value)  # a static or class method's
            code = getattr(function, "__code__", None)
            if isinstance(code, types.CodeType):
                yield from _nested(code)


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _nested(constant)


def _takes(module: types.ModuleType, path: str, *parameters: str) -> list[str]:
    """Whether the function at ``path`` takes these positional parameters, in order."""
    code = getattr(_lookup(module, path), "__code__", None)
    if not isinstance(code, types.CodeType):
        return [f"{module.__name__}.{path} is missing or not a function"]
    found = code.co_varnames[: code.co_argcount]
    if found == parameters:
        return []
    return [f"{module.__name__}.{path} takes ({', '.join(found)}), not ({', '.join(parameters)})"]


def _uses(module: types.ModuleType, path: str, name: str) -> list[str]:
    """Whether the code of the function at ``path`` still refers to ``name`` (calls a
    method of that name, reads a global of that name...)."""
    code = getattr(_lookup(module, path), "__code__", None)
    if not isinstance(code, types.CodeType):
        return [f"{module.__name__}.{path} is missing or not a function"]
    if any(name in nested.co_names for nested in _nested(code)):
        return []
    return [f"{module.__name__}.{path} no longer uses {name}"]


def _check() -> None:
    problems = list(dict.fromkeys(_problems()))  # in order, once each
    if problems:
        version = getattr(loky, "__version__", "(unknown version)")
        raise ImportError(
            f"sharexec supports loky {SUPPORTED_LOKY}, and the installed loky {version} "
            "differs where sharexec relies on loky's internals: "
            + "; ".join(problems)
            + f". Install a supported version: pip install 'loky{SUPPORTED_LOKY}'"
        )


_check()


# ---------------------------------------------------------------------------------------
# The executor: submit on loky's state, the queue swap, quiet recycling
# ---------------------------------------------------------------------------------------

_NO_KEYWORDS: dict[str, Any] = {}  # the keywords of every call queued: never changed


class LokyExecutor(loky.ProcessPoolExecutor):  # type: ignore[misc]
    """loky's executor, with what sharexec needs of its internals under plain names.

    ``max_tasks_per_child`` recycles each worker after that many tasks (loky's constructor
    has no such argument); ``batching``: the policy of calls sent together;
    ``results_closed``: called by the manager thread once it reads no more results (shut
    down, broken or terminated), holding no reference to the executor. The other
    arguments are loky's. The call and result queues are this module's subclasses of
    loky's from the start.
    """

    _queue_count: int  # loky's: the work id of the next call, e.g. 17

    def __init__(
        self,
        *,
        max_workers: int | None,
        context: Any,
        initializer: Callable[..., object] | None,
        initargs: tuple[Any, ...],
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
        self._executor_manager_thread_wakeup.__class__ = _CoalescedWakeup
        self._work_ids = _WorkIds()
        # Whether the calls not started are cancelled (shutdown(cancel_futures=True)),
        # those a worker hands back later included (read by the manager thread).
        self._flags.cancel_pending = False

    def _enqueue(self, future: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
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

    def _pool_processes(self) -> list[Any]:
        """The worker processes alive now (a copy: shutting down empties loky's table)."""
        processes = self._processes
        return list(processes.values()) if processes else []

    def _pending_futures(self) -> list[Future[Any]]:
        """The futures of the calls not done yet."""
        return [item.future for item in list(self._pending_work_items.values())]

    def _cancel_pending(self) -> None:
        """Cancel the calls not started (``shutdown(cancel_futures=True)``): those
        pending now, and those a worker hands back from a batch from now on."""
        self._flags.cancel_pending = True  # first: a call handed back meanwhile is seen
        for future in self._pending_futures():
            future.cancel()

    def _setup_queues(
        self, job_reducers: Any, result_reducers: Any, queue_size: int | None = None
    ) -> None:
        super()._setup_queues(job_reducers, result_reducers, queue_size)
        # Same queues, of our classes. Set before anything is put on them: the call
        # queue's feeder thread starts at the first put.
        self._call_queue.__class__ = _CallQueue
        self._call_queue.max_tasks = self._max_tasks_per_child
        self._result_queue.__class__ = _ResultQueue

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
    held: list[Any] = []
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


# ---------------------------------------------------------------------------------------
# Batching: several queued calls in one message, their outcomes back together
# ---------------------------------------------------------------------------------------


class BatchPolicy(Protocol):
    """What the manager thread asks before it sends calls together (``_batching``'s).

    Called from the manager thread only. ``fn`` and ``args`` are those of a queued call
    as the executor queued it (``_enqueue``).
    """

    budget: float  # seconds of estimated run time one batch may hold

    def cost(self, fn: Any, args: tuple[Any, ...]) -> float | None:
        """The call's estimated run time in seconds; None: it goes alone."""

    def limit(self, queued: int) -> int:
        """How many calls one batch may take when ``queued`` calls wait."""

    def measured(self, fn: Any, args: tuple[Any, ...], seconds: float) -> None:
        """The call ran for ``seconds`` in a worker."""

    def batched(self, calls: int) -> None:
        """A batch of ``calls`` calls was queued (for statistics)."""

    def handed_back(self, fn: Any, args: tuple[Any, ...]) -> None:
        """A call of a batch was handed back unstarted: it will be sent again."""

    def run_batch(self, batch: Any) -> Any:
        """Runs in the worker: what a :class:`CallBatch` rebuilt as, to a
        :class:`BatchOutcome`."""

    def reduce_batch(self, batch: CallBatch) -> Any:
        """The ``__reduce__`` value of ``batch``: how its calls travel."""


class AlreadyDone(RuntimeError):
    """Raised by pickling a call whose outcome was delivered while it waited in the
    call queue's buffer (its future failed when a worker died, say): :func:`_feed`
    drops such a call, and frees its slot, instead of failing its future again."""


class CallBatch:
    """Queued calls sent in one message: their work ids and ``(fn, args)``, in order.

    Pickled by ``policy.reduce_batch`` (one pickle for the calls of plain arguments).
    If that fails, the feeder thread sends each call alone, so only a call that cannot
    be pickled fails (:func:`_feed`).
    """

    __slots__ = ("calls", "checked", "ids", "policy")

    def __init__(self, ids: list[int], calls: list[tuple[Any, tuple[Any, ...]]], policy: Any):
        self.ids = ids
        self.calls = calls
        self.policy = policy
        self.checked = False  # made of calls that each pickled alone (see _feed)

    def __reduce__(self) -> Any:
        return self.policy.reduce_batch(self)


class BatchOutcome(list):  # type: ignore[type-arg]
    """What a worker sends back for a batch: ``(work_id, outcome, seconds)`` per call, in
    order; ``outcome`` is what the call sent alone would send as its result (a task's
    exception too travels as such a value, which the future raises: ``_worker.run``).
    Pickled by plain pickle: every outcome is made to pickle. ``returned``: the work ids
    of the calls the worker hands back, not started (the parent queues them again)."""

    returned: Sequence[int] = ()

    def add(self, work_id: int, outcome: Any, seconds: float) -> None:
        self.append((work_id, outcome, seconds))


def remote_traceback(text: str) -> BaseException:
    """The ``__cause__`` loky gives a task's exception: its traceback in the worker,
    ``text``, shown when the exception is printed."""
    cause: BaseException = process_executor._RemoteTraceback(text)
    return cause


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


class _CoalescedWakeup(process_executor._ThreadWakeup):  # type: ignore[misc]
    """loky's wake-up of the manager thread, written for a call only when none is
    pending.

    loky writes a byte to a pipe at every submit: a system call, and a thread switch
    to the manager, per call. Here a submit (``wakeup_for_call``) writes only if the
    manager has not been woken since it last cleared the pipe. Safe because the manager
    clears *before* it next looks at the queued calls (``wait_result_broken_or_wakeup``
    ends its step with ``clear``), and the flag is reset after the pipe is drained: any
    call queued before the reset is seen by that look, any wake-up after it writes
    again. loky's own wake-ups (``wakeup``: shutdown, a broken pool, new workers to
    watch) always write: they are rare, and one that a stale flag swallowed would leave
    the manager asleep while ``shutdown`` waits for it.
    """

    _pending = False
    # Whether the manager thread is awake and will look at the queued calls before it
    # next waits (set by _Manager): then a call queued needs no wake-up at all.
    awake = False

    def wakeup_for_call(self) -> None:
        """A call was queued: wake the manager unless it is awake or already woken."""
        if self.awake or self._pending:
            return
        self._pending = True
        try:
            self.wakeup()
        except BaseException:
            # Not written (Ctrl-C in the submitting thread, say): a flag left set would
            # swallow every later call's wake-up.
            self._pending = False
            raise

    def clear(self) -> None:
        super().clear()
        self._pending = False


class _WorkIds:
    """The queue of work ids, a deque: loky's is a ``queue.Queue`` (two locks and a
    condition per call) read only by its manager thread, never blocking."""

    def __init__(self) -> None:
        self._ids: deque[int] = deque()

    def put(self, work_id: int) -> None:
        self._ids.append(work_id)

    def put_back(self, ids: list[int]) -> None:
        """Queue again calls taken before (``ids``, in order): ahead of the others, in
        the order they were queued first. Called by the manager thread, the only one
        that takes ids (a submit only appends), so the front of the queue is its own:
        the ids put back before (smaller than any never taken) are merged with these."""
        queued = self._ids
        last = ids[-1]
        ahead = []
        while queued and queued[0] < last:
            ahead.append(queued.popleft())
        if ahead:
            ids = sorted(ids + ahead)
        queued.extendleft(reversed(ids))

    def get(self, block: bool = True, timeout: float | None = None) -> int:
        if block:  # pragma: no cover - loky never blocks on it
            raise NotImplementedError("work ids are taken without blocking")
        try:
            return self._ids.popleft()
        except IndexError:
            raise queue.Empty from None

    def get_nowait(self) -> int:
        return self.get(block=False)

    def qsize(self) -> int:
        return len(self._ids)

    def empty(self) -> bool:
        return not self._ids


class _Manager(process_executor._ExecutorManagerThread):  # type: ignore[misc]
    """loky's manager thread, which sends queued calls of short functions together.

    ``add_call_item_to_queue`` fills free places of the call queue as loky's does, one
    call item per place; a call whose function the policy measured short starts a
    batch, which takes the calls queued after it while they are short too, up to the
    policy's budget of run time and its limit on calls. Each call of a batch is marked
    running as it joins (a cancelled one is dropped, as loky drops it), and is listed
    in loky's tables under its own work id: a dead worker fails each with
    ``BrokenProcessPool``, as it would fail them alone. ``process_result_item``
    completes each call of a batch's outcome, in order, and feeds every call's
    measured run time to the policy. The calls a worker hands back unstarted (its batch
    ran past its bound) are pending again and queued ahead of the others
    (``_queue_again``): loky's tables count them pending, not running, and a dead
    worker fails them as any pending call.
    """

    policy: BatchPolicy | None  # None: every call goes alone
    carry: int | None  # a work id taken but not sent: it goes first in the next step
    results_closed: Callable[[], None] | None  # told once no more result is read

    def join_executor_internals(self) -> None:
        # The last step of every end (shut down, broken, the executor collected, the
        # interpreter exiting): the result queue is closed, and whatever a worker still
        # sent will never be read.
        try:
            super().join_executor_internals()
        finally:
            if self.results_closed is not None:
                self.results_closed()

    def wait_result_broken_or_wakeup(self) -> Any:
        # While this thread is awake, a submit does not write its wake-up (a system call
        # and a thread switch per call): this thread looks at the queue before it waits.
        # Marked asleep first, then that look: a call queued before the mark is seen
        # here, one queued after it writes.
        wakeup = self.thread_wakeup
        wakeup.awake = False
        if self.work_ids_queue.qsize() and not self.call_queue.full():
            wakeup.wakeup_for_call()
        try:
            return super().wait_result_broken_or_wakeup()
        finally:
            wakeup.awake = True

    def add_call_item_to_queue(self) -> None:
        pending = self.pending_work_items
        while not self.call_queue.full():
            work_id = self.carry
            if work_id is None:
                try:
                    work_id = self.work_ids_queue.get(block=False)
                except queue.Empty:
                    return
            self.carry = None
            work_item = pending.get(work_id)
            if work_item is None:
                continue  # failed meanwhile (shut down with kill_workers)
            if not work_item.future.set_running_or_notify_cancel():
                del pending[work_id]
                continue
            members = self._gather(work_id, work_item)
            if members is None:
                self.running_work_items.append(work_id)
                call = process_executor._CallItem(
                    work_id, work_item.fn, work_item.args, work_item.kwargs
                )
            else:
                ids = [work_id, *(i for i, _ in members)]
                policy = self.policy
                assert policy is not None  # _gather batches only with a policy
                calls = [(work_item.fn, work_item.args)]
                calls += [(item.fn, item.args) for _, item in members]
                self.running_work_items.extend(ids)
                batch = CallBatch(ids, calls, policy)
                call = process_executor._CallItem(
                    work_id, policy.run_batch, (batch,), _NO_KEYWORDS
                )
                policy.batched(len(ids))
            self.call_queue.put(call, block=True)

    def _gather(self, work_id: int, work_item: Any) -> list[tuple[int, Any]] | None:
        """The calls queued after ``work_item`` that go with it (marked running), or
        None if it goes alone."""
        policy = self.policy
        if policy is None:
            return None
        cost = policy.cost(work_item.fn, work_item.args)
        if cost is None:
            return None
        limit = policy.limit(self.work_ids_queue.qsize() + 1) - 1
        if limit <= 0:
            return None
        budget = policy.budget - cost
        pending = self.pending_work_items
        members: list[tuple[int, Any]] = []
        while len(members) < limit:
            try:
                next_id = self.work_ids_queue.get(block=False)
            except queue.Empty:
                break
            item = pending.get(next_id)
            if item is None:
                continue
            cost = policy.cost(item.fn, item.args)
            if cost is None or cost > budget:
                self.carry = next_id  # goes first next time, alone or leading a batch
                break
            if not item.future.set_running_or_notify_cancel():
                del pending[next_id]
                continue
            members.append((next_id, item))
            budget -= cost
        return members or None

    def process_result_item(self, result_item: Any) -> None:
        if type(result_item) is not process_executor._ResultItem:
            super().process_result_item(result_item)  # a worker's pid: it left
            return
        outcome = result_item.result
        if type(outcome) is BatchOutcome:
            self._complete(outcome)
            return
        seconds = getattr(result_item, "seconds", None)
        if seconds is not None and self.policy is not None:
            work_item = self.pending_work_items.get(result_item.work_id)
            if work_item is not None:
                self.policy.measured(work_item.fn, work_item.args, seconds)
        super().process_result_item(result_item)

    def _complete(self, outcome: BatchOutcome) -> None:
        """Complete each call of a batch, in order, with its own result or exception;
        queue again the calls its worker handed back."""
        pending = self.pending_work_items
        assert self.policy is not None  # a batch was sent
        measured = self.policy.measured
        done: list[int] = []
        for work_id, value, seconds in outcome:
            work_item = pending.pop(work_id, None)
            if work_item is None:
                continue  # failed meanwhile (a dead worker broke the pool)
            measured(work_item.fn, work_item.args, seconds)
            work_item.future.set_result(value)  # the future raises a task's exception
            done.append(work_id)
            del work_item
        outcome.clear()
        self._not_running(done)
        if outcome.returned:
            self._queue_again(outcome.returned)

    def _queue_again(self, ids: Sequence[int]) -> None:
        """Calls a worker handed back, not started: pending again (they keep their work
        ids and futures, and may be cancelled), queued ahead of the later calls, in
        their order. If the pool is shutting down with its pending calls cancelled, they
        are cancelled too, as they would have been had they been pending then."""
        pending = self.pending_work_items
        back = [work_id for work_id in ids if work_id in pending]  # not failed meanwhile
        self._not_running(back)
        if not back:
            return
        policy = self.policy
        assert policy is not None  # a batch was sent
        for work_id in back:
            work_item = pending[work_id]
            policy.handed_back(work_item.fn, work_item.args)
            work_item.future.set_pending_again()
            del work_item
        if self.carry is not None:  # taken from the queue's front: it goes back there
            back.append(self.carry)
            back.sort()
            self.carry = None
        self.work_ids_queue.put_back(back)
        if self.executor_flags.cancel_pending:  # read after they became pending
            for work_id in back:
                work_item = pending.get(work_id)
                if work_item is not None:
                    work_item.future.cancel()

    def _not_running(self, ids: list[int]) -> None:
        """Take ``ids`` out of loky's list of running ids."""
        if not ids:
            return
        # All at once (a remove per call would move the rest of the list each time), in
        # place: loky's queue holds the same list. A batch's ids were added together,
        # so they are found together, unless some failed alone in the feeder thread
        # meanwhile.
        running = self.running_work_items
        try:
            at = running.index(ids[0])
        except ValueError:
            at = -1
        if at >= 0 and running[at : at + len(ids)] == ids:
            del running[at : at + len(ids)]
        else:
            gone = set(ids)
            running[:] = [work_id for work_id in running if work_id not in gone]


# ---------------------------------------------------------------------------------------
# The default start method: forks of a warm server
# ---------------------------------------------------------------------------------------

# What sharexec's server imports once, so that every worker forked from it starts warm:
# the worker's side (loky's worker loop, cloudpickle, our queues) and the backward pass,
# hence NumPy. Names only: this module imports none of them.
WARM_PRELOAD = ("sharexec._worker", "sharexec._reduction")


class _WarmServer:
    """sharexec's own fork server: multiprocessing's ``ForkServer``, a second instance.

    Not the module's global one, which belongs to the user (``mp_context="forkserver"``
    and ``set_forkserver_preload`` keep their meaning). Started by the first warm
    process, as multiprocessing starts its own (a fresh interpreter, fork + exec, so a
    parent's threads are no hazard); its only thread is the main one (NumPy's OpenBLAS
    joins its pool at fork), so each worker is a fork of a single-threaded process. It
    exits when the last process holding its "alive" pipe (this one, its workers) has.

    A server that dies (killed, out of memory) is started again, as the sweeper is:
    multiprocessing starts another when it finds its server exited, and a fork request
    that fails on the way (refused, or cut before the child's pid came back: the server
    is dying) stops and reaps it, then asks a new one, once. Requests take turns (the
    server forks one at a time anyway), so one restart serves all who noticed and no
    request sends the pipe of a server another one just let go. Its workers live on:
    none depends on it but for its exit status. The socket file of a server gone is
    removed.
    """

    def __init__(self) -> None:
        self.server = mp_forkserver.ForkServer()
        self.server.set_forkserver_preload(list(WARM_PRELOAD))
        self.sockets: set[str] = set()  # the socket files of our servers, e.g. {"/tmp/…"}
        self.lock = threading.Lock()  # one request (or start) at a time

    def start(self) -> None:
        """Start the server now if it is not running: it imports while we go on."""
        with self.lock:
            self._start()

    def fork(self, fds: list[int]) -> tuple[int, int, int]:
        """Ask the server for a child that inherits ``fds``.

        Returns the child's pid, the read end of the pipe on which the server writes
        its exit status, and the write end of the pipe the child reads its process
        object from (nothing written yet: a child whose pid never came back reads
        nothing, and exits).
        """
        with self.lock:
            for last in (False, True):
                used = self._start()
                try:
                    status, write = self.server.connect_to_new_process(fds)
                except (ConnectionError, FileNotFoundError, ChildProcessError):
                    if last:
                        raise
                    self._forget(used)
                    continue
                try:
                    pid: int = mp_forkserver.read_signed(status)
                except (EOFError, OSError):
                    os.close(status)
                    os.close(write)
                    if last:
                        raise
                    self._forget(used)
                    continue
                return pid, status, write
        raise AssertionError("unreachable")

    def _start(self) -> int:
        """The server's pid, started if it is not running."""
        server: Any = self.server
        try:
            server.ensure_running()
        except ChildProcessError:  # it exited and someone reaped it (os.wait(), SIGCHLD)
            self._forget(server._forkserver_pid, signal_it=False)
            server.ensure_running()
        address = server._forkserver_address
        if address not in self.sockets:  # a new server: the others are gone
            for gone in self.sockets:
                with contextlib.suppress(OSError):
                    os.unlink(gone)
            self.sockets.clear()
            if not mp_util.is_abstract_socket_namespace(address):
                self.sockets.add(address)
        pid: int = server._forkserver_pid
        return pid

    def _forget(self, pid: int, signal_it: bool = True) -> None:
        """Stop and reap the server ``pid``, so that the next request starts another
        (as multiprocessing does for one that exited); without ``signal_it``, only
        forget it (another wait reaped it: the pid may be another process's now)."""
        server: Any = self.server
        if signal_it:
            try:  # still our child (not reaped by another wait), so the pid is its
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                pass
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # if it is not dead yet: no use any more
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_address = None
        server._forkserver_alive_fd = None
        server._forkserver_pid = None

    def after_fork_in_child(self) -> None:
        # A forked child of this process cannot wait for its parent's server: it starts
        # its own, if it ever needs one. Its copy of the "alive" pipe goes at once; the
        # parent's socket files are the parent's to remove.
        alive: int | None = getattr(self.server, "_forkserver_alive_fd", None)
        self.server = mp_forkserver.ForkServer()
        self.server.set_forkserver_preload(list(WARM_PRELOAD))
        self.sockets = set()
        self.lock = threading.Lock()
        if alive is not None:
            with contextlib.suppress(OSError):
                os.close(alive)


_warm_server = _WarmServer()
os.register_at_fork(after_in_child=_warm_server.after_fork_in_child)

# Signals every Python interpreter ignores from its start (so that a write to a closed
# pipe raises, a large file is an error): a worker ignores them as one started afresh.
_IGNORED_BY_PYTHON = frozenset(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name)
)


def _status_field(status: str, name: str) -> int:
    """A number of ``/proc/self/status``: the ``Umask`` (octal) or ``SigIgn``
    (hexadecimal) line's."""
    at = status.find(f"\n{name}:")
    if at < 0:
        raise LookupError(f"no {name} in /proc/self/status")
    value = status[at + len(name) + 2 : status.find("\n", at + 1)]
    return int(value, 8 if name == "Umask" else 16)


_VALID_SIGNALS = frozenset(int(number) for number in signal.valid_signals())


def _signals(mask: int) -> set[int]:
    """The signals of a mask of /proc (bit n-1 for signal n) that Python can set."""
    return {n for n in _VALID_SIGNALS if mask >> (n - 1) & 1}


class _ParentState:
    """What a worker of the warm server takes from its parent as it is now, not as it
    was when the server started: the environment, the umask, the ignored signals and
    the starting thread's signal mask (the working directory and ``sys.path`` travel
    in multiprocessing's own preparation data).

    Read in the parent for each fork request (a read of ``/proc/self/status`` and a
    copy of the environment: 0.2 ms on a busy machine, where a worker's start takes
    25 ms or more), and put first in the request's preparation data: it pickles as a
    call of :func:`_take_parent_state`, so the child applies it while it unpickles that
    data, before anything else of the request is loaded and before
    ``multiprocessing.spawn.prepare`` runs.
    """

    def __init__(self) -> None:
        with open("/proc/self/status") as f:
            status = f.read()
        self.environ = dict(os.environb)
        self.umask = _status_field(status, "Umask")
        self.ignored = _signals(_status_field(status, "SigIgn"))
        self.blocked = {int(number) for number in signal.pthread_sigmask(signal.SIG_BLOCK, ())}

    def __reduce__(self) -> tuple[Any, ...]:
        return _take_parent_state, (self.environ, self.umask, self.ignored, self.blocked)


def _take_parent_state(
    environ: dict[bytes, bytes], umask: int, ignored: set[int], blocked: set[int]
) -> None:
    """In a warm worker: become the parent's environment, umask and signal state.

    A signal the parent ignores is ignored; one it does not ignore but the server did
    (it started with the parent of that time) gets back a new interpreter's
    disposition: Python's ``KeyboardInterrupt`` for ``SIGINT``, ignored for ``SIGPIPE``
    and ``SIGXFSZ``, the default for the rest. These are what a spawned worker gets.
    """
    here = os.environb
    for name in [name for name in here if name not in environ]:
        del here[name]
    for name, value in environ.items():
        if here.get(name) != value:
            here[name] = value
    os.umask(umask)
    with open("/proc/self/status") as f:
        ignored_here = _signals(_status_field(f.read(), "SigIgn"))
    for number in ignored - ignored_here:
        signal.signal(number, signal.SIG_IGN)
    for number in ignored_here - ignored - _IGNORED_BY_PYTHON:
        default = signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
        signal.signal(number, default)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _WarmPopen(mp_popen_forkserver.Popen):
    """multiprocessing's forkserver ``Popen``, asking sharexec's server for the fork.

    The child is told nothing of the parent's main module (as loky's start method):
    its code reaches workers inside pickles, so no script is imported again, and a
    script needs no ``if __name__ == "__main__"`` guard for it. It is told the parent's
    state of now (:class:`_ParentState`), first.

    Its sentinel is a pipe the child holds the write end of (as under ``fork`` and
    ``spawn``), not the server's status pipe: the parent sees a worker end when the
    worker does, and a server that dies takes no worker with it. The exit status still
    comes from the server, which reaps its children; 255 if the server is gone.
    """

    _status: int | None = None  # the server's pipe: the child's pid, then its exit status

    def _launch(self, process_obj: Any) -> None:
        data = mp_spawn.get_preparation_data(process_obj._name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        data = {"sharexec_parent_state": _ParentState(), **data}
        buffer = io.BytesIO()
        mp_context.set_spawning_popen(self)  # fds the process carries go with the request
        try:
            mp_reduction.dump(data, buffer)
            mp_reduction.dump(process_obj, buffer)
        finally:
            mp_context.set_spawning_popen(None)
        fds: list[int] = self._fds  # type: ignore[attr-defined]  # duplicate_for_child's
        sentinel, held = os.pipe()
        try:
            self.pid, self._status, write = _warm_server.fork([*fds, held])
        except BaseException:
            os.close(sentinel)
            raise
        finally:
            os.close(held)
        self.sentinel = sentinel
        # The child takes the closing of this pipe's write end for its parent's death:
        # one copy stays open for as long as this object lives.
        kept = os.dup(write)
        close_fds = mp_util.close_fds  # type: ignore[attr-defined]
        self.finalizer = mp_util.Finalize(self, close_fds, (kept, sentinel, self._status))
        with open(write, "wb", closefd=True) as pipe:
            pipe.write(buffer.getbuffer())

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None:
            timeout = 0 if flag == os.WNOHANG else None
            if not mp_connection.wait([self.sentinel], timeout):
                return None
            # The child is gone: the server writes its status once it has reaped it.
            code = 255
            if self._status is not None and mp_connection.wait([self._status], _REAPED_WITHIN):
                with contextlib.suppress(OSError, EOFError):
                    code = mp_forkserver.read_signed(self._status)
            self.returncode = code
        return self.returncode


# How long a worker's exit status may take to come from a live server after the worker
# is gone (it reaps at once: this bounds a stopped server's delay, then 255).
_REAPED_WITHIN = 5.0


class _WarmProcess(mp_context.ForkServerProcess):
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: Any) -> _WarmPopen:
        return _WarmPopen(process_obj)


class _WarmContext(mp_context.ForkServerContext):
    """A forkserver context whose processes are forks of sharexec's warm server."""

    Process = _WarmProcess

    def start_server(self) -> None:
        """Start the server (if it is not running), so that it warms up meanwhile."""
        _warm_server.start()


_warm = _WarmContext()


def warm_context() -> Any:
    """sharexec's default start method: forks of a server that imported
    :data:`WARM_PRELOAD` (a ``forkserver`` context; see :class:`_WarmServer`)."""
    return _warm


# ---------------------------------------------------------------------------------------
# The queues: plain-pickle envelopes, worker recycling
# ---------------------------------------------------------------------------------------

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
        self._close = mp_util.Finalize(
            self,
            mp_queues.Queue._finalize_close,  # type: ignore[attr-defined]
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


def _without_failures(item: Any, onerror: Callable[[BaseException, Any], None]) -> Any:
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

    def put(self, obj: Any) -> None:
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


# ---------------------------------------------------------------------------------------
# Pickling: loky's reducers
# ---------------------------------------------------------------------------------------

# The reducers loky's pickler adds to cloudpickle's (bound methods by reference, sockets
# and multiprocessing connections through the process being spawned, partials), by exact
# type, e.g. {functools.partial: <function _reduce_partial>, ...}. loky's own table, not a
# copy: what loky.backend.reduction.register adds later is in it too. Read it only.
DISPATCH_TABLE: dict[Any, Any] = loky_reduction._dispatch_table


class _ForkingReducers(MutableMapping[Any, Any]):
    """The reducers registered with ``ForkingPickler.register``, by exact type, looked up
    in ``ForkingPickler._extra_reducers`` at each access (never a copy), e.g.
    ``{torch.Tensor: <function reduce_tensor>, socket.socket: <function _reduce_socket>}``.

    Read only: a library registers through ``ForkingPickler.register``, never here.
    """

    def __getitem__(self, kind: Any) -> Any:
        return _registrations()[kind]

    def __iter__(self) -> Iterator[Any]:
        return iter(dict(_registrations()))

    def __len__(self) -> int:
        return len(_registrations())

    def __setitem__(self, kind: Any, reduce: Any) -> None:
        raise TypeError("register with multiprocessing.reduction.ForkingPickler.register")

    def __delitem__(self, kind: Any) -> None:
        raise TypeError("ForkingPickler's registrations are multiprocessing's")


def _registrations() -> dict[Any, Any]:
    """ForkingPickler's table of registrations, as it is now."""
    table: dict[Any, Any] = mp_reduction.ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    return table


# What the standard library's pickler (multiprocessing's ForkingPickler) adds to copyreg's
# reducers: multiprocessing's own (connections, sockets, method descriptors, partials)
# and every library's (torch's tensors and storages...), live.
FORKING_REDUCERS: MutableMapping[Any, Any] = _ForkingReducers()


# ---------------------------------------------------------------------------------------
# In a worker: loky's leak check counts private memory only
# ---------------------------------------------------------------------------------------


def count_private_memory_only() -> None:
    """Make loky's leak check in this worker count private memory only.

    With psutil installed, a loky worker measures its resident memory after its first
    task and restarts itself (with a warning about a memory leak) once it has grown by
    300 MB. Pages of shared memory this worker merely maps count in that figure: a
    worker reading a large shared array kept in a global by its initializer was restarted
    for it, and its initializer run again. Here the measure leaves shared pages out
    (psutil's ``shared``: resident pages backed by a file or by shared memory), so a
    real leak of private memory still restarts the worker. Only this process, a worker
    of ours, is changed: loky's ``process_executor._get_memory_usage`` is replaced in it.
    """
    if process_executor._USE_PSUTIL:
        process_executor._get_memory_usage = _private_memory


def _private_memory(pid: int, force_gc: bool = False) -> int:
    """Resident memory of ``pid`` that is its own: what loky's leak check should count."""
    psutil = importlib.import_module("psutil")  # present: loky found it

    if force_gc:
        gc.collect()
    info = psutil.Process(pid).memory_info()
    return int(info.rss - getattr(info, "shared", 0))


# ---------------------------------------------------------------------------------------
# The future
# ---------------------------------------------------------------------------------------


_FINISHED = futures_base.FINISHED  # the state of a future with its outcome
# The states of a future that is done (cancelled, or with its outcome).
_CANCELLED = frozenset({futures_base.CANCELLED, futures_base.CANCELLED_AND_NOTIFIED})
_DONE = _CANCELLED | {_FINISHED}


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

    def wake(self, future: Any = None) -> None:
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
      own if there is one (``_hold``).
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
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters_made: list[Any] | None = None
        self._callbacks_made: list[Any] | None = None

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

    def _hold(self) -> threading.RLock:
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
    def _waiters(self) -> list[Any]:
        if self._waiters_made is None:
            self._waiters_made = []
        return self._waiters_made

    @property
    def _done_callbacks(self) -> list[Any]:
        if self._callbacks_made is None:
            self._callbacks_made = []
        return self._callbacks_made

    def _await_done(self, timeout: float | None) -> None:
        """Wait until this future is done (cancelled, or with its outcome), or ``timeout``."""
        if self._state in _DONE:
            return
        lock = self._hold()
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
            lock = self._hold()
            try:
                self._waiters.remove(awaited)
            finally:
                lock.release()

    def result(self, timeout: float | None = None) -> Any:
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

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        lock = self._hold()
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
        lock = self._hold()
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
        lock = self._hold()
        try:
            if self._state == futures_base.RUNNING:
                self._state = futures_base.PENDING
        finally:
            lock.release()

    def set_running_or_notify_cancel(self) -> bool:
        lock = self._hold()
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

    def set_result(self, result: Any) -> None:
        self._finish(result, None, "add_result")

    def set_exception(self, exception: BaseException | None) -> None:
        self._finish(None, exception, "add_exception")

    def _finish(self, result: Any, exception: BaseException | None, tell: str) -> None:
        """Done with its outcome: the waiters told (``tell``, their method), then the
        callbacks called."""
        lock = self._hold()
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
