"""Paired ratios on a busy machine: ``python bench/paired.py [--scale S] [--reps N]``.

``run.py`` times each system in turn, so a load that changes during a run (other jobs on
a shared machine) moves one system's figures and not another's. Here the two systems of
each comparison run in alternation, one repetition each, and the ratio reported is the
median of the per-repetition ratios: what both met at the same moment cancels out.

Comparisons: start-up of a pool under each system's default start
method, until every worker is up and until the first result, sharexec against the
stdlib; W4 (16 tasks fill a 512 MiB output, times ``--scale``), sharexec against
hand-written shared memory. The one-time start of sharexec's warm server (the first
pool of a process) is timed apart.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import systems
from console import compile_sharexec
from run import W4_MIB, MiB, uptime


def paired(a: Callable[[], Any], b: Callable[[], Any], reps: int) -> tuple[float, float, float]:
    """Median times of ``a`` and ``b`` run in alternation, and the median of b / a."""
    ta, tb = [], []
    for _ in range(reps):
        for run, times in ((a, ta), (b, tb)):
            gc.collect()
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    ratio = statistics.median(y / x for x, y in zip(ta, tb, strict=True))
    return statistics.median(ta), statistics.median(tb), ratio


def start_up(cls: type[systems.System], first: bool) -> Callable[[], None]:
    def run() -> None:
        system = cls("default")
        (system.first_result if first else system.start)()
        system.shutdown()

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.5)
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args()
    compile_sharexec()
    print(f"load before: {uptime()}")
    cold = time.perf_counter()
    start_up(systems.Sharexec, True)()
    cold = time.perf_counter() - cold
    print(f"sharexec's first pool in this process (its server's start): {cold:.3f} s")
    for first in (False, True):
        what = "the first result" if first else "every worker up"
        std, ours, ratio = paired(
            start_up(systems.Stdlib, first), start_up(systems.Sharexec, first), args.reps
        )
        print(
            f"start-up until {what}, defaults: stdlib {std * 1e3:.1f} ms, sharexec "
            f"{ours * 1e3:.1f} ms, paired ratio {ratio:.2f} (target ≤ 2)"
        )
    n = max(int(W4_MIB * args.scale * MiB) // 8, 1024)
    shm, ours_w4 = systems.HandShm("spawn"), systems.Sharexec("spawn")
    shm.start()
    ours_w4.start()
    shm.w4(n)
    ours_w4.w4(n)  # warm-up, untimed
    std, ours, ratio = paired(lambda: shm.w4(n), lambda: ours_w4.w4(n), max(5, args.reps // 2))
    print(
        f"W4 {n * 8 / MiB:g} MiB (spawn): shm {std * 1e3:.0f} ms, sharexec {ours * 1e3:.0f} ms, "
        f"paired ratio {ratio:.2f} (target ≤ 0.5)"
    )
    shm.shutdown()
    ours_w4.shutdown()
    print(f"load after: {uptime()}")


if __name__ == "__main__":
    main()
