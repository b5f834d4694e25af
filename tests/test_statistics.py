"""``statistics()``: each field means what its name says, under the default start method
and spawn.

One worker, and each call waits for its result, so that every count is exact. The
segment counts are the process's: each test reads them against a baseline taken first.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import sharexec

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]

MiB = 1 << 20


def test_a_gappy_view_sent_once_is_copied_not_reused(start_method, no_leaks):
    image = np.random.default_rng(0).random((2048, 2048))  # 32 MiB
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        ex.submit(np.sum, image[:1024, :1024]).result()
        once = ex.statistics()
        ex.submit(np.sum, image[:1024, :1024]).result()
        twice = ex.statistics()
    assert (once.bytes_copied, once.bytes_reused) == (8 * MiB, 0)
    # A gappy view is copied compactly each time (a new temporary): never "reused".
    assert (twice.bytes_copied, twice.bytes_reused) == (16 * MiB, 0)


def test_an_array_sent_again_reuses_its_copy_and_two_views_share_one(start_method, no_leaks):
    a = np.ones(MiB)  # 8 MiB
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        ex.submit(np.sum, a).result()
        ex.submit(np.sum, a).result()
        again = ex.statistics()
        ex.submit(np.add, a, a[::-1]).result()  # one copy of the base serves both views
        both = ex.statistics()
    assert (again.bytes_copied, again.bytes_reused) == (8 * MiB, 8 * MiB)
    assert (both.bytes_copied, both.bytes_reused) == (8 * MiB, 8 * MiB + 16 * MiB)


def test_the_pool_is_reported_apart_from_live_data(start_method, no_leaks):
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        base = ex.statistics()
        results = [ex.submit(np.full, MiB, float(i)).result() for i in range(3)]  # 8 MiB
        a = np.ones(MiB)
        ex.submit(np.sum, a).result()
        held = ex.statistics()
        del results
        collected = ex.statistics()
    # While the results are held, they are live data; the argument's copy is pooled.
    assert held.segments_live - base.segments_live == 3
    assert held.bytes_in_shared_memory - base.bytes_in_shared_memory == 3 * 8 * MiB
    assert held.segments_pooled >= 1 and held.bytes_pooled >= 8 * MiB
    # Once collected, nothing of the user's is live: their segments went to the pool.
    assert collected.segments_live == base.segments_live
    assert collected.bytes_in_shared_memory == base.bytes_in_shared_memory
    assert collected.segments_pooled == held.segments_pooled + 3
    assert collected.bytes_pooled == held.bytes_pooled + 3 * 8 * MiB


def test_by_reference_counts_what_each_task_can_reach(start_method, no_leaks):
    data = sharexec.zeros(MiB)  # 8 MiB, shared
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        list(ex.map(np.sum, np.array_split(data, 64)))  # 64 slices: the array, once
        slices = ex.statistics()
        ex.submit(np.sum, data[::1024]).result()  # 1024 elements
        strided = ex.statistics()
        ex.submit(np.sum, np.broadcast_to(data[:1], (10 * MiB,))).result()  # 80 MiB of view
        broadcast = ex.statistics()
    assert slices.bytes_by_reference == data.nbytes
    assert strided.bytes_by_reference - slices.bytes_by_reference == 1024 * 8
    # A view with more elements than its segment has bytes counts at most the segment.
    assert 0 < broadcast.bytes_by_reference - strided.bytes_by_reference <= data.nbytes
    assert slices.bytes_copied == slices.bytes_reused == 0
    del data


def test_every_field_is_documented():
    doc = sharexec.Statistics.__doc__ or ""
    for field in dataclasses.fields(sharexec.Statistics):
        assert field.name in doc, field.name
