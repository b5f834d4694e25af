"""
A library function that runs in parallel
========================================

Library code borrows the process-wide pool of ``sharexec.get_executor()``.

A library function should not start (and shut down) a pool of its own at every call:
``sharexec.get_executor()`` returns one executor per process, created at the first call
and reused by every later one, from any library. Here ``column_norms`` computes the norm
of each column of a large matrix over blocks of columns; the user calls it twice. The
first call gets an ordinary array: each block is copied once into shared memory. The
second gets a shared array (``sharexec.share``): the blocks travel by reference and
nothing is copied. ``statistics()`` shows both, on the same executor.

Run: ``python examples/library_function.py`` (``--fast``: a small matrix).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

import sharexec

# -- the library -------------------------------------------------------------------------


def _block_norms(block: np.ndarray) -> np.ndarray:
    return np.linalg.norm(block, axis=0)


def column_norms(a: np.ndarray, blocks: int = 16) -> np.ndarray:
    """The Euclidean norm of each column of the 2-D array ``a``, computed in parallel."""
    ex = sharexec.get_executor()  # the process's pool: never shut down by a library
    bounds = np.linspace(0, a.shape[1], min(blocks, a.shape[1]) + 1).astype(int)
    parts = ex.map(_block_norms, [a[:, lo:hi] for lo, hi in itertools.pairwise(bounds)])
    return np.concatenate(list(parts))


# -- the user's code ---------------------------------------------------------------------


def main(rows: int = 4096, cols: int = 4096) -> None:
    a = np.random.default_rng(0).standard_normal((rows, cols))  # 128 MB, ordinary memory
    expected = np.linalg.norm(a, axis=0)

    ex = sharexec.get_executor()  # the pool the library will use, to read its statistics
    start = ex.statistics()
    first = column_norms(a)
    middle = ex.statistics()
    shared = sharexec.share(a)  # one copy into shared memory, made by the user
    second = column_norms(shared)
    end = ex.statistics()
    assert sharexec.get_executor() is ex  # one executor for both calls: the same workers

    assert np.array_equal(first, expected) and np.array_equal(second, expected)
    copied = [middle.bytes_copied - start.bytes_copied, end.bytes_copied - middle.bytes_copied]
    by_reference = [
        middle.bytes_by_reference - start.bytes_by_reference,
        end.bytes_by_reference - middle.bytes_by_reference,
    ]
    # 1st call: each block (a strided view of a) copied once; 2nd call: all by reference.
    assert copied == [a.nbytes, 0] and by_reference == [0, a.nbytes], (copied, by_reference)
    print(
        f"column_norms ran twice on one executor ({end.tasks_submitted - start.tasks_submitted} "
        f"tasks): the 1st call copied {copied[0] / 1e6:.0f} MB into shared memory, the 2nd "
        f"passed {by_reference[1] / 1e6:.0f} MB by reference and copied nothing"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A library function that runs in parallel.")
    parser.add_argument("--fast", action="store_true", help="a small matrix (as the tests run)")
    if parser.parse_args().fast:
        main(rows=1024, cols=1024)
    else:
        main()
