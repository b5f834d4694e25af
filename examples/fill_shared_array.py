"""
Fill one array from many workers
================================

Each worker writes its own slice of one big array, in place.

The classic question: with ``ProcessPoolExecutor`` each worker would get a copy of its
slice and its writes would be lost. Allocated with ``sharexec.zeros``, the slices are
views of shared memory: workers write into them and the parent sees every write.

Run: ``python examples/fill_shared_array.py`` (``--fast``: a small array).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

import sharexec


def fill_rows(block: np.ndarray, first_row: int) -> None:
    rows = np.arange(first_row, first_row + block.shape[0])[:, None]
    block[...] = np.sin(rows * np.linspace(0.0, 1.0, block.shape[1]))


def main(rows: int = 4096, cols: int = 4096, tasks: int = 16) -> None:
    out = sharexec.zeros((rows, cols))  # 128 MB, in shared memory
    bounds = np.linspace(0, rows, tasks + 1).astype(int)
    with sharexec.SharedProcessPoolExecutor() as ex:
        futures = [ex.submit(fill_rows, out[lo:hi], lo) for lo, hi in itertools.pairwise(bounds)]
        for f in futures:
            f.result()
    expected = np.sin(np.arange(rows)[:, None] * np.linspace(0.0, 1.0, cols))
    assert np.array_equal(out, expected)
    print(f"filled a {out.shape} array from {tasks} tasks; checksum {out.sum():.6f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Fill one array from many workers.")
    parser.add_argument("--fast", action="store_true", help="a small array (as the tests run)")
    if parser.parse_args().fast:
        main(rows=512, cols=1024, tasks=4)
    else:
        main()
