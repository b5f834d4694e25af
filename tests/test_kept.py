"""Workers keep the mappings of argument copies between tasks.

A worker maps a copy segment copy-on-write for a task and keeps that mapping afterwards;
a later task that names the same segment reuses it, unless this worker wrote into it
(its written pages are its own, stale) or a view from an earlier task still lives on it.
Pages it never wrote show the segment's current content, so a segment the parent rewrote
from its pool reads right. The in-process tests drive the worker's functions directly.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import numpy as np
import pytest
import workers

import sharexec
from sharexec import _kept, _segments, _tracking
from sharexec._arrays import byte_bounds

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]

LARGE = 300_000  # float64 elements: 2.4 MB, above the 256 KiB default threshold


# ---------------------------------------------------------------------------------------
# Through an executor, under the default start method and spawn
# ---------------------------------------------------------------------------------------


def test_a_worker_reuses_its_mapping_of_a_copy(start_method, no_leaks):
    a = np.arange(LARGE, dtype=float)
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        first = ex.submit(workers.tag_and_sum, a).result()
        second = ex.submit(workers.tag_and_sum, a).result()
    assert first[0] == second[0] == a.sum()
    assert first[1] == second[1]  # the same mapping: not mapped afresh


def test_a_worker_keeps_its_mapping_of_a_shared_array_until_the_parent_frees_it(
    start_method, no_leaks
):
    import gc

    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        ex.submit(os.getpid).result()  # started first: a forked worker inherits no array
        shared = sharexec.zeros(LARGE)
        name = _tracking.find_shared(*byte_bounds(shared))[0].name
        first = ex.submit(workers.tag_and_sum, shared).result()
        ex.submit(workers.fill, shared, 2.0).result()  # a write, seen by the parent
        second = ex.submit(workers.tag_and_sum, shared).result()
        assert first[1] == second[1]  # the same mapping: not mapped afresh
        assert (first[0], second[0]) == (0.0, 2.0 * LARGE) and shared[-1] == 2.0
        assert name in ex.submit(workers.shared_mapped).result()
        del shared
        gc.collect()  # the parent keeps it warm for its next allocation: still mapped
        from sharexec._arrays import recycling

        assert name in recycling.names()
        assert name in ex.submit(workers.shared_mapped).result()
        recycling.clear()  # the parent frees it: the worker lets its mapping go next call
        gc.collect()
        assert name not in ex.submit(workers.shared_mapped).result()


def test_results_written_through_kept_lent_mappings_never_touch_live_results(
    start_method, no_leaks
):
    """A worker keeps its mapping of a segment lent for a result and writes through it
    when the segment is lent again: only once the result it held was collected."""
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        older: list[np.ndarray] = []
        for round_ in range(4):
            values = [10.0 * round_ + i for i in range(3)]
            results = [ex.submit(workers.make_private, LARGE, v).result() for v in values]
            for got, value in zip(results, values, strict=True):
                assert got[0] == got[-1] == value and float(got.sum()) == value * LARGE
            for got, value in older:  # alive all along: never lent, never written
                assert float(got.sum()) == value * LARGE
            older = list(zip(results, values, strict=True))[:1]  # the rest goes to the pool
            del results


def test_a_copy_a_task_wrote_into_is_pristine_for_the_next(start_method, no_leaks):
    a = np.full(LARGE, 1.0)
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        for where in (0, LARGE // 2, LARGE - 1):  # one page written is enough
            written, tag = ex.submit(workers.tag_and_sum, a, where).result()
            assert written == LARGE + 6
            pristine, other = ex.submit(workers.tag_and_sum, a).result()
            assert pristine == LARGE  # not the page the task before wrote
            assert other != tag  # mapped afresh
    assert (a == 1.0).all()


def test_a_kept_mapping_shows_what_the_parent_rewrote_from_its_pool(start_method, no_leaks):
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        names: set[str] = set()
        tags = []
        for i in range(8):  # same size: each copy goes into the segment the last one left
            total, tag = ex.submit(workers.tag_and_sum, np.full(LARGE, float(i))).result()
            assert total == LARGE * i  # never the bytes an earlier task saw there
            tags.append(tag)
            names |= set(ex._transport.pooled())
        assert len(names) <= 3  # the parent reused its segments…
        assert len(set(tags)) <= 3  # …and the worker its mappings of them


def test_a_view_a_task_kept_never_sees_a_later_task(start_method, no_leaks):
    a = np.full(LARGE, 1.0)
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        assert ex.submit(workers.keep_and_sum, a).result() == LARGE
        assert ex.submit(workers.tag_and_sum, a, 0).result()[0] == LARGE + 6
        assert ex.submit(workers.tag_and_sum, a).result()[0] == LARGE
        assert ex.submit(workers.kept_sums).result() == [10.0]


# ---------------------------------------------------------------------------------------
# The worker's functions, in this process
# ---------------------------------------------------------------------------------------


@pytest.fixture
def kept() -> Iterator[_kept.KeptMappings]:
    """Kept mappings of this test alone, dropped after it; no dropping thread here."""
    mappings = _kept.KeptMappings(dropping_thread=False)
    yield mappings
    mappings.drop_idle(mappings.last_task + mappings.idle_seconds)


def _segment(value: int, size: int = 1 << 20) -> _segments.Mapping:
    mapping = _tracking.new_private(size)
    mapping[:] = bytes([value]) * size
    return mapping


def test_written_tells_the_pages_this_process_wrote():
    segment = _segment(1)
    private = _tracking.attach_private(segment.name, len(segment))
    assert not _segments.written(private)
    assert private[:].count(1) == len(private)  # reading writes nothing
    assert not _segments.written(private)
    private[len(private) - 1] = 2
    assert _segments.written(private)
    private.close()


def _pages_mapped(mapping: _segments.Mapping, offset: int, length: int) -> int:
    """How many pages of the range this process has mapped now (/proc/self/pagemap)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = mapping.address + offset
    first, last = start // page, (start + length - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum())


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux's pagemap")
def test_populate_maps_a_range_for_writing_in_one_call():
    page = os.sysconf("SC_PAGE_SIZE")
    mapping = _tracking.new_shared(64 * page)  # reserved, not mapped here yet
    try:
        assert _pages_mapped(mapping, 0, len(mapping)) == 0
        _segments.populate(mapping, 3 * page + 100, 10 * page)  # from inside a page
        release = tuple(int(n) for n in re.findall(r"\d+", os.uname().release)[:2])
        if _segments._MADV_POPULATE_WRITE and release >= (5, 14):
            assert _pages_mapped(mapping, 0, len(mapping)) == 11  # pages 3 to 13
            assert _pages_mapped(mapping, 3 * page, 11 * page) == 11
        _segments.populate(mapping, 60 * page, 100 * page)  # clipped at the end
        assert bytes(mapping[:]) == bytes(len(mapping))  # still zeros, all of it
    finally:
        mapping.close()


def test_a_kept_mapping_is_reused_only_unwritten_and_with_no_view_left(kept):
    segment = _segment(1)
    name, size = segment.name, len(segment)
    first = kept.hold_copy(name, size)
    kept_mapping = kept.mapping(name)
    assert first.base.obj is kept_mapping
    second = kept.hold_copy(name, size)  # the first task's view lives: its own mapping
    assert second.base.obj is not kept_mapping
    assert first.base.obj is kept_mapping and first[0] == 1
    del first, second, kept_mapping
    kept.after_task([name])
    third = kept.hold_copy(name, size)
    assert third.base.obj is kept.mapping(name)  # reused
    third[5] = 9  # copy-on-write: this mapping is no longer the segment's
    del third
    kept.after_task([name])
    assert name not in kept.names()  # dropped as soon as its task was done
    fourth = kept.hold_copy(name, size)
    assert fourth[5] == 1
    segment[5] = 3  # the parent rewrites the segment (from its pool)
    del fourth
    kept.after_task([name])
    fifth = kept.hold_copy(name, size)
    assert fifth[5] == 3  # a kept mapping shows the segment's content


def test_kept_mappings_stay_within_their_bounds(kept):
    kept.max_mappings, kept.max_bytes = 2, 3 << 20
    segments = [_segment(i) for i in range(3)]
    for segment in segments:
        kept.hold_copy(segment.name, len(segment))
    assert kept.names() == [s.name for s in segments[1:]]  # the oldest went
    big = _segment(9, 2 << 20)
    kept.hold_copy(big.name, len(big))
    assert kept.names() == [segments[2].name, big.name]  # 3 MiB at most
    huge = _segment(9, 4 << 20)
    kept.hold_copy(huge.name, len(huge))
    assert kept.names() == [segments[2].name, big.name]  # never kept


def test_shared_mappings_are_kept_unless_this_process_owns_them(kept):
    owned = _tracking.new_shared(1 << 20)  # its views decide when it goes: not kept
    attached = _segments.attach(owned.name, len(owned), private=False)
    kept.keep_shared([owned, attached])
    assert kept.names() == [attached.name] and kept.mapping(attached.name) is attached


def test_a_lent_segment_is_written_shared_and_its_mapping_kept_for_the_next_loan(kept):
    segment = _segment(1)
    kept.hold_copy(segment.name, len(segment))  # kept as a private copy first (no view)
    lent = kept.attach_lent(segment.name, len(segment))
    lent[0:1] = b"\x2a"
    assert segment[0] == 42  # written through to the segment, not copied on write
    assert kept.attach_lent(segment.name, len(segment)) is lent  # kept
    name = segment.name
    del segment  # the parent frees it (the executor shut down): lending it again fails
    with pytest.raises(sharexec.SegmentError):
        kept.attach_lent(name, 1 << 20)


def test_a_mapping_kept_shared_is_never_reused_for_a_private_copy(kept):
    segment = _segment(1)
    lent = kept.attach_lent(segment.name, len(segment))
    holder = kept.hold_copy(segment.name, len(segment))  # the pool sends it as a copy
    holder[0] = 99
    assert segment[0] == lent[0] == 1  # the task's write stays its own
    assert kept.mapping(segment.name).private


def test_kept_mappings_of_freed_segments_are_dropped(kept):
    segments = [_segment(i) for i in range(3)]
    for segment in segments:
        kept.hold_copy(segment.name, len(segment))
    names = [s.name for s in segments]
    del segments[1]  # the parent frees it: unlinked
    kept.drop_unlinked()
    assert kept.names() == [names[0], names[2]]


def test_kept_mappings_are_dropped_after_a_while_without_tasks(kept):
    segment = _segment(1)
    kept.hold_copy(segment.name, len(segment))
    # A clock value seen in CI, where (last + 10.0) - last < 10.0 in floating point.
    last = kept.last_task = 2044.53662208
    wait = kept.drop_idle(last + 1.0)
    assert wait == pytest.approx(kept.idle_seconds - 1.0)
    assert segment.name in kept.names()
    assert kept.drop_idle(last + kept.idle_seconds) == kept.idle_seconds
    assert not kept.names()


def test_kept_mappings_of_freed_segments_are_dropped_between_tasks_too(kept):
    segments = [_segment(i) for i in range(2)]
    for segment in segments:
        kept.hold_copy(segment.name, len(segment))
    name = segments[1].name
    del segments[1], segment  # the parent frees it while this worker has no task
    kept.drop_idle(kept.last_task + 1.0)
    assert kept.names() == [segments[0].name] and name not in kept.names()


def test_a_worker_watches_removals_only_while_it_keeps_a_shared_mapping(kept):
    owned = _tracking.new_shared(1 << 20)
    kept.keep_shared([_segments.attach(owned.name, len(owned), private=False)])
    watch = kept.watch
    assert watch is not None and not kept.polling
    kept.drop_idle(kept.last_task + kept.idle_seconds)  # idle: all go
    assert not kept.names() and kept.watch is None
    with pytest.raises(OSError):
        os.fstat(watch)  # given back


def test_without_a_watch_the_dropping_thread_looks_every_so_often(kept, monkeypatch):
    monkeypatch.setattr(_segments, "removals", lambda: None)  # no inotify to be had
    owned = _tracking.new_shared(1 << 20)
    kept.keep_shared([_segments.attach(owned.name, len(owned), private=False)])
    assert kept.watch is None and kept.polling


def _removed_names(removals: int, timeout: float) -> set[str]:
    """The names inotify reports removed (``struct inotify_event``: wd, mask, cookie, len,
    then the name padded with NULs), waiting up to ``timeout`` for the first event."""
    import select
    import struct

    names: set[str] = set()
    if not select.select([removals], [], [], timeout)[0]:
        return names
    with contextlib.suppress(BlockingIOError):  # non-blocking: read until it is empty
        while data := os.read(removals, 1 << 16):
            while data:
                length = struct.unpack_from("iIII", data)[3]
                names.add(data[16 : 16 + length].rstrip(b"\0").decode())
                data = data[16 + length :]
    return names


def test_a_freed_segment_wakes_the_dropping_thread():
    """Between tasks, the dropping thread waits on removals from the shared-memory folder.

    Other programs on the machine remove names from that folder too, at any time: the
    test looks for its own segment's name among the removals, never for silence.
    """
    import time

    removals = _segments.removals()
    assert removals is not None  # Linux: inotify
    try:
        segment = _segment(1)
        name = segment.name
        assert name not in _removed_names(removals, 0)
        del segment  # unlinked
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while name not in seen and time.monotonic() < deadline:
            seen |= _removed_names(removals, deadline - time.monotonic())
        assert name in seen
    finally:
        os.close(removals)


def test_a_forked_child_does_not_take_its_parents_kept_mappings(kept):
    segment = _segment(1)
    kept.hold_copy(segment.name, len(segment))
    assert kept.names()
    kept.reset()  # as a forked child starts (the after-fork hook of the process's object)
    holder = kept.hold_copy(segment.name, len(segment))
    assert kept.names() == [segment.name]
    assert holder.base.obj is kept.mapping(segment.name)  # mapped afresh, in this process's table


def test_a_worker_is_not_restarted_for_the_copies_it_keeps_mapped(start_method, no_leaks):
    """loky restarts a worker whose resident memory grew past a limit; kept mappings of
    copies it only read are shared memory, not a leak: the worker stays."""
    pytest.importorskip("psutil")
    arrays = [np.full(4 << 20, float(i)) for i in range(3)]  # 32 MB each, twice the limit
    with sharexec.SharedProcessPoolExecutor(
        1,
        mp_context=start_method,
        initializer=workers.keep_mapped_and_tighten_loky_leak_check,
        initargs=(np.zeros(1),),
    ) as ex:
        first = ex.submit(workers.read_mapped, False).result()  # loky's reference size
        for a in arrays * 2:
            assert ex.submit(workers.tag_and_sum, a).result()[0] == a.sum()
        assert ex.submit(workers.read_mapped, False).result() == first
