"""Segment lifetimes on the normal paths: nothing outlives its last user."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import workers
from conftest import segments_now

import sharexec
from sharexec import _segments, _tracking
from sharexec._arrays import byte_bounds

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]


def segment_of(a: np.ndarray) -> str:
    found = _tracking.find_shared(*byte_bounds(a))
    assert found is not None
    return found[0].name


def test_shared_array_is_unlinked_with_its_last_view(no_leaks):
    a = sharexec.zeros(1000)
    name = segment_of(a)
    view = a[10:20].T
    del a
    gc.collect()
    assert name in segments_now()
    view[0] = 1.0  # still usable
    del view
    gc.collect()
    assert name not in segments_now()


def callbacks_done(future) -> threading.Event:
    """Set once the done-callbacks registered before this one (sharexec's release) ran.

    Call it right after submit: callbacks run in the order they were added, while one
    added to a future already done runs at once, maybe before those of the manager.
    """
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done


def test_task_segments_are_released_when_the_future_completes(executor):
    before = segments_now()
    a = np.ones(300_000)
    future = executor.submit(workers.total, a)
    released = callbacks_done(future)
    assert future.result() == a.size
    assert released.wait(60)
    # unlinked, or kept warm in the executor's pool for the next copy (until shutdown)
    assert segments_now() - before <= set(executor._transport.pooled())
    executor.shutdown()
    gc.collect()
    assert segments_now() == before


def test_failed_task_releases_its_segments(executor):
    before = segments_now()
    future = executor.submit(workers.raise_value_error, np.ones(300_000))
    released = callbacks_done(future)
    with pytest.raises(ValueError):
        future.result()
    assert released.wait(60)
    assert segments_now() == before  # no release news from a failed task: never pooled


def test_result_segments_are_the_parents_then_pooled_then_lent_for_the_next_result(executor):
    """A large result comes back in a segment this process owns (the sweeper frees it
    if this process dies), mapped by no other process: private semantics. Once the
    result is collected, its segment joins the pool and is lent to the function's next
    task for its result; the pool is unlinked at shutdown (no_leaks checks)."""
    r = executor.submit(workers.make_private, 300_000, 1.0).result()
    base = r
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.obj if isinstance(base, memoryview) else base.base
    assert isinstance(base, _segments.Mapping)
    assert base.name in segments_now() and _tracking.owns(base)
    assert not sharexec.is_shared(r)
    name = base.name
    del r, base
    gc.collect()
    assert executor._transport.pooled() == [name]
    again = executor.submit(workers.make_private, 300_000, 2.0).result()
    assert again.sum() == 600_000.0
    assert executor._transport.pooled() == []  # lent, and holding the new result
    assert executor.statistics().segments_live == 1


def test_a_lent_segment_the_result_does_not_need_goes_back_to_the_pool(executor):
    r = executor.submit(workers.make_private, 300_000, 1.0).result()
    del r
    gc.collect()
    (name,) = executor._transport.pooled()
    future = executor.submit(workers.make_private, 10, 1.0)  # lent that one: too big
    released = callbacks_done(future)
    assert future.result().sum() == 10.0
    assert released.wait(60)
    assert executor._transport.pooled() == [name]


def test_worker_frees_the_shared_arrays_it_keeps_to_itself(executor):
    name = executor.submit(_allocate_and_drop).result()
    assert name.startswith("sharexec-") and name not in segments_now()


def _allocate_and_drop():
    a = sharexec.zeros(100)
    return segment_of(a)


def test_handed_over_shared_array_is_freed_by_the_parent(executor):
    r = executor.submit(workers.make_shared, 1000, 1.0).result()
    name = segment_of(r)
    assert name in segments_now()
    del r
    gc.collect()
    assert name not in segments_now()


def test_forked_child_never_frees_its_parents_segments(no_leaks):
    import multiprocessing

    a = sharexec.zeros(10)
    name = segment_of(a)
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_drop_everything, args=(a,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert name in segments_now()
    assert a[0] == 5.0  # the child's write, through the inherited mapping


def _drop_everything(a):
    a[0] = 5.0
    del a
    gc.collect()
    for obj in gc.get_objects():
        # type(), not isinstance(): that reads __class__, which some objects (torch's
        # deprecated aliases, where torch is loaded) answer with a warning
        if type(obj) is _tracking.Segment:
            obj._finalizer()  # even a finalizer run by force does nothing in a child


def test_nothing_left_after_exit_of_a_program_using_everything(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np, sharexec
            keep = sharexec.zeros(1000)

            def f(a, b):
                return a * 2, sharexec.full(10, 3.0), b

            if __name__ == "__main__":
                with sharexec.SharedProcessPoolExecutor(2, mp_context="spawn") as ex:
                    r = ex.submit(f, np.ones(300_000), keep[::2]).result()
                    assert r[0].sum() == 600_000 and r[1].sum() == 30.0
                print("ok")
            """
        )
    )
    before = segments_now()
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "ok", out.stderr
    assert segments_now() == before


def test_a_pooled_segment_idle_too_long_is_dropped_and_unlinked(no_leaks):
    """A warm segment unused for WARM_IDLE_SECONDS leaves the pool at its next use (and
    so is unlinked), the younger ones stay; the pool's bounds hold as segments come in.
    (The timer that trims an idle pool calls the same trim.)"""
    from sharexec import _config, _warm

    pool = _warm.SegmentPool(limit=3 * 8192, count=2)
    old, young, third = (_tracking.new_shared(8192) for _ in range(3))
    names = [m.name for m in (old, young, third)]
    pool.put(old)
    pool.put(young)
    del old, young
    # the first came in longer ago than the pool keeps an idle segment
    entry = pool._pool[0]
    pool._pool[0] = (entry[0], entry[1] - _config.WARM_IDLE_SECONDS - 1)
    del entry
    assert pool.take(1 << 30) is None  # nothing that large: a use that trims
    gc.collect()
    assert pool.names() == [names[1]]
    assert names[0] not in segments_now()  # dropped: unlinked
    pool.put(third)
    del third
    assert pool.totals() == (2, 2 * 8192)
    pool.put(_tracking.new_shared(8192))  # one more than its count: the oldest goes
    gc.collect()
    assert len(pool) == 2 and names[1] not in pool.names()
    assert names[1] not in segments_now()
    pool.close()


def test_an_idle_pool_frees_each_segment_when_it_has_been_idle_long_enough(no_leaks):
    """Each pooled segment is freed ``idle_seconds`` after it came back to the pool,
    within the trim's slack, not at the next tick of a timer started by an older one;
    never before."""
    import time

    from sharexec import _warm

    idle = 2.0
    pool = _warm.SegmentPool(limit=1 << 20, idle_seconds=idle)
    pool.put(_tracking.new_shared(8192))  # the pool's timer starts now
    time.sleep(idle / 2)  # the scenario: a second use, halfway to the first one's end
    second = _tracking.new_shared(8192)
    name = second.name
    pool.put(second)
    put_at = time.monotonic()
    del second
    deadline = put_at + 3 * idle
    while name in segments_now() and time.monotonic() < deadline:
        time.sleep(0.01)
    freed_after = time.monotonic() - put_at
    try:
        assert idle <= freed_after <= idle + 0.5, f"freed {freed_after:.2f} s after its use"
    finally:
        pool.close()
