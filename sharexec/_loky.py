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
  ``_pending_futures()``; the workers it starts, reported to ``_workers_started(pids)``
  (loky's ``_adjust_process_count`` and ``_processes``); and the two queue subclasses
  below, swapped in as loky creates its queues.
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
* :class:`LokyFuture`, the base of sharexec's future: loky's, with the lock that guards
  its state (``concurrent.futures.Future._condition``) named ``_state_lock``.

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

import dis
import errno
import gc
import importlib
import pickle
import threading
import types
from collections import deque
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import Future
from multiprocessing import queues as mp_queues
from multiprocessing import reduction as mp_reduction
from multiprocessing import util as mp_util
from typing import Any

import loky
from loky import process_executor
from loky.backend import context as loky_context
from loky.backend import queues as loky_queues
from loky.backend import reduction as loky_reduction

__all__ = [
    "DISPATCH_TABLE",
    "FORKING_REDUCERS",
    "SUPPORTED_LOKY",
    "LokyExecutor",
    "LokyFuture",
    "count_private_memory_only",
    "cpu_count",
    "get_context",
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
        *_assigns(pe, "_ExecutorManagerThread", "recycling_warned"),
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
        *_assigns(loky, "Future", "_condition"),
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
    has no such argument); the other arguments are loky's. The call and result queues are
    this module's subclasses of loky's from the start.
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
    ) -> None:
        self._max_tasks_per_child = max_tasks_per_child  # read by _setup_queues
        super().__init__(
            max_workers=max_workers,
            context=context,
            initializer=initializer,
            initargs=initargs,
            env=env,
        )

    def _enqueue(self, future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
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
            self._executor_manager_thread_wakeup.wakeup()  # it queues the call for a worker
            self._ensure_executor_running()

    @property
    def _pool_broken(self) -> BaseException | None:
        """The error that broke the pool (a worker died...), or None while it works."""
        broken: BaseException | None = self._flags.broken
        return broken

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
        """The futures of the calls not done yet, e.g. for ``shutdown(cancel_futures=True)``."""
        return [item.future for item in list(self._pending_work_items.values())]

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
        # loky starts workers here (at a submit, or in its manager thread to replace
        # recycled ones), and lists them in _processes by pid.
        before = set(self._processes)
        super()._adjust_process_count()
        started = [pid for pid in self._processes if pid not in before]
        if started:
            self._workers_started(started)

    def _workers_started(self, pids: list[int]) -> None:
        """Hook: loky started these worker processes."""

    def _start_executor_manager_thread(self) -> None:
        super()._start_executor_manager_thread()
        if self._max_tasks_per_child is not None:
            # Recycling is asked for: loky's warning about a recycled worker (meant for
            # its memory-leak recycling) would be noise. Set before any worker can have
            # finished its tasks, hence before the manager thread can read it.
            self._executor_manager_thread.recycling_warned = True


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
            queue_sem.release()  # the item never went: its slot is free again
            onerror(exc, item)  # fails that item's future (loky's _SafeQueue)
        del item


class _ResultQueue(loky_queues.SimpleQueue):  # type: ignore[misc]
    """loky's result queue: a worker's results in a plain envelope, its exit marked.

    A worker leaving because of ``max_tasks_per_child`` sends its pid marked as loky's
    recycled worker: the executor replaces it without a warning.
    """

    def put(self, obj: Any) -> None:
        if type(obj) is process_executor._ResultItem and obj.exception is None:
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


class LokyFuture(loky.Future):  # type: ignore[misc]
    """loky's future (the standard library's, whose callbacks log what they raise), with
    the lock that guards its state named for subclasses."""

    @property
    def _state_lock(self) -> threading.Condition:
        """The condition that guards the future's state (``Future._condition``)."""
        lock: threading.Condition = self._condition
        return lock
