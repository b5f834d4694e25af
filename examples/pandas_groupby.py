"""
A pandas groupby across workers
===============================

Split a large DataFrame by rows, aggregate each part in a worker, combine the parts.

pandas DataFrames pickle their columns as out-of-band buffers (pickle protocol 5), so
each chunk of rows goes to its worker through shared memory, like a NumPy array: copied
once, no pickling through the pipe. Each worker returns small partial aggregates per
group; sums, counts, minimums and maximums combine exactly, and the mean is the combined
sum over the combined count. Needs pandas (``pip install 'sharexec[clients]'``).

Run: ``python examples/pandas_groupby.py`` (``--fast``: fewer rows).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

import sharexec

try:
    import pandas as pd
except ImportError:
    sys.exit("pandas_groupby.py needs pandas: pip install pandas (or 'sharexec[clients]')")


def partial_aggregates(chunk: pd.DataFrame) -> pd.DataFrame:
    """Per store: rows, units sold, revenue, and the lowest and highest price."""
    return chunk.groupby("store").agg(
        rows=("units", "size"),
        units=("units", "sum"),
        revenue=("revenue", "sum"),
        low=("price", "min"),
        high=("price", "max"),
    )


def combine(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """The aggregates of the whole frame, from those of its parts."""
    by_store = pd.concat(parts).groupby(level="store")
    combined = by_store.agg({"rows": "sum", "units": "sum", "revenue": "sum"})
    combined["low"] = by_store["low"].min()
    combined["high"] = by_store["high"].max()
    combined["mean_revenue"] = combined["revenue"] / combined["rows"]
    return combined


def sales(rows: int, stores: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    units = rng.integers(1, 20, rows)
    price = rng.uniform(0.5, 100.0, rows).round(2)
    return pd.DataFrame(
        {
            "store": rng.integers(0, stores, rows).astype(np.int32),
            "units": units,
            "price": price,
            "revenue": units * price,
        }
    )


def main(rows: int = 4_000_000, stores: int = 1000, chunks: int = 16) -> None:
    df = sales(rows, stores)  # 112 MB for 4 million rows, ordinary memory
    bounds = np.linspace(0, rows, chunks + 1).astype(int)
    with sharexec.SharedProcessPoolExecutor() as ex:
        parts = list(
            ex.map(partial_aggregates, [df.iloc[lo:hi] for lo, hi in itertools.pairwise(bounds)])
        )
        stats = ex.statistics()
    got = combine(parts)

    # The same groupby in this process, on the whole frame.
    serial = df.groupby("store").agg(
        rows=("units", "size"),
        units=("units", "sum"),
        revenue=("revenue", "sum"),
        low=("price", "min"),
        high=("price", "max"),
        mean_revenue=("revenue", "mean"),
    )
    assert got.index.equals(serial.index)
    for column in ["rows", "units", "low", "high"]:  # integers, minimums, maximums: exact
        assert np.array_equal(got[column], serial[column]), column
    for column in ["revenue", "mean_revenue"]:  # float sums added in another order
        assert np.allclose(got[column], serial[column], rtol=1e-12, atol=0), column
    print(
        f"grouped {rows:,} rows into {len(got)} stores over {chunks} chunks "
        f"({stats.bytes_copied / 1e6:.0f} MB through shared memory); "
        f"{got['units'].sum():,} units, revenue {got['revenue'].sum():,.2f}, as serial pandas"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A pandas groupby across workers.")
    parser.add_argument("--fast", action="store_true", help="fewer rows (as the tests run)")
    if parser.parse_args().fast:
        main(rows=200_000, stores=100, chunks=4)
    else:
        main()
