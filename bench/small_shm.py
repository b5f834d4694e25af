"""A default container against the host: the same calls with the host's /dev/shm and in a
private mount namespace whose /dev/shm is a 64 MB tmpfs (Docker's and Kubernetes'
default), in one run, alternating.

The calls: ``a[::4096].sum()`` on a 128 MiB argument, 8 calls per repetition, 3
repetitions, 2 workers (started by the first repetition, which is timed apart). Printed
as a Markdown table: per side, the median of the later repetitions over ``--rounds``
rounds, and what ``executor.statistics()`` says of the last round. Needs root and
``unshare`` for the namespace side.

Usage: ``python bench/small_shm.py [--rounds 3]``
"""

from __future__ import annotations

import argparse
import ast
import statistics
import subprocess
import sys
import time
import warnings

MIB = 1 << 20


def strided_sum(a: object) -> object:
    return a[::4096].sum()  # type: ignore[index]


def measure() -> None:
    """One round on whatever /dev/shm this process sees; prints a Python literal."""
    import shutil

    import numpy as np

    import sharexec

    a = np.random.default_rng(0).random(128 * MIB // 8)
    times = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sharexec.SharedProcessPoolExecutor(max_workers=2) as ex:
            for _ in range(3):
                started = time.perf_counter()
                list(ex.map(strided_sum, [a] * 8))
                times.append(time.perf_counter() - started)
            s = ex.statistics()
    print(
        {
            "shm": shutil.disk_usage("/dev/shm").total,
            "times": times,
            "pooled": s.segments_pooled,
            "copied": s.bytes_copied,
            "fallbacks": s.fallbacks,
            "warnings": sum(issubclass(w.category, sharexec.SharexecWarning) for w in caught),
        }
    )


def in_small_shm(command: list[str], size: str = "64m") -> list[str]:
    """``command``, to run in a private mount namespace whose /dev/shm is a tmpfs of
    ``size`` (needs root and ``unshare``)."""
    mount = f'mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm && exec "$0" "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, *command]


def run(small: bool) -> dict:
    command = [sys.executable, __file__, "--measure"]
    if small:
        command = in_small_shm(command)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    result: dict = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure()
        return
    rounds: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.rounds):
        for small in (False, True):
            rounds[small].append(run(small))
    print("| /dev/shm | first repetition | later ones (median) | statistics, last round |")
    print("|---|---|---|---|")
    for small in (False, True):
        got = rounds[small]
        last = got[-1]
        first = statistics.median(r["times"][0] for r in got)
        later = statistics.median(t for r in got for t in r["times"][1:])
        where = "a 64 MB tmpfs" if small else "the host's"
        print(
            f"| {where} ({last['shm'] // MIB:,} MiB) "
            f"| {first:.2f} s | {later:.3f} s | {last['pooled']} pooled, "
            f"{last['copied'] // MIB:,} MiB copied, {last['fallbacks']} fallbacks, "
            f"{last['warnings']} warnings |"
        )


if __name__ == "__main__":
    main()
