"""What a worker imports: nothing heavy until a call or a result holds an array.

A worker imports NumPy (some 60 ms, most of a pool's start-up) only for a task that
carries or returns an array: a plain result is pickled as it is, and while NumPy is not
loaded no array can hide in a result, so the backward pass (and NumPy) is skipped unless
a buffer is large enough to share. Under fork a worker inherits the parent's modules,
NumPy among them: there, the same results still travel right. So under sharexec's
default, whose workers are forks of a server that imported NumPy once.
"""

from __future__ import annotations

import numpy as np
import plain_workers
import pytest
from plain_workers import Blob, Point

import sharexec
from sharexec import _segments


def test_a_worker_imports_numpy_only_for_arrays(start_method, no_leaks):
    # A forked worker starts with the parent's modules; one of sharexec's default (None)
    # with those its warm server imported, NumPy among them.
    fresh = start_method not in ("fork", None)
    # One worker, so that every task below runs in the same process.
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        heavy = ex.submit(plain_workers.heavy_modules).result()
        if fresh:
            assert heavy == []
        # a plain result, a rich one, a small protocol-5 buffer: none needs NumPy
        plain = (1, 2.5, "a", None, b"b")
        assert ex.submit(plain_workers.echo, plain).result() == plain
        assert ex.submit(plain_workers.point, 3).result() == Point(3, {"a", "b"})
        small = ex.submit(plain_workers.blob, 10).result()
        assert type(small) is Blob and bytes(small.data) == b"x" * 10
        if fresh:
            assert ex.submit(plain_workers.heavy_modules).result() == []
        # an array among the arguments: NumPy and the rebuilding of views, not the
        # backward pass (the result is a plain list)
        heavy = ex.submit(plain_workers.heavy_modules, np.ones(100_000)).result()
        assert {"numpy", "sharexec._arrays"} <= set(heavy)
        if fresh:
            assert "sharexec._reduction" not in heavy


def test_a_large_buffer_returned_without_numpy_still_comes_through_a_segment(
    start_method, no_leaks
):
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        got = ex.submit(plain_workers.blob, 1 << 20).result()
        assert bytes(got.data) == b"x" * (1 << 20)
        # rebuilt over the segment the worker filled (and the parent adopted)
        owner = got.data
        while not isinstance(owner, _segments.Mapping) and owner is not None:
            owner = owner.obj if isinstance(owner, memoryview) else owner.base
        assert isinstance(owner, _segments.Mapping)
        del owner
        del got
        # the worker took the backward pass for it
        assert "sharexec._reduction" in ex.submit(plain_workers.heavy_modules).result()


def test_a_workers_collector_leaves_what_it_started_with_alone(start_method, no_leaks):
    """A worker's heap at its start (a fork's copy of its server's or its parent's, or
    what a spawned worker imported) is frozen: loky's worker collects after its first
    task, and a walk over that heap took 40-80 ms and copied every page holding an
    object (22 MiB with SciPy and scikit-image). Cycles made later are still freed."""
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        for _ in range(2):  # before and after loky's collection following a first task
            frozen, freed = ex.submit(plain_workers.collector_state).result()
            assert frozen > 1000, frozen
            assert freed


@pytest.mark.transport
def test_a_long_list_of_plain_values_comes_back(executor):
    values = [*range(1000), "a", 2.5, None]
    assert executor.submit(plain_workers.echo, values).result() == values


def test_a_worker_is_not_restarted_for_shared_memory_it_merely_maps(start_method, no_leaks):
    """loky restarts a worker whose resident memory grew past a limit (a leak, for it);
    reading a shared array counts no private memory: the worker stays."""
    pytest.importorskip("psutil")
    import workers

    big = sharexec.ones(8 << 20)  # 64 MB, four times the limit set in the worker
    with sharexec.SharedProcessPoolExecutor(
        1,
        mp_context=start_method,
        initializer=workers.keep_mapped_and_tighten_loky_leak_check,
        initargs=(big,),
    ) as ex:
        first = ex.submit(workers.read_mapped, False).result()  # loky's reference size
        pids = [ex.submit(workers.read_mapped, True).result() for _ in range(4)]
    assert pids == [first] * 4
