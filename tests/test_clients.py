"""Third-party code that takes an executor works unchanged.

Real clients, each checked by value under the default start method and spawn: scipy's
``differential_evolution(workers=ex.map)``, ``dask.compute(scheduler=ex)`` on a few hundred
MB, and the ``wait(FIRST_EXCEPTION)`` / ``as_completed`` pattern with large arrays; and
SciPy among the packages the warm server preloads for the default start method. scipy
and dask come from the optional ``clients`` extra (``pip install -e '.[test,clients]'``);
without them their tests are skipped, and the others still run.
"""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Executor, ProcessPoolExecutor
from typing import Any

import numpy as np
import pytest

import sharexec

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]

# differential_evolution: a small, quick problem (45 members x 31 generations).
DE_BOUNDS = [(-2.0, 2.0)] * 3
DE_OPTIONS: dict[str, Any] = {"updating": "deferred", "rng": 1234, "maxiter": 30}

# dask: 6000 x 6000 float64 = 288 MB, in 9 chunks of 32 MB.
DASK_SHAPE = (6000, 6000)
DASK_CHUNKS = (2000, 2000)

# as_completed / wait: 8 tasks of 16 MB each, the one at BAD raising.
N_TASKS = 8
TASK_ELEMENTS = 2_000_000
BAD = 1


# ---------------------------------------------------------------------------------------
# scipy.optimize.differential_evolution(workers=ex.map)
# ---------------------------------------------------------------------------------------


@functools.cache
def serial_de() -> Any:
    from scipy.optimize import differential_evolution, rosen

    return differential_evolution(rosen, DE_BOUNDS, **DE_OPTIONS)


def test_differential_evolution_is_deterministic_serially():
    """The premise of the comparison below: same seed, same deferred run, same result."""
    pytest.importorskip("scipy")
    from scipy.optimize import differential_evolution, rosen

    first = serial_de()
    again = differential_evolution(rosen, DE_BOUNDS, **DE_OPTIONS)
    through_map = differential_evolution(rosen, DE_BOUNDS, workers=map, **DE_OPTIONS)
    for other in (again, through_map):
        assert other.x.tolist() == first.x.tolist()
        assert other.fun == first.fun
        assert (other.nfev, other.nit) == (first.nfev, first.nit)


def test_differential_evolution_with_executor_map(executor):
    pytest.importorskip("scipy")
    from scipy.optimize import differential_evolution, rosen

    expected = serial_de()
    got = differential_evolution(rosen, DE_BOUNDS, workers=executor.map, **DE_OPTIONS)
    assert got.x.tolist() == expected.x.tolist()  # bit for bit
    assert got.fun == expected.fun
    assert (got.nfev, got.nit, got.message) == (expected.nfev, expected.nit, expected.message)
    assert np.allclose(got.x, 1.0, atol=1e-4)  # and it did find the minimum


# ---------------------------------------------------------------------------------------
# dask.compute(..., scheduler=ex)
# ---------------------------------------------------------------------------------------


def dask_graph() -> tuple[Any, ...]:
    """Column sums of x + x.T, and the mean and std of x, for a seeded 288 MB x."""
    import dask.array as da

    x = da.random.default_rng(0).random(DASK_SHAPE, chunks=DASK_CHUNKS)
    return (x + x.T).sum(axis=0), x.mean(), x.std()


@functools.cache
def dask_sync() -> tuple[Any, ...]:
    import dask

    return tuple(dask.compute(*dask_graph(), scheduler="sync"))


def test_dask_compute_with_executor_as_scheduler(executor):
    dask = pytest.importorskip("dask")
    pytest.importorskip("dask.array")

    expected = dask_sync()
    # dask takes any concurrent.futures.Executor, and its _max_workers as num_workers.
    assert isinstance(executor, Executor)
    assert executor._max_workers == 2
    got = dask.compute(*dask_graph(), scheduler=executor)
    # Exactly equal: the same graph runs the same numpy operations on the same chunks in
    # the same order; only the process that runs each task differs, and sharexec hands
    # the chunks over bit for bit.
    assert got[0].shape == (DASK_SHAPE[1],)
    np.testing.assert_array_equal(got[0], expected[0])
    assert got[1] == expected[1]
    assert got[2] == expected[2]
    assert abs(got[1] - 0.5) < 1e-3 and abs(got[2] - 12**-0.5) < 1e-3  # uniform on [0, 1)


# ---------------------------------------------------------------------------------------
# concurrent.futures.wait(FIRST_EXCEPTION) and as_completed with large arrays
# ---------------------------------------------------------------------------------------


def double_or_raise(a: np.ndarray, i: int, go: Any) -> np.ndarray:
    """Task ``BAD`` fails at once; the others wait for ``go``, then return a 16 MB result."""
    if i == BAD:
        raise ValueError(f"task {i} refused an array of {a.nbytes} bytes")
    if not go.wait(60):
        raise TimeoutError("never told to go")
    return a * 2


def test_first_exception_and_as_completed_with_large_arrays(executor):
    rng = np.random.default_rng(3)
    arrays = [rng.random(TASK_ELEMENTS) for _ in range(N_TASKS)]  # 16 MB each
    message = f"task {BAD} refused an array of {TASK_ELEMENTS * 8} bytes"
    with multiprocessing.get_context("spawn").Manager() as manager:
        go = manager.Event()
        futures = [executor.submit(double_or_raise, a, i, go) for i, a in enumerate(arrays)]
        bad = futures[BAD]
        # The others are held until the failure is seen: wait must return on it alone.
        done, not_done = concurrent.futures.wait(futures, timeout=60, return_when=FIRST_EXCEPTION)
        assert done == {bad}
        assert len(not_done) == N_TASKS - 1
        error = bad.exception()
        assert type(error) is ValueError
        assert str(error) == message
        assert "double_or_raise" in str(error.__cause__)  # the remote traceback
        go.set()

        seen = []
        for future in concurrent.futures.as_completed(futures, timeout=60):
            i = futures.index(future)
            seen.append(i)
            if i == BAD:
                with pytest.raises(ValueError, match=f"^{message}$"):
                    future.result()
            else:
                result = future.result()
                assert type(result) is np.ndarray and result.dtype == np.float64
                np.testing.assert_array_equal(result, arrays[i] * 2)
        assert sorted(seen) == list(range(N_TASKS))


# ---------------------------------------------------------------------------------------
# Code written against concurrent.futures.Executor / ProcessPoolExecutor
# ---------------------------------------------------------------------------------------


def chunk_stats(chunk: np.ndarray) -> tuple[float, float]:
    return float(chunk.sum()), float(chunk.max())


def run_all(
    executor: Executor, fn: Callable[[np.ndarray], Any], chunks: Iterable[np.ndarray]
) -> tuple[list[Any], list[Any]]:
    """Library code typed for any Executor: submit + wait, then map with a chunksize."""
    chunks = list(chunks)
    futures = [executor.submit(fn, chunk) for chunk in chunks]
    concurrent.futures.wait(futures, timeout=60)
    return [f.result() for f in futures], list(executor.map(fn, chunks, timeout=60, chunksize=3))


def make_and_run(
    executor_class: Callable[..., Executor], mp_context: Any, chunks: list[np.ndarray]
) -> tuple[list[Any], list[Any]]:
    """Library code that builds its own pool, by the stdlib's constructor signature."""
    with executor_class(max_workers=2, mp_context=mp_context) as ex:
        return run_all(ex, chunk_stats, chunks)


def test_is_an_executor_and_runs_executor_typed_code(executor):
    assert isinstance(executor, concurrent.futures.Executor)
    chunks = np.array_split(np.random.default_rng(4).random(3_000_000), 10)  # 2.4 MB each
    expected = [chunk_stats(c) for c in chunks]
    assert run_all(executor, chunk_stats, chunks) == (expected, expected)


def test_same_results_as_the_stdlib_executor(mp_context, no_leaks):
    """The same library function, given either class (the stdlib takes loky's context too)."""
    chunks = np.array_split(np.random.default_rng(5).random(1_000_000), 6)
    stdlib = make_and_run(ProcessPoolExecutor, mp_context, chunks)
    ours = make_and_run(sharexec.SharedProcessPoolExecutor, mp_context, chunks)
    assert ours == stdlib
    assert ours[0] == [chunk_stats(c) for c in chunks]


# ---------------------------------------------------------------------------------------
# The warm server preloads SciPy for the workers of the default start method
# ---------------------------------------------------------------------------------------


def test_scipy_whose_blas_pool_stops_at_a_fork_is_preloaded(tmp_path):
    # SciPy's own OpenBLAS starts a thread pool at import, and stops it at each fork:
    # not a thread that makes the warm server unfit to fork from (tests/test_startup.py).
    pytest.importorskip("scipy.linalg")
    from test_startup import run_program

    report, _, _ = run_program(tmp_path, "import scipy.linalg")
    assert report["present"] == ["scipy.linalg"]
    assert report["left_out"] == [] and report["server_threads"] == 1
