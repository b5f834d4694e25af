"""Queued calls of functions measured short travel several in one message.

What batching must not change, each under the default start method and spawn: every
future gets its own result or exception; map's order; a queued call can be cancelled and
then never runs; a long or unmeasured call goes alone, so nothing waits behind it;
``as_completed`` sees results as they come; a worker dying inside a batch fails that
batch's calls with ``BrokenProcessPool``; ``shutdown(cancel_futures=True)``; arrays in
batched calls (segments per call, none left); the initializer; ``max_tasks_per_child``
and ``batching=False`` turn it off.

Batches are made to happen without timing: both workers are held by calls that block
on an event while the calls under test queue up behind them; once released, the
workers find a backlog of calls of a function measured short.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import CancelledError, as_completed, wait
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing import get_context
from typing import Any

import numpy as np
import pytest
import workers
from conftest import wait_exit

import sharexec
from sharexec import _batching, _config, _loky
from sharexec._transport import Task, Transport
from sharexec._worker import run, run_batch

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]


@contextmanager
def held(ex: sharexec.SharedProcessPoolExecutor, check: bool = True) -> Iterator[Any]:
    """Both workers busy until the block ends (or ``release()``): calls submitted inside
    queue up. Yields the release function. ``check``: that the blockers returned."""
    with get_context("spawn").Manager() as manager:
        go = manager.Event()
        blockers = [ex.submit(workers.block, go) for _ in range(2)]
        # Running once in the call queue (no event tells when: looked at until then), so
        # that a shutdown(cancel_futures=True) in the block cannot cancel them.
        deadline = time.monotonic() + 60
        while not all(b.running() or b.done() for b in blockers):
            assert time.monotonic() < deadline, "the blockers never left the queue"
            time.sleep(0.001)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                go.set()
                wait(blockers, timeout=60)
                assert not check or [b.result() for b in blockers] == [True, True]

        try:
            yield release
        finally:
            release()


def await_exit(processes: list[Any]) -> None:
    """Until every one of ``processes`` has exited (60 s at most)."""
    assert not wait_exit([p.pid for p in processes], 60.0), "a worker did not exit"


def measure(ex: sharexec.SharedProcessPoolExecutor, fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` once: from its result on, its run time is known."""
    ex.submit(fn, *args).result()


# ---------------------------------------------------------------------------------------
# Own results and exceptions, order
# ---------------------------------------------------------------------------------------


def test_each_future_of_a_batch_gets_its_own_result_or_exception(executor):
    measure(executor, workers.inverse, 1.0)
    xs = list(range(-300, 300))
    with held(executor):
        futures = [executor.submit(workers.inverse, x) for x in xs]
    for x, future in zip(xs, futures, strict=True):
        if x == 0:
            error = future.exception()
            assert type(error) is ZeroDivisionError
            assert "ZeroDivisionError" in str(error.__cause__)  # the worker's traceback
        else:
            assert future.result() == 1.0 / x
    stats = executor.statistics()
    assert stats.tasks_batched > 0, stats
    assert stats.batches < stats.tasks_batched
    assert stats.tasks_done == stats.tasks_submitted


def test_map_keeps_the_order_and_raises_at_the_failing_item(executor):
    measure(executor, workers.inverse, 1.0)
    with held(executor):
        results = executor.map(workers.add, range(1000), range(1000))
        failing = executor.map(workers.inverse, [1.0, 2.0, 0.0, 4.0] * 100)
    assert list(results) == [2 * i for i in range(1000)]
    assert next(failing) == 1.0
    assert next(failing) == 0.5
    with pytest.raises(ZeroDivisionError):
        next(failing)
    assert executor.statistics().tasks_batched > 0


# ---------------------------------------------------------------------------------------
# Cancelling, shutting down
# ---------------------------------------------------------------------------------------


def test_a_queued_call_is_cancelled_and_never_runs(executor):
    seen = sharexec.zeros(3000, dtype=np.int64)
    measure(executor, workers.mark, seen, 0)
    seen[0] = 0
    with held(executor):
        futures = [executor.submit(workers.mark, seen, i) for i in range(len(seen))]
        # The tail is still queued: a batch holds a few ms of work, at most 256 calls,
        # and the call queue 5 of them.
        assert all(f.cancel() for f in futures[-200:])
    wait(futures, timeout=60)
    assert all(f.cancelled() for f in futures[-200:])
    assert [f.result() for f in futures[:-200]] == list(range(len(seen) - 200))
    assert seen[:-200].tolist() == [1] * (len(seen) - 200)  # each ran once
    assert not seen[-200:].any()  # no cancelled call ran
    assert executor.statistics().tasks_batched > 0
    del seen


def test_shutdown_cancel_futures_with_batches_queued(start_method, no_leaks):
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
    measure(ex, workers.add, 1, 1)
    with get_context("spawn").Manager() as manager:
        go = manager.Event()
        # Blockers on both workers and in each of the call queue's places: the calls
        # below all wait behind them. Once the blockers return, the manager fills the
        # places with batches of those calls, which are marked running as they join (no
        # event tells when: looked at until then). Submitted with a place free, the
        # first calls would go alone.
        places = ex._call_queue._maxsize  # loky's: twice the workers, and one
        blockers = [ex.submit(workers.block, go) for _ in range(2 + places)]
        futures = [ex.submit(workers.add, i, 1) for i in range(20_000)]
        go.set()
        deadline = time.monotonic() + 60
        while not futures[0].running() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert futures[0].running(), "no batch went to the call queue"
        # The batches in the call queue run (as the stdlib's queued calls), the rest is
        # cancelled.
        processes = ex._pool_processes()
        ex.shutdown(wait=False, cancel_futures=True)
        assert [b.result() for b in blockers] == [True] * (2 + places)
        # As the standard library's, a shutdown(wait=True) after one without wait does
        # not wait: the workers are awaited here, as they end the batches they hold.
        ex.shutdown(wait=True)
        await_exit(processes)
    cancelled = [f for f in futures if f.cancelled()]
    ran = [(i, f) for i, f in enumerate(futures) if not f.cancelled()]
    assert cancelled, "nothing was left to cancel"
    assert ran, "no batch was on its way"
    assert all(f.result() == i + 1 for i, f in ran)  # each its own result
    assert ex.statistics().tasks_batched > 0
    with pytest.raises(CancelledError):
        cancelled[-1].result()


def test_map_calls_cancelled_by_shutdown_raise_cancelled_error(start_method, no_leaks):
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
    measure(ex, workers.add, 1, 1)
    with held(ex):
        results = ex.map(workers.add, range(3000), range(3000))
        processes = ex._pool_processes()  # all started by now (they start on demand)
        ex.shutdown(wait=False, cancel_futures=True)  # the queued calls: cancelled now
    got = []
    with pytest.raises(CancelledError):
        for value in results:  # the calls that ran, in order, then a cancelled one
            got.append(value)
    assert got == [2 * i for i in range(len(got))]
    assert len(got) < 3000
    await_exit(processes)  # shut down without waiting: they exit meanwhile


# ---------------------------------------------------------------------------------------
# Nothing waits behind a long call
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["unmeasured", "measured long"])
def test_a_long_call_goes_alone_and_holds_no_call(start_method, no_leaks, kind):
    """A blocking call at the head of a backlog of short calls: if it led (or joined) a
    batch, the calls sent with it would wait for it. They all end while it blocks."""
    with (
        sharexec.SharedProcessPoolExecutor(2, mp_context=start_method) as ex,
        get_context("spawn").Manager() as manager,
    ):
        measure(ex, workers.add, 1, 1)
        if kind == "measured long":
            ready = manager.Event()
            ready.set()
            measure(ex, workers.block, ready, 0.01)  # 10 ms: long
        go = manager.Event()
        with held(ex):
            before = [ex.submit(workers.add, i, 0) for i in range(500)]
            long_call = ex.submit(workers.block, go)
            after = [ex.submit(workers.add, i, 0) for i in range(500)]
        done, _ = wait(before + after, timeout=60)  # while the long call blocks
        assert len(done) == 1000
        assert [f.result() for f in before + after] == [*range(500), *range(500)]
        assert not long_call.done()
        assert ex.statistics().tasks_batched > 0
        go.set()
        assert long_call.result() is True


def test_a_batch_streams_the_outcomes_before_a_call_that_blocks(executor):
    """A call of a function measured short blocks inside a batch: the calls before it
    in that batch come back while it blocks (not at the batch's end)."""
    with get_context("spawn").Manager() as manager:
        go = manager.Event()
        measure(executor, workers.wait_at, 0, -1, go)
        with held(executor):
            futures = [executor.submit(workers.wait_at, i, 500, go) for i in range(1000)]
        done, _ = wait(futures[:500], timeout=60)
        assert len(done) == 500  # while call 500 blocks
        assert not futures[500].done()
        go.set()
        assert [f.result() for f in futures] == list(range(1000))
    assert executor.statistics().tasks_batched > 0


@contextmanager
def long_and_short(ex: sharexec.SharedProcessPoolExecutor) -> Iterator[tuple[Any, Any, list[Any]]]:
    """A call that blocks until ``go.set()``, then 1,000 short ones, queued together
    behind the held workers (so they travel in batches): yields (go, long, short)."""
    measure(ex, workers.add, 1, 1)
    with get_context("spawn").Manager() as manager:
        go = manager.Event()
        with held(ex):
            long_call = ex.submit(workers.block, go)
            short = [ex.submit(workers.add, i, 0) for i in range(1000)]
        yield go, long_call, short


def test_as_completed_sees_results_as_they_come(executor):
    with long_and_short(executor) as (go, long_call, short):
        seen = []
        for future in as_completed([long_call, *short], timeout=60):
            seen.append(future)
            if len(seen) == len(short):
                break  # every short call came while the long one still blocks
        assert long_call not in seen
        go.set()
        assert long_call.result() is True
    assert executor.statistics().tasks_batched > 0


def test_a_thread_waiting_on_one_future_is_not_woken_by_the_others(executor):
    """The futures of one executor share a lock (one object fewer per call): a thread
    waiting on one of them waits for that one, while a thousand others finish."""
    with long_and_short(executor) as (go, long_call, short):
        assert long_call._shared_lock is short[0]._shared_lock
        outcome: list[Any] = []
        waiting = threading.Thread(target=lambda: outcome.append(long_call.result()))
        waiting.start()
        assert [f.result(timeout=60) for f in short] == list(range(1000))
        with pytest.raises(FutureTimeout):
            long_call.result(timeout=0.01)
        with pytest.raises(FutureTimeout):
            long_call.exception(timeout=0.01)
        assert waiting.is_alive() and outcome == []
        go.set()
        waiting.join(timeout=60)
        assert outcome == [True] and long_call.exception() is None


def test_futures_sharing_a_lock_keep_the_standard_semantics():
    lock = threading.RLock()
    a, b, c = (_loky.LokyFuture(lock) for _ in range(3))
    assert a._waiters_made is None and a._callbacks_made is None  # made when asked for
    called: list[Any] = []
    a.add_done_callback(called.append)
    done, pending = wait([a, b], timeout=0)
    assert not done and pending == {a, b}
    assert b.set_running_or_notify_cancel() and not b.cancel() and b.running()
    assert c.cancel() and c.cancel() and c.cancelled()
    assert not c.set_running_or_notify_cancel()
    with pytest.raises(CancelledError):
        c.result()
    b.set_exception(KeyError("b"))
    with pytest.raises(KeyError):
        b.result()
    assert isinstance(b.exception(), KeyError)
    with pytest.raises(_loky.futures.futures_base.InvalidStateError):
        b.set_result(1)
    finished = []
    waiter = threading.Thread(target=lambda: finished.extend(as_completed([a, b], timeout=60)))
    waiter.start()
    a.set_result(7)
    waiter.join(timeout=60)
    assert set(finished) == {a, b} and a.result() == 7 and called == [a]
    assert a.done() and not a.cancel() and a.exception() is None
    with pytest.raises(RuntimeError, match="unexpected state"):
        a.set_running_or_notify_cancel()


def test_the_estimate_goes_up_at_once_and_down_slowly():
    transport = Transport(_config.Options())
    policy = _batching.Batching(transport, 2, run, run_batch)
    task = Task(workers.add, (1, 2), {}, transport)
    assert policy.cost(run, (task,)) is None  # never measured: alone
    policy.measured(run, (task,), 1e-6)
    assert policy.cost(run, (task,)) == pytest.approx(1e-6 + _batching.PER_CALL_SECONDS)
    policy.measured(run, (task,), 0.05)  # one long run: alone from its next call on
    assert policy.cost(run, (task,)) is None
    for _ in range(40):
        policy.measured(run, (task,), 1e-6)
    assert policy.cost(run, (task,)) is not None
    other = Task(workers.identity, (1,), {}, transport)  # another function: unmeasured
    assert policy.cost(run, (other,)) is None
    assert policy.limit(3) == 0  # too few waiting to share between 2 workers
    assert policy.limit(10**6) == _batching.BATCH_CALLS
    task.release()
    other.release()
    transport.close()


# ---------------------------------------------------------------------------------------
# Failures: a dead worker, a call that cannot be pickled
# ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_a_worker_dying_inside_a_batch_breaks_its_calls_only_with_broken_pool(
    start_method, no_leaks
):
    with sharexec.SharedProcessPoolExecutor(2, mp_context=start_method) as ex:
        measure(ex, workers.exit_at, 0, -1)
        with held(ex, check=False) as release:  # the pool may break before they are read
            futures = [ex.submit(workers.exit_at, i, 1500) for i in range(3000)]
            release()
        done, _ = wait(futures, timeout=60)
        assert len(done) == len(futures)  # none hangs
        assert isinstance(futures[1500].exception(), BrokenProcessPool)
        for i, future in enumerate(futures):
            error = future.exception()
            assert (error is None and future.result() == i) or isinstance(error, BrokenProcessPool)
        assert ex.statistics().tasks_batched > 0


def test_a_call_that_cannot_be_pickled_fails_alone_in_its_batch(executor):
    measure(executor, workers.identity, 1)
    with held(executor):
        futures = [executor.submit(workers.identity, i) for i in range(400)]
        bad = executor.submit(workers.identity, threading.Lock())
        futures += [executor.submit(workers.identity, i) for i in range(400)]
    assert [f.result() for f in futures] == [*range(400), *range(400)]
    error = bad.exception()
    assert isinstance(error, (pickle.PicklingError, TypeError)), error
    assert executor.statistics().tasks_batched > 0


class _Done:
    """An argument of a call whose outcome was delivered while it waited to be sent
    (a worker died meanwhile): pickling it raises, as a released Task does."""

    def __reduce__(self) -> Any:
        raise _loky.AlreadyDone("this task was already completed")


class _Policy:
    """Reduces a batch as Transport does: refused if any of its calls is done."""

    def reduce_batch(self, batch: _loky.CallBatch) -> Any:
        if any(type(arg) is _Done for _, args in batch.calls for arg in args):
            raise _loky.AlreadyDone("this task was already completed")
        return list, (batch.ids,)


def test_the_feeder_drops_calls_already_done_and_fails_only_the_unpicklable():
    # The race seen once in six runs of the test above: a worker dies while a batch
    # waits in the feeder's buffer; the manager fails its futures and releases its
    # tasks; the feeder must then neither send them nor fail them again (a second
    # set_exception raised InvalidStateError in the feeder thread).
    call = _loky.queues.process_executor._CallItem
    policy = _Policy()
    items = [
        call(0, workers.identity, (_Done(),), {}),  # done, alone
        call(
            1,
            None,
            (
                _loky.CallBatch(
                    [1, 2], [(workers.identity, (_Done(),)), (workers.identity, (2,))], policy
                ),
            ),
            {},
        ),
        call(
            3,
            None,
            (
                _loky.CallBatch(
                    [3, 4],
                    [(workers.identity, (_Done(),)), (workers.identity, (_Done(),))],
                    policy,
                ),
            ),
            {},
        ),
        call(5, workers.identity, (threading.Lock(),), {}),  # fails alone, as before
    ]
    buffer = deque([*items, _loky.queues.mp_queues._sentinel])
    sent: list[bytes] = []
    failed: list[tuple[type, int]] = []
    slots = threading.Semaphore(0)
    closed = threading.Event()
    feeder = threading.Thread(
        target=_loky.queues._feed,
        args=(
            buffer,
            threading.Condition(),
            sent.append,
            threading.Lock(),
            closed.set,
            None,
            False,
            lambda exc, item: failed.append((type(exc), item.work_id)),
            slots,
        ),
    )
    feeder.start()
    feeder.join(30)
    assert closed.is_set()
    assert [pickle.loads(data).args for data in sent] == [([2],)]  # the one call left
    assert [work_id for _, work_id in failed] == [5]
    assert not issubclass(failed[0][0], _loky.AlreadyDone)
    freed = 0
    while slots.acquire(blocking=False):
        freed += 1
    assert freed == 3  # the done call, the batch of done calls, the unpicklable call


# ---------------------------------------------------------------------------------------
# Arrays, initializer, switches
# ---------------------------------------------------------------------------------------


def test_arrays_in_batched_calls_travel_per_call_and_leave_no_segment(executor):
    n = 64 * 1024  # 512 KiB: above min_share_bytes, both ways
    arrays = [np.full(n, float(i)) for i in range(40)]
    measure(executor, workers.total, arrays[1])
    measure(executor, workers.filled, n, 1.0)
    with held(executor):
        sums = [executor.submit(workers.total, a) for a in arrays]
        made = [executor.submit(workers.filled, n, float(i)) for i in range(40)]
    assert [f.result() for f in sums] == [float(i * n) for i in range(40)]
    for i, future in enumerate(made):
        result = future.result()
        assert result.shape == (n,) and result[0] == result[-1] == float(i)
    stats = executor.statistics()
    assert stats.tasks_batched > 0 and stats.bytes_copied > 0, stats
    del made, future, result  # the results' segments go (the fixture checks none is left)


@pytest.mark.process
def test_batched_calls_see_the_initializer(start_method, no_leaks):
    table = np.arange(100_000.0)
    shared = sharexec.zeros(4)
    with sharexec.SharedProcessPoolExecutor(
        2, mp_context=start_method, initializer=workers.init_worker, initargs=(table, shared)
    ) as ex:
        measure(ex, workers.read_initialized)
        with held(ex):
            futures = [ex.submit(workers.read_initialized) for _ in range(500)]
        first = futures[0].result()
        assert all(f.result() == first for f in futures)
        assert ex.statistics().tasks_batched > 0
    del shared


@pytest.mark.process
@pytest.mark.parametrize("how", ["option", "max_tasks_per_child"])
def test_batching_is_off_with_the_option_or_max_tasks_per_child(start_method, no_leaks, how):
    if how == "max_tasks_per_child" and start_method == "fork":
        pytest.skip("max_tasks_per_child is refused with fork")
    kwargs: dict[str, Any] = (
        {"batching": False} if how == "option" else {"max_tasks_per_child": 1000}
    )
    with sharexec.SharedProcessPoolExecutor(2, mp_context=start_method, **kwargs) as ex:
        measure(ex, workers.add, 1, 1)
        with held(ex):
            futures = [ex.submit(workers.add, i, 1) for i in range(300)]
        assert [f.result() for f in futures] == [i + 1 for i in range(300)]
        assert ex.statistics().tasks_batched == 0


@pytest.mark.parametrize(
    ("value", "expected"), [("0", False), ("false", False), ("1", True), ("yes", True)]
)
def test_the_batching_variable(value, expected):
    assert _config.Options.resolve({}, {"SHAREXEC_BATCHING": value}).batching is expected


def test_a_bad_batching_value_is_refused():
    with pytest.raises(sharexec.ConfigError, match="SHAREXEC_BATCHING"):
        _config.Options.resolve({}, {"SHAREXEC_BATCHING": "sometimes"})
