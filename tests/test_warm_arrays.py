"""Warm allocations: the segment of a collected shared array serves the next
allocation of a size it fits, zeroed or filled as the allocator promises, and only if no
other process may still see it.

Each test judges only the segments of arrays it made: by name, through
``_tracking.find_shared`` and the pool's ``names()``.
"""

from __future__ import annotations

import gc
import multiprocessing

import numpy as np
import pytest
import startup_workers as sw
import warm_workers as ww

import sharexec
from sharexec import _arrays, _tracking
from sharexec._config import WARM_SEGMENTS

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]

N = 1 << 18  # 2 MiB of float64: above min_share_bytes, a segment of its own


def segment_of(a: np.ndarray) -> str:
    found = _tracking.find_shared(*_arrays.byte_bounds(a))
    assert found is not None
    return found[0].name


def start_workers(ex: sharexec.SharedProcessPoolExecutor, n: int, folder: str) -> None:
    """Have ``ex`` start ``n`` workers now: under fork, a worker forked while an array
    lives inherits it, and that array never serves again (the next tests' arrays come
    after)."""
    assert len(set(ex.map(sw.rendezvous, [folder] * n, [n] * n))) == n


def pooled() -> list[str]:
    gc.collect()
    return _arrays.recycling.names()


@pytest.mark.parametrize(
    "allocate",
    [
        lambda: sharexec.zeros(N),
        lambda: sharexec.empty(N),
        lambda: sharexec.zeros_like(np.ones(N)),
        lambda: sharexec.empty_like(np.ones(N)),
        lambda: sharexec.zeros((N // 4, 4), dtype=np.int32, order="F"),
    ],
    ids=["zeros", "empty", "zeros_like", "empty_like", "zeros_int32_F"],
)
def test_a_warm_segment_serves_again_and_reads_as_zeros(allocate, no_leaks):
    old = sharexec.full(N, 7.0)
    name = segment_of(old)
    del old
    assert name in pooled()
    new = allocate()
    assert segment_of(new) == name  # served warm
    assert name not in pooled()
    assert not new.any()  # never the old array's bytes


def test_full_ones_and_share_overwrite_every_element_of_a_warm_segment(no_leaks):
    for make, expected in [
        (lambda: sharexec.full(N, 3.5), np.full(N, 3.5)),
        (lambda: sharexec.ones(N), np.ones(N)),
        (lambda: sharexec.full_like(np.zeros(N), -1.0), np.full(N, -1.0)),
        (lambda: sharexec.share(np.arange(N, dtype=float)), np.arange(N, dtype=float)),
    ]:
        old = sharexec.full(N, 7.0)
        name = segment_of(old)
        del old
        assert name in pooled()
        new = make()
        assert segment_of(new) == name
        assert np.array_equal(new, expected)
        del new


def test_an_array_written_by_workers_serves_again_once_their_views_are_gone(
    start_method, no_leaks, tmp_path
):
    with sharexec.SharedProcessPoolExecutor(2, mp_context=start_method) as ex:
        start_workers(ex, 2, str(tmp_path))
        out = sharexec.zeros(N)
        name = segment_of(out)
        parts = np.array_split(out, 4)
        list(ex.map(ww.fill, parts, [1.0, 2.0, 3.0, 4.0]))
        assert out[0] == 1.0 and out[-1] == 4.0
        del out, parts
        assert name in pooled()
        again = sharexec.zeros(N)
        assert segment_of(again) == name and not again.any()


def test_a_view_a_worker_keeps_keeps_the_segment_out_of_the_pool(start_method, no_leaks):
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        out = sharexec.zeros(N)
        name = segment_of(out)
        ex.submit(ww.fill_and_keep, out, 2.0).result()
        del out
        assert name not in pooled()
        new = sharexec.full(N, 5.0)  # another segment: the worker's view never sees it
        assert segment_of(new) != name
        assert ex.submit(ww.kept_sum).result() == 2.0 * N


def test_an_array_in_flight_is_not_served_again_until_its_task_is_done(
    start_method, no_leaks, tmp_path
):
    with (
        sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex,
        multiprocessing.get_context("spawn").Manager() as manager,
    ):
        start_workers(ex, 1, str(tmp_path))
        go = manager.Event()
        out = sharexec.zeros(N)
        name = segment_of(out)
        running = ex.submit(ww.wait_then_fill, out, go, 9.0)
        del out  # the task still refers to it
        assert name not in pooled()
        other = sharexec.zeros(N)
        assert segment_of(other) != name
        go.set()
        assert running.result() is True
        del running
        assert name in pooled()
        assert not other.any()  # the task wrote its own array only


def test_an_array_alive_when_a_worker_is_forked_never_serves_again(no_leaks):
    out = sharexec.zeros(N)
    name = segment_of(out)
    with sharexec.SharedProcessPoolExecutor(1, mp_context="fork") as ex:
        ex.submit(sw.pid).result()  # the worker, forked now, inherits ``out``
        del out
        assert name not in pooled()


def test_an_array_sent_through_multiprocessing_never_serves_again(no_leaks):
    out = sharexec.zeros(N)
    name = segment_of(out)
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=ww.fill, args=(out[:10], 1.0))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert out[0] == 1.0
    del out, process
    assert name not in pooled()


def test_the_pool_of_warm_shared_segments_keeps_its_bounds(no_leaks):
    arrays = [sharexec.zeros(N + i * 512) for i in range(WARM_SEGMENTS + 4)]
    del arrays
    count, size = _arrays.recycling.totals()
    assert count <= WARM_SEGMENTS
    limit = _arrays.recycling._pool._limit  # type: ignore[union-attr]
    assert size <= limit
