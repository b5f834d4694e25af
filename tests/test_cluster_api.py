"""sharexec.ClusterExecutor: every end of a Dask task maps to the standard library's
outcome, and the executor has the local one's API (get_executor returns either).

The module's own cluster is test_cluster's fixture (two worker processes of one thread);
each test makes its executor over it and checks, as test_cluster's do, that nothing of
it is left on the cluster or in /dev/shm. The tests that close a client, restart the
cluster or stop workers use a client or a cluster of their own where the module's would
suffer.
"""

# The fixtures imported from test_cluster are the tests' arguments, which ruff takes for
# redefinitions of the names imported.
# ruff: noqa: F811

from __future__ import annotations

import concurrent.futures
import inspect
import itertools
import os
import time
from concurrent.futures import BrokenExecutor, CancelledError
from concurrent.futures import process as futures_process
from typing import Any

import numpy as np
import pytest
from test_newest_api import Counted  # the same counting iterator

import sharexec

distributed = pytest.importorskip(
    "distributed", reason="the cluster executor needs distributed: pip install sharexec[dask]"
)

from conftest import drop_warm_arrays, segments_now  # noqa: E402
from test_cluster import (  # noqa: E402
    MiB,
    assert_cluster_clean,
    assert_running_soon,
    client,  # noqa: F401  (the module's cluster, a fixture)
    ex,  # noqa: F401  (an executor over it, checked on teardown: a fixture)
    wait_for,
)

from sharexec import _cluster  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def identity(x: Any) -> Any:
    return x


def gate(client: Any) -> Any:
    """A distributed.Event the test sets: the calls waiting for it hold their worker."""
    return distributed.Event(f"gate-{os.urandom(4).hex()}", client=client)


def await_forgotten(client: Any, token: str, seconds: float = 60) -> None:
    """Until no worker holds a task of the executor marked ``token``: a task cancelled
    while it ran stays in its worker until its function returns."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(client.run(_cluster.worker._worker_holds, token).values()):
            return
        time.sleep(0.05)  # the cluster tells nobody when a worker forgets a task
    raise AssertionError("a worker still holds a task of the executor")


# ---------------------------------------------------------------------------------------
# Every end of a Dask task maps to the standard library's outcome
# ---------------------------------------------------------------------------------------


def first_element(a: np.ndarray, name: str) -> float:
    wait_for(name)
    return float(a[0])


def test_closing_the_client_fails_every_call_not_done_with_broken_executor(client):
    """The user's client closed under calls in flight: none returns None, none hangs.
    The executor is broken, as the standard library's when its workers are gone: every
    call not done (running or queued) fails with BrokenExecutor, and so does submit."""
    before = segments_now()
    theirs = distributed.Client(client.scheduler.address)
    ex = sharexec.ClusterExecutor(theirs)
    go = gate(client)
    a = np.ones(MiB // 8)  # sent once: the executor holds a blob on the cluster
    capacity = _cluster.connection._PER_THREAD * 2  # two workers of one thread
    futures = [ex.submit(first_element, a, go.name) for _ in range(capacity + 3)]
    assert_running_soon(futures[:capacity])
    theirs.close()
    _, not_done = concurrent.futures.wait(futures, timeout=30)
    assert not not_done
    for future in futures:
        error = future.exception()
        assert isinstance(error, BrokenExecutor), error
        assert "client" in str(error) and "not running" in str(error)
    with pytest.raises(BrokenExecutor):
        ex.submit(abs, -1)
    ex.shutdown(wait=True)
    go.set()
    await_forgotten(client, ex._token)
    assert_cluster_clean(client, ex)
    drop_warm_arrays()
    assert segments_now() - before == set(), "segments left behind"


def test_submit_after_the_client_closed_is_refused(client):
    theirs = distributed.Client(client.scheduler.address)
    ex = sharexec.ClusterExecutor(theirs)
    assert ex.submit(abs, -2).result(timeout=60) == 2
    theirs.close()
    with pytest.raises(BrokenExecutor, match="client"):
        ex.submit(abs, -1)
    ex.shutdown(wait=True)
    assert_cluster_clean(client, ex)


def test_a_call_cancelled_on_the_cluster_ends_cancelled(ex, client):
    """Its task cancelled by someone else (client.cancel, the dashboard): the call
    ends cancelled, as through Dask's own executor; the executor goes on."""
    go = gate(client)
    future = ex.submit(wait_for, go.name, 1)
    assert_running_soon([future])
    (key,) = [k for k in client.futures if ex._token in str(k)]
    distributed.Future(key, client).cancel()
    with pytest.raises(CancelledError):
        future.result(timeout=30)
    assert future.cancelled() and future.done() and not future.running()
    assert ex.submit(abs, -3).result(timeout=60) == 3
    go.set()
    await_forgotten(client, ex._token)


class Stop(BaseException):
    pass


def raise_base(kind: str) -> None:
    if kind == "exit":
        raise SystemExit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    raise Stop("stop")


@pytest.mark.parametrize(
    ("kind", "error"), [("exit", SystemExit), ("interrupt", KeyboardInterrupt), ("own", Stop)]
)
def test_a_base_exception_fails_its_own_call(ex, client, kind, error):
    """As the standard library's worker: the call fails with it (remote traceback as its
    cause), and neither the worker nor the executor suffers."""
    pids = set(client.run(os.getpid).values())
    with pytest.raises(error) as info:
        ex.submit(raise_base, kind).result(timeout=60)
    assert type(info.value.__cause__) is futures_process._RemoteTraceback
    assert "in raise_base" in str(info.value.__cause__)
    assert ex.submit(abs, -4).result(timeout=60) == 4
    assert set(client.run(os.getpid).values()) == pids  # no worker died


def exit_now() -> None:
    os._exit(1)


@pytest.mark.timeout(180)
def test_a_call_that_kills_its_worker_fails_with_killed_worker():
    """Dask reruns a call whose worker died; past ``allowed-failures`` it fails with
    Dask's KilledWorker, that call alone: the cluster, and the executor, go on."""
    import dask

    before = segments_now()
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        ex = sharexec.ClusterExecutor(n_workers=1, threads_per_worker=1, dashboard_address=":0")
    try:
        with pytest.raises(distributed.KilledWorker):
            ex.submit(exit_now).result(timeout=120)
        assert ex.submit(abs, -5).result(timeout=120) == 5
    finally:
        ex.shutdown(wait=True)
    assert segments_now() - before == set()


@pytest.mark.timeout(180)
def test_a_restart_of_the_cluster_breaks_the_executor(client):
    """client.restart() drops every task and array of the cluster, the executor's too:
    its calls in flight fail with BrokenExecutor, as do later submits."""
    ex = sharexec.ClusterExecutor(client)
    go = gate(client)
    futures = [ex.submit(wait_for, go.name, i) for i in range(2)]
    assert_running_soon(futures)
    # Both tasks on the scheduler first: one that reached it after the restart would run
    # there for nobody (the client forgets its keys at a restart, Dask's own race).
    deadline = time.monotonic() + 60
    while client.run_on_scheduler(_cluster.worker._scheduler_holds, ex._token) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)  # nothing tells when the scheduler has a task
    client.restart()
    for future in futures:
        error = future.exception(timeout=60)
        assert isinstance(error, BrokenExecutor) and "restarted" in str(error)
    with pytest.raises(BrokenExecutor):
        ex.submit(abs, -1)
    ex.shutdown(wait=True)
    client.wait_for_workers(2, timeout=60)
    assert_cluster_clean(client, ex)


# ---------------------------------------------------------------------------------------
# The local executor's API
# ---------------------------------------------------------------------------------------


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(getattr(cls, name))
        for name in dir(cls)
        if not name.startswith("_") and inspect.isfunction(getattr(cls, name))
    }


def test_both_executors_have_the_same_methods_and_signatures():
    """get_executor() returns either: code written for one runs on the other."""
    local = public_methods(sharexec.SharedProcessPoolExecutor)
    cluster = public_methods(sharexec.ClusterExecutor)
    assert local == cluster
    assert {"map", "statistics", "terminate_workers", "kill_workers"} <= set(cluster)


@pytest.mark.parametrize(
    ("buffersize", "error"),
    [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("2", TypeError)],
)
def test_a_bad_buffersize_is_refused_as_the_stdlib_does(ex, buffersize, error):
    items = Counted(iter(range(10)))
    with pytest.raises(error, match="buffersize"):
        ex.map(identity, items, buffersize=buffersize)
    assert items.taken == 0


def test_map_with_a_buffersize_takes_items_as_results_are_taken(ex):
    items = Counted(itertools.count())  # endless: without a buffer, map never returns
    results = ex.map(identity, items, buffersize=3)
    assert items.taken == 3  # submitted at the call, as the stdlib does
    assert [next(results) for _ in range(10)] == list(range(10))
    assert items.taken <= 10 + 3
    results.close()


def test_map_with_a_buffersize_and_chunks_counts_chunks(ex):
    items = Counted(itertools.count())
    results = ex.map(identity, items, chunksize=4, buffersize=2)
    assert items.taken == 8  # two chunks of four
    assert [next(results) for _ in range(10)] == list(range(10))
    assert items.taken <= (3 + 2) * 4
    results.close()
    assert list(ex.map(abs, range(-5, 5), buffersize=2)) == [abs(i) for i in range(-5, 5)]


def test_a_buffered_map_closed_submits_nothing_more(ex, client):
    """As the local executor's: the calls submitted ahead are the buffer's alone."""
    go = gate(client)
    capacity = _cluster.connection._PER_THREAD * 2
    blockers = [ex.submit(wait_for, go.name, i) for i in range(capacity)]
    assert_running_soon(blockers)
    results = ex.map(identity, range(100), buffersize=10)
    results.close()
    go.set()
    assert [f.result(timeout=60) for f in blockers] == list(range(capacity))
    assert ex.statistics().tasks_submitted == capacity + 10  # the blockers, the first ten


def test_statistics_count_what_was_sent_and_reused(ex):
    a = np.ones(2 * MiB // 8)
    empty = ex.statistics()
    assert empty.tasks_submitted == empty.bytes_copied == empty.bytes_reused == 0
    assert [ex.submit(np.sum, a).result(timeout=60) for _ in range(3)] == [a.size] * 3
    stats = ex.statistics()
    assert isinstance(stats, sharexec.Statistics)
    assert stats.bytes_copied == a.nbytes  # sent once
    assert stats.bytes_reused == 2 * a.nbytes  # then served the blob sent
    assert (stats.tasks_submitted, stats.tasks_done) == (3, 3)
    assert stats.segments_pooled == stats.bytes_pooled == stats.bytes_by_reference == 0
    assert stats.tasks_batched == stats.batches == stats.fallbacks == 0


@pytest.mark.parametrize("operation", ["terminate_workers", "kill_workers"])
def test_stopping_on_a_users_cluster_ends_the_calls_and_spares_its_workers(client, operation):
    """The calls not started are cancelled, the running ones fail with BrokenExecutor
    (their tasks cancelled), no call may be submitted; the user's workers live on."""
    before = segments_now()
    pids = client.run(os.getpid)
    ex = sharexec.ClusterExecutor(client)
    go = gate(client)
    capacity = _cluster.connection._PER_THREAD * 2
    futures = [ex.submit(wait_for, go.name, i) for i in range(capacity + 3)]
    running, queued = futures[:capacity], futures[capacity:]
    assert_running_soon(running)
    getattr(ex, operation)()
    assert all(f.cancelled() for f in queued)
    for future in running:
        assert isinstance(future.exception(timeout=30), BrokenExecutor)
    with pytest.raises(RuntimeError):
        ex.submit(abs, -1)
    go.set()
    ex.shutdown(wait=True)
    assert client.run(os.getpid) == pids  # the same workers
    assert client.submit(abs, -6).result(timeout=60) == 6
    await_forgotten(client, ex._token)
    assert_cluster_clean(client, ex)
    assert segments_now() - before == set()


@pytest.mark.timeout(180)
def test_kill_workers_kills_the_workers_of_a_cluster_it_started():
    from test_faults import wait_exit

    before = segments_now()
    ex = sharexec.ClusterExecutor(n_workers=1, threads_per_worker=1, dashboard_address=":0")
    pids = list(ex.client.run(os.getpid).values())
    go = gate(ex.client)
    running = ex.submit(wait_for, go.name)
    assert_running_soon([running])
    ex.kill_workers()
    assert isinstance(running.exception(timeout=30), BrokenExecutor)
    assert wait_exit(pids, 30) == []
    ex.shutdown(wait=True)
    assert ex._connection.cluster.status.name == "closed"
    assert segments_now() - before == set()
