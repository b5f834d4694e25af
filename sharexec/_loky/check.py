"""The check at import: everything sharexec uses of loky's (and multiprocessing's and
concurrent.futures') internals exists in the installed versions.

Replaces nothing of loky 3.7: loky has no such check (a loky that moved an internal would
fail later, in a feeder thread, with an ``AttributeError``). :func:`raise_if_unsupported`
lists what is missing, in words (by lookup; by the instance attributes the methods of a
class assign; by the positional parameters of what is called or replaced; by the names
the code of loky's users of what is overridden still refers to), and raises one
:class:`ImportError` that names the installed loky and :data:`SUPPORTED_LOKY`.
"""

from __future__ import annotations

import dis
import types
from collections.abc import Iterator
from concurrent.futures import _base as futures_base
from concurrent.futures import process as futures_process
from multiprocessing import connection as mp_connection
from multiprocessing import context as mp_context
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import popen_forkserver as mp_popen_forkserver
from multiprocessing import process as mp_process
from multiprocessing import queues as mp_queues
from multiprocessing import reduction as mp_reduction
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util

import loky
from loky import process_executor
from loky.backend import queues as loky_queues
from loky.backend import reduction as loky_reduction

# The loky versions sharexec is tested with, as pyproject.toml pins them.
SUPPORTED_LOKY = ">=3.7,<3.8"


def _problems() -> list[str]:
    """What this module uses that the installed loky (or Python) lacks, in words."""
    pe = process_executor
    return [
        # LokyExecutor: submit on loky's state, the pool's state, the queue swap, and
        # the quiet recycling.
        *_has(pe, "_WorkItem", "_ThreadWakeup.wakeup", "_global_shutdown"),
        *_has(pe, "_ThreadWakeup.clear", "_ExecutorManagerThread"),
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
        # remote_traceback: the standard library's, as its executor gives it.
        *_takes(futures_process, "_RemoteTraceback.__init__", "self", "tb"),
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
        # multiprocessing's private folder, made in /dev/shm where tempfile finds none.
        *_has(mp_util, "get_temp_dir", "Finalize"),
        *_assigns(mp_process, "BaseProcess", "_config"),
        # The queues: loky's, multiprocessing's feeder rebuilt, recycling.
        *_has(pe, "_SafeQueue._on_queue_feeder_error", "_CallItem", "_ResultItem"),
        *_has(pe, "_RecycledWorkerPid", "_SafeQueue.__getstate__", "_SafeQueue.__setstate__"),
        *_has(mp_queues, "_sentinel", "Queue._finalize_close"),
        *_has(loky_queues, "SimpleQueue.put"),
        # _setup_queues makes loky's queues as loky does, of our classes.
        *_has(pe, "EXTRA_QUEUED_CALLS"),
        *_takes(
            pe,
            "_SafeQueue.__init__",
            "self",
            "max_size",
            "ctx",
            "pending_work_items",
            "running_work_items",
            "thread_wakeup",
            "shutdown_lock",
            "executor_flags",
            "reducers",
        ),
        *_takes(loky_queues, "SimpleQueue.__init__", "self", "reducers", "ctx"),
        *_assigns(pe, "ProcessPoolExecutor", "_running_work_items", "_shutdown_lock", "_context"),
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


def _lookup(module: types.ModuleType, path: str) -> object:
    """The object at ``path`` in ``module`` (``"_SafeQueue.get"``), or _MISSING."""
    found: object = module
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


def raise_if_unsupported() -> None:
    """Raise an :class:`ImportError` that names the versions if the installed loky
    lacks what sharexec uses of it."""
    problems = list(dict.fromkeys(_problems()))  # in order, once each
    if problems:
        version = getattr(loky, "__version__", "(unknown version)")
        raise ImportError(
            f"sharexec supports loky {SUPPORTED_LOKY}, and the installed loky {version} "
            "differs where sharexec relies on loky's internals: "
            + "; ".join(problems)
            + f". Install a supported version: pip install 'loky{SUPPORTED_LOKY}'"
        )
