"""One call with many out-of-band buffers: the pass must stay linear in their number.

Run: ``python bench/many_buffers.py`` (``--counts 5000 20000``, ``--reps 3``). Prints, per
count, the median time of one ``submit(len, buffers).result()`` whose argument is a list
of that many distinct small arrays (4 KiB of float64 each), each at ``min_share_bytes``
(4 KiB here), so each is copied into a segment of its own; and the time of the forward
pass alone (the call's reduction, as the feeder thread runs it). 2 workers, spawn, a
warm pool; fresh arrays for each run, so every buffer is copied and none reused.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import sharexec
from sharexec._reduction import ForwardSink, dumps

SIZE = 4096


def buffers(count: int) -> list[np.ndarray]:
    """``count`` distinct arrays of 4 KiB."""
    rng = np.random.default_rng(count)
    return list(rng.random((count, SIZE // 8)))


def one_call(ex: sharexec.SharedProcessPoolExecutor, items: list[np.ndarray]) -> float:
    start = time.perf_counter()
    assert ex.submit(len, items).result() == len(items)
    return time.perf_counter() - start


def one_pass(ex: sharexec.SharedProcessPoolExecutor, items: list[np.ndarray]) -> float:
    transport = ex._transport
    start = time.perf_counter()
    packed = dumps((len, (items,), {}), ForwardSink(transport))
    elapsed = time.perf_counter() - start
    shared = len(packed.buffers)
    del packed
    if shared != len(items):
        print(f"  note: {len(items) - shared} buffers were pickled in-band (a fallback)")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[5000, 20000])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with sharexec.SharedProcessPoolExecutor(2, mp_context="spawn", min_share_bytes=SIZE) as ex:
        ex.submit(len, buffers(10)).result()  # workers up, sweeper started
        print(f"{'buffers':>8} {'call s':>8} {'pass s':>8}")
        for count in args.counts:
            # Fresh bytes for each run: every buffer is copied, none reused.
            calls = [one_call(ex, buffers(count)) for _ in range(args.reps)]
            passes = [one_pass(ex, buffers(count)) for _ in range(args.reps)]
            print(f"{count:>8} {statistics.median(calls):>8.2f} {statistics.median(passes):>8.2f}")


if __name__ == "__main__":
    main()
