"""The workload of ``python -m sharexec demo``: sharexec timed against the stdlib executor.

This module owns the demo's workload, its correctness checks, its timing and the text of
its result table; the command line (``sharexec/__main__.py``) owns argument parsing and
printing. The functions the workers run live here, at module level, so that ``spawn``
workers can import them by name (a function defined in ``__main__`` would not pickle
by reference for the standard library's executor).

Both executors get the same start method (``spawn``), the same number of workers and the
same workload, and both are timed warm: the pool is started and every worker has run one
trivial task before the clock starts. Start-up is timed apart.
"""

from __future__ import annotations

import multiprocessing
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
    "Timings",
    "chunk_sum",
    "format_report",
    "run_demo",
    "warm_up",
]

FloatArray = npt.NDArray[np.float64]

MAX_WORKERS = 2
START_METHOD = "spawn"
N_CHUNKS = 64
DEFAULT_SIZE_MB = 1024
# How long each warm-up task lingers, so that every worker of a pool that starts its
# workers on demand (the stdlib's under spawn) is started before the clock runs.
_WARM_UP_SECONDS = 0.05


class DemoError(RuntimeError):
    """A result computed in the workers differs from the serial computation."""


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
) -> Timings:
    """Time the workload on one executor and check its results against the serial ones."""
    t0 = time.perf_counter()
    executor = make_executor()
    try:
        list(executor.map(warm_up, range(MAX_WORKERS)))
        t1 = time.perf_counter()
        total = sum(executor.map(chunk_sum, np.array_split(a, N_CHUNKS)))
        t2 = time.perf_counter()
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
    DemoError
        If an executor's result differs from the serial computation.
    """
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
    )

    say(f"sharexec.SharedProcessPoolExecutor ({MAX_WORKERS} workers, {START_METHOD})")
    shared = _time_executor(
        lambda: SharedProcessPoolExecutor(max_workers=MAX_WORKERS, mp_context=context),
        a,
        expected_sum,
        expected_sqrt,
        "SharedProcessPoolExecutor",
    )
    return DemoReport(size_bytes=a.nbytes, serial=serial, stdlib=stdlib, sharexec=shared)


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def _ratio(stdlib: float, shared: float) -> str:
    if shared <= 0.0:
        return "n/a"
    ratio = stdlib / shared
    if ratio >= 1.0:
        return f"{ratio:.1f}x faster"
    return f"{ratio:.2f}x (slower)"


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
    header = ("workload", "stdlib s", "sharexec s", "stdlib/sharexec")
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
        ]
    )
