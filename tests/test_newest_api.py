"""The newest stdlib API, on every Python sharexec supports.

Python 3.14 added ``Executor.map(..., buffersize=)`` and
``ProcessPoolExecutor.terminate_workers()`` / ``kill_workers()``. Code written for 3.14
must not break when it gets our class, on any Python: each is checked against the
standard library's documented behaviour.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FuturesTimeoutError
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest
import workers
from conftest import method_id, segments_now

import sharexec

pytestmark = pytest.mark.timeout(120)


class Counted:
    """An iterator that counts the items taken from it."""

    def __init__(self, items: Iterator[object]) -> None:
        self.items = items
        self.taken = 0
        self.lock = threading.Lock()

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> object:
        item = next(self.items)
        with self.lock:
            self.taken += 1
        return item


# ---------------------------------------------------------------------------------------
# map(buffersize=)
# ---------------------------------------------------------------------------------------


@pytest.mark.transport
@pytest.mark.parametrize(
    ("buffersize", "error"),
    [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("2", TypeError)],
)
def test_a_bad_buffersize_is_refused_as_the_stdlib_does(executor, buffersize, error):
    items = Counted(iter(range(10)))
    with pytest.raises(error, match="buffersize"):
        executor.map(workers.identity, items, buffersize=buffersize)
    assert items.taken == 0  # refused before anything is submitted


@pytest.mark.transport
def test_map_with_a_buffersize_takes_items_as_results_are_taken(executor):
    items = Counted(itertools.count())  # endless: without a buffer, map never returns
    results = executor.map(workers.identity, items, buffersize=3)
    assert items.taken == 3  # submitted at the call, as the stdlib does
    got = [next(results) for _ in range(20)]
    assert got == list(range(20))
    assert items.taken <= 20 + 3
    results.close()  # cancels what was submitted ahead


@pytest.mark.transport
def test_map_with_a_buffersize_and_chunks_counts_chunks(executor):
    items = Counted(itertools.count())
    results = executor.map(workers.identity, items, chunksize=4, buffersize=2)
    assert items.taken == 8  # two chunks of four
    got = [next(results) for _ in range(10)]
    assert got == list(range(10))
    assert items.taken <= (3 + 2) * 4  # the chunks reached, and two more at most
    results.close()


@pytest.mark.transport
def test_map_with_a_buffersize_gives_every_result_in_order_and_raises_in_place(executor):
    values = [1.0, 2.0, 0.0, 4.0]
    results = executor.map(workers.inverse, values, buffersize=2)
    assert next(results) == 1.0
    assert next(results) == 0.5
    with pytest.raises(ZeroDivisionError):
        next(results)
    # map's iterator ends at its first exception, as the stdlib's
    with pytest.raises(StopIteration):
        next(results)


@pytest.mark.transport
def test_map_with_a_buffersize_and_several_iterables_stops_at_the_shortest(executor):
    results = executor.map(workers.add, range(5), itertools.count(10), buffersize=2)
    assert list(results) == [10, 12, 14, 16, 18]


@pytest.mark.transport
def test_map_with_a_buffersize_honours_its_timeout(executor):
    results = executor.map(time.sleep, [2.0, 2.0], buffersize=1, timeout=0.2)
    # concurrent.futures' own TimeoutError (the builtin one only since Python 3.11)
    with pytest.raises(FuturesTimeoutError):
        next(results)  # the call is slow (not waited for: the timeout is the point)


@pytest.mark.transport
def test_map_without_a_buffersize_submits_everything_at_once(executor):
    items = Counted(iter(range(50)))
    results = executor.map(workers.identity, items)
    assert items.taken == 50
    assert list(results) == list(range(50))


def test_closing_the_iterator_cancels_the_calls_not_started(start_method, no_leaks):
    from multiprocessing import get_context

    with (
        sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex,
        get_context("spawn").Manager() as manager,
    ):
        go = manager.Event()
        blocker = ex.submit(workers.wait_for, go)
        results = ex.map(workers.identity, range(100), buffersize=10)
        results.close()
        go.set()
        assert blocker.result() is True
        assert ex.statistics().tasks_submitted == 11  # the blocker and the first ten


# ---------------------------------------------------------------------------------------
# terminate_workers(), kill_workers()
# ---------------------------------------------------------------------------------------

SCENARIO = """
import os, sys
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FuturesTimeoutError
from concurrent.futures.process import BrokenProcessPool
import numpy as np
import sharexec

def busy(a, path):
    mine = sharexec.zeros(300_000)  # a segment the worker owns
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    os.read(os.open(path + ".fifo", os.O_RDONLY), 1)  # blocks: nobody ever writes

def init(table):
    assert table.sum() == table.size

if __name__ == "__main__":
    method, operation, path = sys.argv[1:]
    method = None if method == "default" else method  # sharexec's default
    os.mkfifo(path + ".fifo")
    ex = sharexec.SharedProcessPoolExecutor(
        1, mp_context=method, initializer=init, initargs=(np.ones(400_000),)
    )
    running = ex.submit(busy, np.ones(1_000_000), path)
    pending = [ex.submit(busy, np.ones(1_000_000), path) for _ in range(3)]
    while not (os.path.exists(path) and os.path.getsize(path)):
        os.sched_yield()  # the worker writes its pid once its task runs
    worker = int(open(path).read())
    getattr(ex, operation)()
    try:
        running.result(timeout=60)
    except BrokenProcessPool:
        print("running broken")
    # Cancelled, or failed if loky had queued it for the worker already (as the stdlib)
    ended = [f.cancelled() or isinstance(f.exception(), BrokenProcessPool) for f in pending]
    print("pending ended", all(ended))
    try:
        ex.submit(int, 1)
    except RuntimeError:
        print("submit refused")
    print("worker", worker)
    ex.shutdown()
    print("sweeper", sharexec._session._channel.sweeper_pid)
"""


@pytest.mark.parametrize("operation", ["terminate_workers", "kill_workers"])
def test_terminate_and_kill_workers_as_the_stdlib_and_leave_nothing(
    start_method, tmp_path: Path, operation: str
):
    from test_faults import wait_exit

    script = tmp_path / "scenario.py"
    script.write_text(textwrap.dedent(SCENARIO))
    before = segments_now()
    out = subprocess.run(
        [sys.executable, str(script), method_id(start_method), operation, str(tmp_path / "pid")],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "running broken" in lines, out.stdout  # the running call fails
    assert "pending ended True" in lines  # the others never run
    assert "submit refused" in lines  # shut down: as the stdlib after either
    sweeper = int(next(line for line in lines if line.startswith("sweeper")).split()[1])
    worker = int(next(line for line in lines if line.startswith("worker")).split()[1])
    assert wait_exit([worker, sweeper], 30) == []
    assert segments_now() - before == set()  # the worker's own segment too


def test_terminate_workers_sends_sigterm_and_kill_workers_sigkill(start_method, no_leaks):
    from multiprocessing import get_context

    with get_context("spawn").Manager() as manager:
        for operation, signum in [("terminate_workers", signal.SIGTERM), ("kill_workers", 9)]:
            threads = set(threading.enumerate())
            ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
            # Each worker busy in a call when the signal is sent, as in the standard
            # library's own test: an idle worker may take the shutdown's sentinel and
            # leave with 0 before the signal reaches it (seen under fork).
            started, go = [manager.Event(), manager.Event()], manager.Event()
            calls = [ex.submit(workers.wait_then_read, np.zeros(1), s, go) for s in started]
            assert all(s.wait(60) for s in started)
            processes = ex._pool_processes()
            assert len(processes) == 2
            threads = set(threading.enumerate()) - threads  # loky's manager and feeder
            getattr(ex, operation)()
            # The manager thread reaps the workers. Their exit codes are read after it
            # has ended, never beside it: a forkserver child's code comes once, through a
            # pipe, and a second reader at the same time gets 255.
            for thread in threads:
                thread.join(30)
                assert not thread.is_alive()
            for process in processes:
                assert process.exitcode == -signum
            for call in calls:
                with pytest.raises(BrokenProcessPool):
                    call.result(30)
            ex.shutdown()


def test_terminate_workers_of_an_executor_never_started_is_a_shutdown(start_method, no_leaks):
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
    ex.kill_workers()
    with pytest.raises(RuntimeError):
        ex.submit(int, 1)
    ex.terminate_workers()  # again: nothing left to end


def test_pending_calls_are_cancelled_by_terminate_workers(start_method, no_leaks):
    from multiprocessing import get_context

    with get_context("spawn").Manager() as manager:
        go = manager.Event()
        ex = sharexec.SharedProcessPoolExecutor(1, mp_context=start_method)
        running = ex.submit(workers.wait_for, go)
        pending = [ex.submit(workers.identity, i) for i in range(20)]
        ex.terminate_workers()
        go.set()
        with pytest.raises((BrokenProcessPool, CancelledError)):
            running.result(60)
        outcomes = []
        for future in pending:
            try:
                outcomes.append(future.result(60))
            except (BrokenProcessPool, CancelledError) as exc:
                outcomes.append(type(exc))
        assert CancelledError in outcomes  # at least the last ones never started
        ex.shutdown()
