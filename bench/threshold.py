"""Where sharing beats pickling: per-task time against array size (sets min_share_bytes).

Run: ``python bench/threshold.py``. Prints, per array size, the median time per task of
the stdlib executor, of sharexec sharing every array, and of sharexec pickling every
array (20 distinct arrays per run, 5 runs, 2 workers, spawn, warm pools).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import statistics
import time

import numpy as np

import sharexec


def first(a: np.ndarray) -> float:
    return float(a[0])


def per_task(ex: cf.Executor, arrays: list[np.ndarray], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        for f in [ex.submit(first, a) for a in arrays]:
            f.result()
        times.append((time.perf_counter() - start) / len(arrays))
    return statistics.median(times)


def main() -> None:
    spawn = multiprocessing.get_context("spawn")
    stdlib = cf.ProcessPoolExecutor(2, mp_context=spawn)
    shared = sharexec.SharedProcessPoolExecutor(2, mp_context="spawn", min_share_bytes=1)
    pickled = sharexec.SharedProcessPoolExecutor(2, mp_context="spawn", min_share_bytes=1 << 50)
    systems = (stdlib, shared, pickled)
    for ex in systems:
        ex.submit(first, np.ones(1)).result()
    print(f"{'bytes':>10} {'stdlib µs':>10} {'shared µs':>10} {'pickled µs':>10}")
    for kib in (16, 64, 128, 256, 512, 1024, 4096):
        arrays = [np.random.rand(kib * 128) for _ in range(20)]
        row = [per_task(ex, arrays) * 1e6 for ex in systems]
        print(f"{arrays[0].nbytes:>10} " + " ".join(f"{t:>10.0f}" for t in row))
    for ex in systems:
        ex.shutdown()


if __name__ == "__main__":
    main()
