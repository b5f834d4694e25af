"""``concurrent.futures.wait`` and ``as_completed`` over any mix of futures, from
several threads at once.

The standard library takes the lock of every future it waits for, in one global order
(by id), so two threads never wait for each other. That holds only if each future has a
lock of its own: two futures that shared one would be taken at two places of that order.
Here several threads wait, polling (``timeout=0``) and blocking (``ALL_COMPLETED``,
``FIRST_COMPLETED``, ``as_completed``, ``result``), over random mixes of the futures of
two sharexec executors, of a standard ``ThreadPoolExecutor`` and plain ``Future()``s;
each thread must end in bounded time with the standard library's answers. The futures
live in this process, whatever the start method of the workers, so one (sharexec's
default) serves.
"""

from __future__ import annotations

import operator
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import (
    FIRST_COMPLETED,
    CancelledError,
    Future,
    ThreadPoolExecutor,
    as_completed,
    wait,
)
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import pytest
import workers

import sharexec
from sharexec import _loky

pytestmark = pytest.mark.timeout(120)

THREADS = 8


def run_threads(targets: list[Callable[[], None]], seconds: float) -> None:
    """Run each target in a thread of its own; fail if one raised, or if one is still
    running after ``seconds`` (threads deadlocked on the futures' locks never end: they
    are daemons, left behind)."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(thread.is_alive() for thread in threads)
    assert not stuck, f"{stuck} of {len(threads)} threads still waiting after {seconds} s"
    if errors:
        raise errors[0]


@contextmanager
def three_executors() -> Iterator[tuple[Any, Any, ThreadPoolExecutor]]:
    """Two sharexec executors (one worker each) and a standard thread pool."""
    with (
        sharexec.SharedProcessPoolExecutor(1) as a,
        sharexec.SharedProcessPoolExecutor(1) as b,
        ThreadPoolExecutor(2) as pool,
    ):
        yield a, b, pool


def interleaved(everything: list[Future[Any]], *groups: list[Future[Any]]) -> bool:
    """Whether, in the order ``wait`` takes their locks (by id), a future not of a
    group comes between two of each group: where two threads could take the lock a
    group would share in opposite orders with another future's."""
    position = {id(f): i for i, f in enumerate(sorted(everything, key=id))}
    for group in groups:
        at = [position[id(f)] for f in group]
        if max(at) - min(at) + 1 == len(at):
            return False
    return True


def done_set(fs: list[Future[Any]], done: set[Future[Any]]) -> set[Future[Any]]:
    return {f for f in fs if f in done}


def test_threads_polling_wait_over_futures_of_several_executors(no_leaks):
    """Thousands of polls over random mixes of done and pending futures, from eight
    threads (each poll takes the locks of all the futures it names)."""
    with three_executors() as (a, b, pool):
        done: list[Future[Any]] = []
        pending: list[Future[Any]] = []
        of_a: list[Future[Any]] = []
        of_b: list[Future[Any]] = []
        for i in range(20):  # made in turn, so that their ids interleave
            of_a.append(a.submit(workers.add, i, 1))
            plain: Future[Any] = Future()
            plain.set_result(i)
            done += [plain, pool.submit(operator.add, i, 3)]
            of_b.append(b.submit(workers.add, i, 2))
            pending.append(Future())
        done += of_a + of_b
        wait(done, timeout=60)
        assert all(f.done() for f in done)
        everything = done + pending
        assert interleaved(everything, of_a, of_b)
        finished = set(done)

        def poll(seed: int) -> None:
            rng = random.Random(seed)
            for i in range(600):
                fs = rng.sample(everything, rng.randint(2, 8))
                expected = done_set(fs, finished)
                if i % 3 == 0:
                    assert wait(fs, timeout=0).done == expected
                elif i % 3 == 1:
                    answer = wait(fs, timeout=0, return_when=FIRST_COMPLETED)
                    assert answer.done == expected and answer.not_done == set(fs) - expected
                else:
                    seen: list[Future[Any]] = []
                    with pytest.raises(FutureTimeout) if set(fs) - expected else nullcontext():
                        seen.extend(as_completed(fs, timeout=0))
                    assert len(seen) == len(set(seen)) and set(seen) == expected

        run_threads([lambda s=s: poll(s) for s in range(THREADS)], 60)
        for f in pending:
            f.cancel()


def test_threads_blocking_in_wait_while_the_futures_finish(no_leaks):
    """Rounds of futures of the three executors and plain ones, finished while eight
    threads wait on random mixes of them, each in another way; some plain ones are
    cancelled (done for wait once the executor's side saw it)."""
    with three_executors() as (a, b, pool):
        for seed in range(15):
            one_round(a, b, pool, seed)


def one_round(a: Any, b: Any, pool: ThreadPoolExecutor, seed: int) -> None:
    """Calls on the three executors and plain futures, waited for by eight threads (each
    its own random 16 of them, its own way) while a ninth finishes the plain ones."""
    rng = random.Random(seed)
    values: dict[Future[Any], int] = {}
    for i in range(12):
        values[a.submit(workers.add, i, 0)] = i
        values[b.submit(workers.add, i, 100)] = i + 100
        values[pool.submit(operator.add, i, 200)] = i + 200
    plain: list[Future[Any]] = [Future() for _ in range(12)]
    for i, f in enumerate(plain):
        values[f] = i + 300
    cancelled = set(plain[::4])
    everything = list(values)

    def finish_plain() -> None:
        for f in rng.sample(plain, len(plain)):
            if f in cancelled:
                assert f.cancel() and not f.set_running_or_notify_cancel()
            else:
                f.set_result(values[f])

    def check(f: Future[Any]) -> None:
        if f in cancelled:
            assert f.cancelled()
            with pytest.raises(CancelledError):
                f.result(timeout=0)
        else:
            assert f.result(timeout=0) == values[f]

    def all_completed(fs: list[Future[Any]]) -> None:
        answer = wait(fs, timeout=60)
        assert answer.done == set(fs) and not answer.not_done
        for f in fs:
            check(f)

    def first_completed(fs: list[Future[Any]]) -> None:
        left = set(fs)
        while left:
            answer = wait(left, timeout=60, return_when=FIRST_COMPLETED)
            assert answer.done and answer.done | answer.not_done == left
            for f in answer.done:
                check(f)
            left = answer.not_done

    def completed(fs: list[Future[Any]]) -> None:
        seen = list(as_completed(fs, timeout=60))
        assert len(seen) == len(set(fs)) and set(seen) == set(fs)
        for f in seen:
            check(f)

    def results(fs: list[Future[Any]]) -> None:
        for f in fs:
            if f not in cancelled:
                assert f.result(timeout=60) == values[f]

    def polling(fs: list[Future[Any]]) -> None:
        """Polls random others of the round 300 times, then until ``fs`` are done."""
        others = random.Random(id(fs))
        polls = 0
        while wait(fs, timeout=0).not_done or polls < 300:
            polls += 1
            answer = wait(others.sample(everything, 4), timeout=0)
            assert all(f.done() for f in answer.done)

    ways = [all_completed, first_completed, completed, results, polling, polling]
    targets: list[Callable[[], None]] = [finish_plain]
    for i in range(THREADS):
        fs = rng.sample(everything, 16)
        targets.append(partial(ways[i % len(ways)], fs))
    run_threads(targets, 60)


def test_a_future_has_its_own_lock_once_waited_for():
    """The futures of one executor share a lock until one is asked for its own (by
    ``wait``, ``as_completed``, or anything that takes ``_condition``)."""
    shared = threading.RLock()
    f, g = _loky.LokyFuture(shared), _loky.LokyFuture(shared)
    assert f._own_lock is None and f._take_lock() is shared
    shared.release()
    f.set_running_or_notify_cancel()
    assert f.running() and not f.done() and f._own_lock is None
    assert wait([f, g], timeout=0).not_done == {f, g}
    assert f._own_lock is not None and g._own_lock is not None
    assert f._condition is f._own_lock and f._own_lock is not g._own_lock
    assert f._take_lock() is f._own_lock  # the state is guarded by the own lock from now on
    f._own_lock.release()
    f.set_result(1)
    assert f.result() == 1 and f.done() and wait([f, g], timeout=0).done == {f}


def test_result_waits_for_its_own_future_and_wakes_on_cancel():
    shared = threading.RLock()
    f, g = _loky.LokyFuture(shared), _loky.LokyFuture(shared)
    outcome: list[Any] = []

    def wait_result() -> None:
        try:
            f.result(timeout=60)
        except CancelledError as e:
            outcome.append(e)

    waiting = threading.Thread(target=wait_result)
    waiting.start()
    while not f._waiters_made:  # the thread's waiter is in place
        time.sleep(0.001)
    g.set_result(2)  # another future of the same lock: the waiting thread sleeps on
    assert waiting.is_alive() and g.result() == 2
    assert f.cancel()
    waiting.join(60)
    assert len(outcome) == 1 and f.cancelled() and f._waiters_made == []
    with pytest.raises(FutureTimeout):
        _loky.LokyFuture(shared).exception(timeout=0.01)
    h = _loky.LokyFuture(shared)
    with pytest.raises(FutureTimeout):
        h.result(timeout=-1)  # as the standard library: no wait at all
    assert h._waiters_made == []  # a waiter that timed out leaves
