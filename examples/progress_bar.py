"""
A progress bar over as_completed
================================

Follow tasks with large arguments and results as they finish, with tqdm.

``concurrent.futures.as_completed`` yields each future as soon as its task is done,
whatever the order of submission: wrapped in a ``tqdm`` progress bar, it shows how far
the work has gone. Each task gets a large batch of signals (copied once into shared
memory) and returns each signal sorted (a large result, back through shared memory). tqdm
is optional: without it, a minimal progress line takes its place. Both write to stderr.

Run: ``python examples/progress_bar.py`` (``--fast``: fewer, smaller batches).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import as_completed
from typing import TypeVar

import numpy as np

import sharexec

T = TypeVar("T")

try:
    from tqdm import tqdm
except ImportError:  # tqdm is not a dependency of sharexec: a minimal stand-in

    def tqdm(iterable: Iterable[T], total: int, desc: str, unit: str) -> Iterator[T]:
        """A progress line: updated in place on a terminal, each quarter in a log."""
        tty = sys.stderr.isatty()
        for done, item in enumerate(iterable, 1):
            yield item
            if tty:  # one line, rewritten in place
                end = "\n" if done == total else ""
                print(f"\r{desc}: {done}/{total} {unit}s", end=end, file=sys.stderr, flush=True)
            elif done % max(1, total // 4) == 0 or done == total:  # a log: a few lines
                print(f"{desc}: {done}/{total} {unit}s", file=sys.stderr, flush=True)


def sort_signals(batch: np.ndarray) -> np.ndarray:
    return np.sort(batch, axis=1)


def main(batches: int = 24, signals: int = 250, length: int = 4000) -> None:
    data = np.random.default_rng(0).standard_normal((batches, signals, length))  # 192 MB
    results: list[np.ndarray | None] = [None] * batches
    with sharexec.SharedProcessPoolExecutor() as ex:
        index = {ex.submit(sort_signals, data[i]): i for i in range(batches)}
        for future in tqdm(as_completed(index), total=batches, desc="sorting", unit="task"):
            results[index[future]] = future.result()
        stats = ex.statistics()
    for batch, result in zip(data, results, strict=True):
        assert np.array_equal(result, np.sort(batch, axis=1))
    print(
        f"sorted {batches} batches of {signals} signals of {length} samples as they "
        f"completed: {stats.bytes_copied / 1e6:.0f} MB out and "
        f"{data.nbytes / 1e6:.0f} MB back through shared memory"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A progress bar over as_completed.")
    parser.add_argument("--fast", action="store_true", help="small batches (as the tests run)")
    if parser.parse_args().fast:
        main(batches=6, signals=64, length=1024)
    else:
        main()
