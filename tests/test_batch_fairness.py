"""Tiny calls may travel together, never wait together.

Calls of a function measured short travel in batches; a batch holds its calls a few
milliseconds at most: past that, its worker hands back the calls it has not started,
and the pool queues them again for any worker. So, as with the standard library's
executor (each checked under the default start method and spawn):

* a call that waits for a later call completes, even when both were sent in one batch;
* a function measured short that turns slow holds nothing: ``shutdown(cancel_futures=True)``
  cancels the calls not started (a handful run, as with the stdlib, not a batch's
  hundreds), and ``map``'s slow calls spread over both workers.

Batches are made to happen without timing: the calls under test queue up behind both
workers held by calls that block on an event, or are submitted all at once by ``map``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait
from itertools import repeat
from multiprocessing import get_context
from typing import Any

import numpy as np
import pytest
import workers

import sharexec

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]


def step(kind: Any, event: Any) -> Any:
    """Return ``kind`` at once; ``"wait"``: wait (30 s at most) for ``event`` (a
    Manager's Event) to be set, and say whether it was; ``"set"``: set it."""
    if kind == "wait":
        return bool(event.wait(30))
    if kind == "set":
        event.set()
        return True
    return kind


def step_with(kind: Any, a: np.ndarray, event: Any) -> Any:
    """As :func:`step`, with an array argument: its sum along with the answer."""
    return step(kind, event), float(a.sum())


def slow_once_flagged(i: int, flag: str) -> int:
    """Return ``i`` at once, or after 0.1 s once the file ``flag`` exists."""
    if os.path.exists(flag):
        time.sleep(0.1)
    return i


def slow_at(i: int, slow: frozenset[int]) -> tuple[int, int]:
    """``(i, this worker's pid)``, after 0.3 s if ``i`` is in ``slow``."""
    if i in slow:
        time.sleep(0.3)
    return i, os.getpid()


def test_a_call_waiting_for_a_later_call_of_its_batch_completes(executor):
    """The waiting call and the one it waits for, next to each other in a backlog of
    calls of one function measured short: they travel in one batch. The batch is
    handed back once the waiting call holds it, and the other worker runs the rest."""
    with get_context("spawn").Manager() as manager:
        event, go = manager.Event(), manager.Event()
        executor.submit(step, 0, None).result()  # measured short
        blockers = [executor.submit(workers.block, go) for _ in range(2)]
        before = [executor.submit(step, i, None) for i in range(300)]
        waiting = executor.submit(step, "wait", event)
        setting = executor.submit(step, "set", event)
        after = [executor.submit(step, i, None) for i in range(300)]
        go.set()
        assert waiting.result(timeout=60) is True  # the event was set while it waited
        assert setting.result(timeout=60) is True
        assert [f.result(timeout=60) for f in before + after] == [*range(300), *range(300)]
        assert [b.result(timeout=60) for b in blockers] == [True, True]
    assert executor.statistics().tasks_batched > 0


@pytest.mark.fresh_pool  # it counts the bytes copied and reused from zero
def test_calls_handed_back_keep_their_array_copies(executor):
    """Calls with arrays copied into shared memory, in a batch handed back (one of them
    waits for a later one): each array is copied once, and sent again from that copy,
    nothing counted twice; every segment goes (the executor fixture checks)."""
    n = (256 << 10) // 8  # the smallest array copied
    arrays = [np.full(n, float(i)) for i in range(62)]
    kinds: list[Any] = [*range(30), "wait", "set", *range(30)]
    with get_context("spawn").Manager() as manager:
        event, go = manager.Event(), manager.Event()
        executor.submit(step_with, 0, np.zeros(1), None).result()  # measured short
        blockers = [executor.submit(workers.block, go) for _ in range(2)]
        calls = zip(kinds, arrays, strict=True)
        futures = [executor.submit(step_with, k, a, event) for k, a in calls]
        go.set()
        got = [f.result(timeout=60) for f in futures]
        assert [b.result(timeout=60) for b in blockers] == [True, True]
    answers = [True if k in ("wait", "set") else k for k in kinds]
    assert got == [(k, float(i) * n) for i, k in enumerate(answers)]
    stats = executor.statistics()
    assert stats.tasks_batched > 0
    assert (stats.bytes_copied, stats.bytes_reused) == (62 * n * 8, 0)
    del arrays


def test_shutdown_cancels_the_calls_of_a_short_function_turned_slow(
    start_method, no_leaks, tmp_path
):
    """A function measured short (batched) turns slow: the calls not started are
    cancelled by ``shutdown(cancel_futures=True)``, as with the stdlib (which runs the
    calls running or in its call queue: a handful), not run batch after batch."""
    flag = str(tmp_path / "slow")
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
    try:
        assert list(ex.map(slow_once_flagged, range(2000), repeat(flag))) == list(range(2000))
        open(flag, "w").close()  # from now on, each call runs 0.1 s
        futures = [ex.submit(slow_once_flagged, i, flag) for i in range(2000)]
        wait(futures, timeout=60, return_when=FIRST_COMPLETED)  # the slow calls run
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    ran = [(i, f) for i, f in enumerate(futures) if not f.cancelled()]
    # Done, running in a worker, or first in one of the call queue's places (loky's:
    # twice the workers, and one), and a place or two refilled before the shutdown:
    # 7 to 9 run (the stdlib's executor, whose queue has 3 places: 5 to 7); before
    # batches were handed back, 450 to 1,200.
    most = 12
    assert 1 <= len(ran) <= most, f"{len(ran)} calls ran, at most {most} expected"
    assert all(f.result() == i for i, f in ran)
    assert ex.statistics().tasks_batched > 0


def test_map_spreads_slow_calls_of_a_short_function_over_the_workers(start_method, no_leaks):
    """``map`` over a function measured short, 8 of its 2,000 calls slow and next to
    each other (so in one batch): each worker runs about half of them, as with the
    stdlib; none waits for another while a worker could take it."""
    slow = frozenset(range(1000, 1008))
    with sharexec.SharedProcessPoolExecutor(2, mp_context=start_method) as ex:
        list(ex.map(slow_at, range(2000), repeat(frozenset())))  # measured short
        results = list(ex.map(slow_at, range(2000), repeat(slow)))
        assert ex.statistics().tasks_batched > 0
    assert [i for i, _ in results] == list(range(2000))
    per_worker = Counter(pid for i, pid in results if i in slow)
    # Ideally 4 and 4; a batch holding them all runs the 8 on one worker.
    assert max(per_worker.values()) <= 5, per_worker
