"""Protocol-5 objects beyond numpy: pandas, pyarrow, scipy.sparse.

Their large buffers go through shared memory (statistics() shows the bytes), they come
back exact, and they keep copy semantics: a worker's writes never reach the parent
(docs/how-it-works.md, "What is shared, and with which semantics").
"""

from __future__ import annotations

import numpy as np
import pytest
import workers
from test_lifetime import callbacks_done

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]

N = 200_000  # rows: each numeric column is 1.6 MB, above min_share_bytes


def shared_bytes(executor, fn, *args):
    before = executor.statistics()
    future = executor.submit(fn, *args)
    done = callbacks_done(future)
    result = future.result()
    assert done.wait(60)
    after = executor.statistics()
    return (
        result,
        after.bytes_copied + after.bytes_reused - before.bytes_copied - before.bytes_reused,
    )


def test_pandas_dataframe_round_trips_through_shared_memory(executor):
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(0)
    df = pd.DataFrame(
        {
            "x": rng.random(N),
            "n": rng.integers(0, 1000, N),
            "cat": pd.Categorical(rng.choice(["a", "b", "c"], N)),
            "s": pd.Series(rng.choice(["alpha", "beta", "gamma"], N), dtype="string"),
            "t": pd.date_range("2020-01-01", periods=N, freq="s"),
        }
    )
    back, moved = shared_bytes(executor, workers.identity, df)
    pd.testing.assert_frame_equal(back, df)
    # float, int and datetime columns (1.6 MB each) and the categorical codes at least
    assert moved >= 3 * 8 * N
    # copy semantics: the worker writes into its copy, the parent's frame is untouched
    before = df.copy()
    got = executor.submit(_scale_in_place, df).result()
    assert got == pytest.approx(float((before["x"] * 10).sum()))
    pd.testing.assert_frame_equal(df, before)


def _scale_in_place(df):
    df["x"] *= 10
    return float(df["x"].sum())


def test_pandas_result_comes_back_exact(executor):
    pd = pytest.importorskip("pandas")
    back = executor.submit(_make_frame, N).result()
    pd.testing.assert_frame_equal(back, _make_frame(N))
    back.loc[0, "x"] = -1.0  # a private, writable result


def _make_frame(n):
    import pandas as pd

    return pd.DataFrame({"x": np.arange(n, dtype=float), "g": np.arange(n) % 7})


def test_pyarrow_table_round_trips_through_shared_memory(executor):
    pa = pytest.importorskip("pyarrow")
    table = pa.table(
        {
            "x": pa.array(np.random.default_rng(1).random(N)),
            "s": pa.array([f"row-{i}" for i in range(N)]),
        }
    )
    back, moved = shared_bytes(executor, workers.identity, table)
    assert back.equals(table)
    assert moved >= 8 * N  # the float column's buffer, out of band


def test_scipy_sparse_matrix_round_trips_through_shared_memory(executor):
    sparse = pytest.importorskip("scipy.sparse")
    m = sparse.random(2000, 2000, density=0.05, format="csr", random_state=2)
    back, moved = shared_bytes(executor, workers.identity, m)
    assert back.format == "csr" and (back != m).nnz == 0
    assert np.array_equal(back.indptr, m.indptr) and np.array_equal(back.data, m.data)
    assert moved >= m.data.nbytes
    before = m.copy()
    executor.submit(_zero_data, m).result()
    assert (m != before).nnz == 0


def _zero_data(m):
    m.data[:] = 0
    return m.nnz
