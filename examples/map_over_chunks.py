"""
Map over the chunks of a large array
====================================

``executor.map`` over the chunks of a large private array, and a large result back.

Each chunk is copied once into shared memory (no pickling through the pipe) and seen by
its worker as a zero-copy view; the big result comes back through shared memory too.

Run: ``python examples/map_over_chunks.py`` (``--fast``: a small array).
"""

from __future__ import annotations

import argparse

import numpy as np

import sharexec


def chunk_stats(chunk: np.ndarray) -> tuple[float, float]:
    return float(chunk.min()), float(chunk.max())


def main(n: int = 25_000_000) -> None:
    a = np.random.default_rng(0).standard_normal(n)  # 200 MB, ordinary memory
    with sharexec.SharedProcessPoolExecutor() as ex:
        stats = list(ex.map(chunk_stats, np.array_split(a, 32)))
        root = ex.submit(np.sqrt, np.abs(a)).result()
    assert min(s[0] for s in stats) == a.min() and max(s[1] for s in stats) == a.max()
    assert np.array_equal(root, np.sqrt(np.abs(a)))
    print(f"min {a.min():.4f}, max {a.max():.4f}, mean sqrt|a| {root.mean():.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Map over the chunks of a large array.")
    parser.add_argument("--fast", action="store_true", help="a small array (as the tests run)")
    if parser.parse_args().fast:
        main(n=2_000_000)
    else:
        main()
