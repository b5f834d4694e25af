"""The workload of ``python -m sharexec demo``: sharexec timed against the stdlib executor.

This module owns the demo's workload, its correctness checks, its timing and the text of
its result table; the command line (``sharexec/__main__.py``) owns argument parsing and
printing. The functions the workers run live here, at module level, so that ``spawn``
workers can import them by name (a function defined in ``__main__`` would not pickle
by reference for the standard library's executor).

Both executors get the same start method (``spawn``), the same number of workers and the
same workload, and both are timed warm: the pool is started and every worker has run one
trivial task before the clock starts. Start-up is timed apart.

What it measures is the cost of moving the data between processes: summing an array is
faster in the parent itself than through either pool (the report says so), so the
ratio is no parallel speed-up. Its peak memory is about :data:`PEAK_FACTOR` times the
array (:func:`peak_bytes`), said before anything runs (:func:`plan`).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._executor import SharedProcessPoolExecutor

__all__ = [
    "DemoError",
    "DemoReport",
    "SizeError",
    "Timings",
    "available_memory",
    "check_size",
    "chunk_sum",
    "format_report",
    "peak_bytes",
    "plan",
    "run_demo",
    "warm_up",
]

FloatArray = npt.NDArray[np.float64]

MAX_WORKERS = 2
START_METHOD = "spawn"
N_CHUNKS = 64
DEFAULT_SIZE_MB = 1024
# The demo's peak memory: PEAK_FACTOR times the array, plus PEAK_BASE_BYTES for three
# interpreters with NumPy. The array and its serial square root stay in the parent, and
# while the standard library's executor moves np.sqrt(a), the pickled argument, the
# worker's copy and result, the pickled result and the parent's copy of it are in flight.
# Measured with `python bench/demo_memory.py` (peak PSS of the demo's process tree) on
# 2026-12-01: 1863 MiB at --size-mb 256, 7281 MiB at 1024 (the default).
PEAK_FACTOR = 7
PEAK_BASE_BYTES = 128 << 20
# How long each warm-up task lingers, so that every worker of a pool that starts its
# workers on demand (the stdlib's under spawn) is started before the clock runs.
_WARM_UP_SECONDS = 0.05


class DemoError(RuntimeError):
    """A result computed in the workers differs from the serial computation."""


class SizeError(ValueError):
    """The array size asked for cannot be run: not a finite positive number, or more
    memory than the machine has available."""


def peak_bytes(size_mb: float) -> int:
    """About how much memory the demo uses at its peak for an array of ``size_mb`` MiB."""
    return int(PEAK_FACTOR * size_mb * 2**20) + PEAK_BASE_BYTES


def available_memory() -> int | None:
    """The memory available to start new work (``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_size(size_mb: float, available: int | None = None) -> None:
    """Raise :class:`SizeError` unless the demo can run at ``size_mb`` MiB here.

    Parameters
    ----------
    size_mb : float
        The array size asked for, in MiB.
    available : int, optional
        Bytes of memory available; default :func:`available_memory`.
    """
    if not math.isfinite(size_mb) or size_mb <= 0:
        raise SizeError(f"the size must be a finite number of MiB above 0, got {size_mb!r}")
    available = available_memory() if available is None else available
    need = peak_bytes(size_mb)
    if available is not None and need > available:
        fitting = max(1, int((available - PEAK_BASE_BYTES) / PEAK_FACTOR / 2**20 * 0.8))
        raise SizeError(
            f"{_gib(size_mb * 2**20)} array needs about {_gib(need)} of memory at its "
            f"peak ({PEAK_FACTOR:g}x the array, and the interpreters), and this machine "
            f"has {_gib(available)} available; try --size-mb {fitting}"
        )


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def plan(size_mb: float) -> str:
    """What the demo is about to do and what it costs, said before it runs."""
    workers = os.cpu_count() or 1
    return "\n".join(
        [
            f"This demo moves one {_gib(size_mb * 2**20)} float64 array between processes:",
            f"  sum(ex.map(chunk_sum, np.array_split(a, {N_CHUNKS}))) and "
            "ex.submit(np.sqrt, a).result(),",
            "first with concurrent.futures.ProcessPoolExecutor, then with",
            f"sharexec.SharedProcessPoolExecutor ({MAX_WORKERS} workers each, start method "
            f"{START_METHOD!r}).",
            "It measures the cost of moving the data (pickling through a pipe, against "
            "shared memory),",
            "not a parallel speed-up: the sum alone is faster in this process than through "
            "either pool.",
            f"Peak memory: about {_gib(peak_bytes(size_mb))} ({PEAK_FACTOR:g}x the array, "
            "and the interpreters), in the standard library's half.",
            f"This machine has {workers} CPUs.",
        ]
    )


# ---------------------------------------------------------------------------------------
# Worker functions (module level, importable by spawned workers)
# ---------------------------------------------------------------------------------------


def warm_up(_: int) -> None:
    """The trivial task run on each worker before timing starts."""
    time.sleep(_WARM_UP_SECONDS)


def chunk_sum(chunk: FloatArray) -> float:
    """Sum one chunk of the array."""
    return float(chunk.sum())


# ---------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timings:
    """Wall-clock seconds of one executor on the demo workload.

    Attributes
    ----------
    startup
        Creating the pool and running one trivial task on each worker.
    chunk_sum
        ``sum(ex.map(chunk_sum, np.array_split(a, 64)))``, with a warm pool.
    sqrt
        ``ex.submit(np.sqrt, a).result()``, with a warm pool.
    """

    startup: float
    chunk_sum: float
    sqrt: float

    @property
    def workload(self) -> float:
        """Seconds of the two workloads together, start-up excluded."""
        return self.chunk_sum + self.sqrt


@dataclass(frozen=True)
class DemoReport:
    """What the demo measured, for the command line to print.

    Attributes
    ----------
    size_bytes
        Size of the float64 array the workloads run over, e.g. ``1073741824``.
    serial
        Seconds of the serial, in-process computation of each workload (the reference
        the results are checked against); ``startup`` is 0.
    stdlib
        Timings of :class:`concurrent.futures.ProcessPoolExecutor`.
    sharexec
        Timings of :class:`sharexec.SharedProcessPoolExecutor`.
    """

    size_bytes: int
    serial: Timings
    stdlib: Timings
    sharexec: Timings


def _time_executor(
    make_executor: Callable[[], Executor],
    a: FloatArray,
    expected_sum: float,
    expected_sqrt: FloatArray,
    name: str,
    say: Callable[[str], None],
) -> Timings:
    """Time the workload on one executor and check its results against the serial ones.

    ``say`` is told how far the workload is, every eighth of the chunks and before the
    square root (a line costs microseconds against chunks of milliseconds).
    """
    t0 = time.perf_counter()
    executor = make_executor()
    try:
        list(executor.map(warm_up, range(MAX_WORKERS)))
        t1 = time.perf_counter()
        total = 0.0
        step = max(1, N_CHUNKS // 8)
        for done, part in enumerate(executor.map(chunk_sum, np.array_split(a, N_CHUNKS)), 1):
            total += part
            if done % step == 0:
                say(f"  {name}: {done}/{N_CHUNKS} chunks summed")
        t2 = time.perf_counter()
        say(f"  {name}: np.sqrt(a) in a worker, the array there and back")
        root = executor.submit(np.sqrt, a).result()
        t3 = time.perf_counter()
    finally:
        executor.shutdown(wait=True)

    if not np.isclose(total, expected_sum):
        raise DemoError(f"{name}: sum of chunks is {total!r}, serial sum is {expected_sum!r}")
    if not (
        isinstance(root, np.ndarray)
        and root.dtype == expected_sqrt.dtype
        and np.array_equal(root, expected_sqrt)
    ):
        raise DemoError(f"{name}: np.sqrt(a) computed in a worker differs from the serial one")
    return Timings(startup=t1 - t0, chunk_sum=t2 - t1, sqrt=t3 - t2)


def run_demo(
    size_mb: float = DEFAULT_SIZE_MB,
    progress: Callable[[str], None] | None = None,
) -> DemoReport:
    """Run the demo workload on both executors and return the timings.

    Parameters
    ----------
    size_mb : float, default 1024
        Size of the float64 array, in MiB (1024 gives ``134_217_728`` elements).
    progress : callable, optional
        Called with a short line of text before each step (the command line prints it).

    Raises
    ------
    SizeError
        If ``size_mb`` is not a finite number above 0, or needs more memory than is
        available (:func:`check_size`).
    DemoError
        If an executor's result differs from the serial computation.
    """
    check_size(size_mb)
    say = progress if progress is not None else (lambda _: None)
    n = max(N_CHUNKS, int(size_mb * 2**20) // 8)

    say(f"generating a {n * 8 / 2**20:,.0f} MiB float64 array ({n:,} elements)")
    a: FloatArray = np.random.default_rng(0).random(n)

    t0 = time.perf_counter()
    expected_sum = float(np.sum(a))
    t1 = time.perf_counter()
    expected_sqrt: FloatArray = np.sqrt(a)
    t2 = time.perf_counter()
    serial = Timings(startup=0.0, chunk_sum=t1 - t0, sqrt=t2 - t1)

    context = multiprocessing.get_context(START_METHOD)

    say(f"concurrent.futures.ProcessPoolExecutor ({MAX_WORKERS} workers, {START_METHOD})")
    stdlib = _time_executor(
        lambda: ProcessPoolExecutor(max_workers=MAX_WORKERS, mp_context=context),
        a,
        expected_sum,
        expected_sqrt,
        "ProcessPoolExecutor",
        say,
    )

    say(f"sharexec.SharedProcessPoolExecutor ({MAX_WORKERS} workers, {START_METHOD})")
    shared = _time_executor(
        lambda: SharedProcessPoolExecutor(max_workers=MAX_WORKERS, mp_context=context),
        a,
        expected_sum,
        expected_sqrt,
        "SharedProcessPoolExecutor",
        say,
    )
    return DemoReport(size_bytes=a.nbytes, serial=serial, stdlib=stdlib, sharexec=shared)


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def _ratio(stdlib: float, shared: float) -> str:
    """sharexec's time as a multiple of the stdlib's, as docs/performance.md gives it
    ("vs stdlib"), with what it means in words: ``0.05x (20x faster)``, ``1.3x (slower)``."""
    if stdlib <= 0.0 or shared <= 0.0:
        return "n/a"
    ratio = shared / stdlib
    shown = f"{ratio:.2g}x" if ratio < 0.1 else f"{ratio:.2f}x"
    if ratio < 1.0:
        return f"{shown} ({1 / ratio:.1f}x faster)"
    if ratio > 1.0:
        return f"{shown} (slower)"
    return f"{shown} (the same)"


def format_report(report: DemoReport) -> str:
    """Return the demo's result table: one row per workload, both times and their ratio."""
    rows = [
        ("pool start-up + 1 trivial task per worker", report.stdlib.startup,
         report.sharexec.startup),
        ("sum(map(chunk_sum, np.array_split(a, 64)))", report.stdlib.chunk_sum,
         report.sharexec.chunk_sum),
        ("submit(np.sqrt, a).result()", report.stdlib.sqrt, report.sharexec.sqrt),
        ("both workloads (warm pool)", report.stdlib.workload, report.sharexec.workload),
    ]  # fmt: skip
    header = ("workload", "stdlib s", "sharexec s", "sharexec/stdlib")
    cells = [header] + [
        (label, f"{std:.2f}", f"{shr:.2f}", _ratio(std, shr)) for label, std, shr in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: tuple[str, str, str, str]) -> str:
        first = row[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True))
        return "  ".join((first, *rest)).rstrip()

    n = report.size_bytes // 8
    return "\n".join(
        [
            f"a: {n:,} float64 ({report.size_bytes / 2**20:,.0f} MiB); "
            f"{MAX_WORKERS} workers, start method {START_METHOD!r} for both executors",
            "",
            line(cells[0]),
            "  ".join("-" * width for width in widths),
            *(line(row) for row in cells[1:]),
            "",
            f"Results match the serial computation (sum {report.serial.chunk_sum:.2f} s, "
            f"np.sqrt {report.serial.sqrt:.2f} s in-process).",
            "These times are the cost of moving the data between processes, not a "
            "parallel speed-up:",
            "the in-process sum is faster than either pool. Start-up varies from run to "
            "run by more than",
            "the difference between the two; docs/performance.md gives medians of 5 "
            "(python bench/run.py).",
        ]
    )
