"""The systems compared, each running the same workloads through its own API.

A system is started (timed: pool construction until every worker has answered), runs
workloads on its warm pool, and is shut down. A workload method returns a small summary
that the harness checks against the expected value, so every system is seen to compute the
right thing; the summaries are cheap (a few elements), the big data never comes back twice.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from multiprocessing import shared_memory
from typing import Any, ClassVar

import numpy as np
import ready
import tasks

N_WORKERS = 2


class Unsupported(Exception):
    """A workload (or start method) that a system cannot run; the message says why."""


def split_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """The (lo, hi) bounds of ``np.array_split(range(n), parts)``."""
    q, r = divmod(n, parts)
    bounds, lo = [], 0
    for k in range(parts):
        hi = lo + q + (k < r)
        bounds.append((lo, hi))
        lo = hi
    return bounds


class System:
    """The workloads written once against two primitives, ``call_all`` and ``imap``."""

    name = ""
    notes: ClassVar[dict[str, str]] = {}  # workload -> how this system runs it, when it differs

    def __init__(self, method: str) -> None:
        self.method = method

    @classmethod
    def method_note(cls, method: str) -> str:
        """What a reader should know about this system under ``method``."""
        return ""

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def first_result(self) -> None:
        """Start, and wait for one call's result only (timed as "start-up, first")."""
        self.start_pool()
        if self.call_all(ready.pid, [()])[0] == os.getpid():
            raise RuntimeError(f"{self.name}: the call ran in the parent")

    def start_pool(self) -> None:
        """Make the pool, without waiting for any worker."""
        raise NotImplementedError

    def wait_ready(self) -> None:
        folder = tempfile.mkdtemp(prefix="sharexec-bench-ready-")
        try:
            pids = self.call_all(ready.rendezvous, [(folder, N_WORKERS)] * N_WORKERS)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if len(set(pids)) != N_WORKERS or os.getpid() in pids:
            raise RuntimeError(f"{self.name}: expected {N_WORKERS} workers, got pids {pids}")

    # -- primitives ---------------------------------------------------------------------

    def call_all(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        """Submit every call, then wait for all; the results in order."""
        raise NotImplementedError

    def imap(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        """``map``: the results in order, as they come."""
        raise NotImplementedError

    # -- workloads ----------------------------------------------------------------------

    def w1(self, a: np.ndarray, count: int = 8, fn: Callable[..., Any] = tasks.total) -> Any:
        return self.call_all(fn, [(a,)] * count)

    def w2(self, a: np.ndarray, parts: int = 64) -> float:
        return sum(self.imap(tasks.chunk_sum, np.array_split(a, parts)))

    def w3(self, n: int, count: int = 8) -> list[tuple[int, float, float]]:
        results = self.call_all(tasks.fresh, [(n, float(i)) for i in range(count)])
        return [(len(r), float(r[0]), float(r[-1])) for r in results]

    def w4(self, n: int, parts: int = 16) -> list[float]:
        bounds = split_bounds(n, parts)
        out = np.empty(n)
        sizes = [hi - lo for lo, hi in bounds]
        values = [float(k + 1) for k in range(parts)]
        for (lo, hi), part in zip(bounds, self.imap(tasks.fresh, sizes, values), strict=True):
            out[lo:hi] = part
        return samples(out, bounds)

    def w5_submit(self, count: int) -> int:
        return sum(self.call_all(tasks.inc, [(i,) for i in range(count)]))

    def w5_map(self, count: int) -> int:
        return sum(self.imap(tasks.inc, range(count)))


def samples(out: np.ndarray, bounds: list[tuple[int, int]]) -> list[float]:
    """W4's summary: the first and last element of every slice."""
    return [float(out[i]) for lo, hi in bounds for i in (lo, hi - 1)]


# ---------------------------------------------------------------------------------------
# Executors: the stdlib's, loky's, sharexec's
# ---------------------------------------------------------------------------------------


class ExecutorSystem(System):
    ex: cf.Executor

    def make_executor(self) -> cf.Executor:
        raise NotImplementedError

    def start(self) -> None:
        self.ex = self.make_executor()
        self.wait_ready()

    def start_pool(self) -> None:
        self.ex = self.make_executor()

    def shutdown(self) -> None:
        self.ex.shutdown(wait=True)

    def call_all(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        futures = [self.ex.submit(fn, *call) for call in calls]
        return [f.result() for f in futures]

    def imap(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        return self.ex.map(fn, *iterables)


def context_of(method: str) -> Any:
    """The stdlib's context for ``method``; None for ``default`` (each system's own)."""
    return None if method == "default" else multiprocessing.get_context(method)


class Stdlib(ExecutorSystem):
    name = "stdlib"
    notes: ClassVar[dict[str, str]] = {"W4": "slices returned, assembled in the parent"}

    @classmethod
    def method_note(cls, method: str) -> str:
        if method == "default":
            return f"its default, {multiprocessing.get_start_method()}"
        return ""

    def make_executor(self) -> cf.Executor:
        return cf.ProcessPoolExecutor(N_WORKERS, mp_context=context_of(self.method))


class Loky(ExecutorSystem):
    name = "loky"
    notes: ClassVar[dict[str, str]] = {"W4": "slices returned, assembled in the parent"}

    def make_executor(self) -> cf.Executor:
        import loky

        # The stdlib's context object: loky's get_context("fork") warns.
        context = context_of(self.method)
        executor: cf.Executor = loky.ProcessPoolExecutor(N_WORKERS, context=context)
        return executor


class Sharexec(ExecutorSystem):
    name = "sharexec"
    notes: ClassVar[dict[str, str]] = {"W4": "workers write into sharexec.zeros"}

    def make_executor(self) -> cf.Executor:
        import sharexec

        method = None if self.method == "default" else self.method
        return sharexec.SharedProcessPoolExecutor(N_WORKERS, mp_context=method)

    @classmethod
    def method_note(cls, method: str) -> str:
        return "its default, forks of its warm server" if method == "default" else ""

    def w4(self, n: int, parts: int = 16) -> list[float]:
        import sharexec

        bounds = split_bounds(n, parts)
        out = sharexec.zeros(n)
        views = [out[lo:hi] for lo, hi in bounds]
        values = [float(k + 1) for k in range(parts)]
        for _ in self.imap(tasks.fill, views, values):
            pass
        del views
        return samples(out, bounds)


# ---------------------------------------------------------------------------------------
# joblib: Parallel, loky backend, auto-memmapping (its defaults)
# ---------------------------------------------------------------------------------------


def _shutdown_joblib_executor() -> None:
    """Shut down joblib's reusable executor, so the next Parallel call starts a new one."""
    from joblib.externals.loky import reusable_executor

    executor = reusable_executor._executor
    if executor is not None:
        executor.shutdown(wait=True)


class Joblib(System):
    """joblib as its users run it.

    For ``spawn`` it uses loky's own start method, ``loky`` (fork + exec of a fresh
    interpreter: spawn's semantics), its default. Under the stdlib's ``spawn`` context each
    worker starts its own loky resource tracker, the reference counts of joblib's memmap
    files split, and every ``Parallel`` call then spends about a second retrying to delete
    its temporary folder: measured, but not what a joblib user gets.
    """

    name = "joblib"
    notes: ClassVar[dict[str, str]] = {"W4": "slices returned, assembled in the parent"}
    LOKY_FOR: ClassVar[dict[str, str]] = {
        "spawn": "loky",
        "default": "loky",
    }  # start method asked -> the one joblib is run with

    @classmethod
    def method_note(cls, method: str) -> str:
        if method in cls.LOKY_FOR:
            return f"run with loky's start method {cls.LOKY_FOR[method]!r} ({method} semantics)"
        if method == "forkserver":
            return "a tracker per worker: each call waits ~1 s to delete its temp folder"
        return ""

    def start(self) -> None:
        self.start_pool()
        self.wait_ready()

    def start_pool(self) -> None:
        from joblib.externals.loky.backend import context

        if self.method == "fork":
            raise Unsupported("loky's reusable executor refuses fork")
        _shutdown_joblib_executor()
        context.set_start_method(self.LOKY_FOR.get(self.method, self.method), force=True)

    def shutdown(self) -> None:
        _shutdown_joblib_executor()

    def call_all(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        from joblib import Parallel, delayed

        return list(Parallel(n_jobs=N_WORKERS, backend="loky")(delayed(fn)(*c) for c in calls))

    def imap(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        from joblib import Parallel, delayed

        parallel = Parallel(n_jobs=N_WORKERS, backend="loky", return_as="generator")
        results: Iterator[Any] = parallel(
            delayed(fn)(*args) for args in zip(*iterables, strict=True)
        )
        return results

    def w5_submit(self, count: int) -> int:
        raise Unsupported("no submit: Parallel only")


# ---------------------------------------------------------------------------------------
# mpire: WorkerPool, its defaults (batching of map by its automatic chunk size)
# ---------------------------------------------------------------------------------------


class Mpire(System):
    """mpire as its users run it: a ``WorkerPool`` kept alive between calls, ``imap`` with
    its automatic chunk size, ``apply_async`` for one call at a time."""

    name = "mpire"
    notes: ClassVar[dict[str, str]] = {"W4": "slices returned, assembled in the parent"}

    @classmethod
    def method_note(cls, method: str) -> str:
        return "its default, fork" if method == "default" else ""

    def start(self) -> None:
        self.start_pool()
        self.wait_ready()

    def start_pool(self) -> None:
        from mpire import WorkerPool

        method = {} if self.method == "default" else {"start_method": self.method}
        self.pool = WorkerPool(n_jobs=N_WORKERS, keep_alive=True, **method)

    def shutdown(self) -> None:
        self.pool.stop_and_join()

    def call_all(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
        results = [self.pool.apply_async(fn, args=call) for call in calls]
        return [r.get() for r in results]

    def imap(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        # mpire unpacks a tuple item into the arguments.
        results: Iterator[Any] = self.pool.imap(fn, list(zip(*iterables, strict=True)))
        return results


# ---------------------------------------------------------------------------------------
# Hand-written multiprocessing.shared_memory with the stdlib executor: the parent's side
# ---------------------------------------------------------------------------------------


def put(a: np.ndarray) -> shared_memory.SharedMemory:
    """A new segment holding a copy of the 1-D array ``a``."""
    segment = shared_memory.SharedMemory(create=True, size=max(a.nbytes, 1))
    view = np.ndarray(a.shape, a.dtype, buffer=segment.buf)
    view[...] = a
    del view
    return segment


def take(handle: tuple[str, int, str]) -> np.ndarray:
    """Copy a worker's result out of its segment, then unlink the segment."""
    name, n, dtype = handle
    segment = shared_memory.SharedMemory(name=name)
    try:
        return np.array(np.ndarray((n,), dtype, buffer=segment.buf))
    finally:
        segment.close()
        segment.unlink()


def release(segment: shared_memory.SharedMemory) -> None:
    segment.close()
    segment.unlink()


class HandShm(Stdlib):
    name = "shm"
    notes: ClassVar[dict[str, str]] = {
        "W1": "one SharedMemory per call, workers attach",
        "W2": "one SharedMemory, workers attach per chunk",
        "W3": "worker creates a segment, parent copies out and unlinks",
        "W4": "workers write into one SharedMemory",
    }

    def w1(self, a: np.ndarray, count: int = 8, fn: Callable[..., Any] = tasks.total) -> Any:
        segment = put(a)
        try:
            call = (fn, segment.name, a.size, a.dtype.str, 0, a.size)
            return self.call_all(tasks.on_segment, [call] * count)
        finally:
            release(segment)

    def w2(self, a: np.ndarray, parts: int = 64) -> float:
        segment = put(a)
        try:
            bounds = split_bounds(a.size, parts)
            calls = [
                (tasks.chunk_sum, segment.name, a.size, a.dtype.str, lo, hi) for lo, hi in bounds
            ]
            return sum(self.imap(tasks.on_segment, *zip(*calls, strict=True)))
        finally:
            release(segment)

    def w3(self, n: int, count: int = 8) -> list[tuple[int, float, float]]:
        futures = [
            self.ex.submit(tasks.via_segment, tasks.fresh, n, float(i)) for i in range(count)
        ]
        results = [take(f.result()) for f in futures]
        return [(len(r), float(r[0]), float(r[-1])) for r in results]

    def w4(self, n: int, parts: int = 16) -> list[float]:
        bounds = split_bounds(n, parts)
        segment = shared_memory.SharedMemory(create=True, size=n * 8)
        try:
            calls = [
                (tasks.fill, segment.name, n, "<f8", lo, hi, float(k + 1))
                for k, (lo, hi) in enumerate(bounds)
            ]
            for _ in self.imap(tasks.on_segment, *zip(*calls, strict=True)):
                pass
            out = np.ndarray((n,), np.float64, buffer=segment.buf)
            summary = samples(out, bounds)
            del out
            return summary
        finally:
            release(segment)

    def w5_submit(self, count: int) -> int:
        raise Unsupported("no arrays: the stdlib's code")

    def w5_map(self, count: int) -> int:
        raise Unsupported("no arrays: the stdlib's code")


SYSTEMS: dict[str, type[System]] = {
    cls.name: cls for cls in (Stdlib, Loky, Joblib, Mpire, HandShm, Sharexec)
}
