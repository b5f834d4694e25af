"""The same program on a Dask cluster: sharexec.ClusterExecutor.

One ``LocalCluster(processes=True, n_workers=2, threads_per_worker=1)`` serves the module;
each test makes its own executor over it, and on teardown checks that the executor left
nothing behind: no task or blob on the scheduler or a worker, no segment on the host
(the workers' included), no executor chosen. The two-hosts test starts its own scheduler
and two workers, each in a private /dev/shm (a mount namespace, as /work/bin/ptest does).
"""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import math
import os
import pickle
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, as_completed
from concurrent.futures import process as futures_process
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sharexec

distributed = pytest.importorskip(
    "distributed", reason="the cluster executor needs distributed: pip install sharexec[dask]"
)

from conftest import drop_warm_arrays, segments_now  # noqa: E402

from sharexec import _cluster, _kept, _segments, _session  # noqa: E402
from sharexec.errors import SegmentError  # noqa: E402

dask = pytest.importorskip("dask")

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


# ---------------------------------------------------------------------------------------
# Fixtures: one cluster per module, one executor per test
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    cluster = distributed.LocalCluster(
        processes=True, n_workers=2, threads_per_worker=1, dashboard_address=":0"
    )
    client = distributed.Client(cluster)
    try:
        client.wait_for_workers(2, timeout=60)
        yield client
    finally:
        client.close()
        cluster.close()


def _worker_segments() -> tuple[int, int]:
    """In a worker: the segments it owns now (count, bytes), after a collection."""
    gc.collect()
    return _session.live()


def _shm_listing() -> list[tuple[str, int]]:
    """In a worker: the sharexec segments of its /dev/shm, with their sizes."""
    folder = "/dev/shm"
    return sorted(
        (n, os.stat(os.path.join(folder, n)).st_size)
        for n in os.listdir(folder)
        if n.startswith("sharexec-")
    )


def assert_cluster_clean(client: Any, ex: sharexec.ClusterExecutor) -> None:
    """Nothing of ``ex`` on the cluster, and no segment a worker owns."""
    token = ex._token
    assert client.run_on_scheduler(_cluster.worker._scheduler_holds, token) == 0
    assert not any(client.run(_cluster.worker._worker_holds, token).values())
    assert not [k for k in client.futures if token in str(k)]
    assert set(client.run(_worker_segments).values()) == {(0, 0)}


@pytest.fixture
def ex(client: Any) -> Iterator[sharexec.ClusterExecutor]:
    """An executor over the module's cluster; on teardown nothing of it may be left."""
    before = segments_now()
    executor = sharexec.ClusterExecutor(client)
    try:
        yield executor
    finally:
        executor.shutdown(wait=True)
        assert_cluster_clean(client, executor)
        drop_warm_arrays()
        assert segments_now() - before == set(), "segments left behind"
        assert _cluster.chosen() is None


# ---------------------------------------------------------------------------------------
# 1. Drop-in semantics
# ---------------------------------------------------------------------------------------


def stamp(_: Any = None) -> tuple[int, float]:
    return os.getpid(), random.random()


def test_every_call_runs(ex):
    """Never "pure": two equal calls are two runs (Dask's get_executor runs one)."""
    assert ex.submit(random.random).result() != ex.submit(random.random).result()
    stamps = list(ex.map(stamp, [0] * 6))
    assert len(set(stamps)) == 6


def echo(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    return args, kwargs


def test_keyword_arguments_of_any_name_reach_the_function(ex):
    names = [
        "key",
        "priority",
        "workers",
        "retries",
        "pure",
        "resources",
        "fn",
        "allow_other_workers",
    ]
    kwargs = {name: i for i, name in enumerate(names)}
    assert ex.submit(echo, 1, **kwargs).result() == ((1,), kwargs)


def current_task(_: Any) -> str:
    return str(distributed.get_worker().get_current_task())


def test_map_chunksize_groups_calls_into_tasks(ex):
    assert list(ex.map(abs, range(-7, 7), chunksize=4)) == [abs(i) for i in range(-7, 7)]
    keys = list(ex.map(current_task, range(10), chunksize=5))
    assert len(set(keys)) == 2 and keys[:5] == [keys[0]] * 5
    with pytest.raises(ValueError, match="chunksize"):
        ex.map(abs, [1], chunksize=0)


def wait_for(name: str, value: Any = None) -> Any:
    """Block until the distributed.Event ``name`` is set (a task the test holds)."""
    assert distributed.Event(name).wait(timeout=60)
    return value


def test_map_timeout(ex, client):
    gate = distributed.Event(f"gate-{os.urandom(4).hex()}", client=client)
    results = ex.map(wait_for, [gate.name] * 2, timeout=0.2)
    with pytest.raises(concurrent.futures.TimeoutError):
        next(results)
    gate.set()


def assert_running_soon(futures: list[concurrent.futures.Future[Any]]) -> None:
    """Dispatching is the executor's own thread's: nothing tells when it is done but the
    futures' state, so look, for a while (the calls wait for a gate: none finishes)."""
    deadline = time.monotonic() + 30
    while not all(f.running() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(f.running() for f in futures)


def test_cancel_running_and_shutdown_cancel_futures(ex, client):
    """A call given to Dask is running (cancel returns False); one still waiting in the
    executor is not, and is cancelled by cancel() or shutdown(cancel_futures=True)."""
    gate = distributed.Event(f"gate-{os.urandom(4).hex()}", client=client)
    capacity = _cluster.connection._PER_THREAD * 2  # two workers of one thread
    futures = [ex.submit(wait_for, gate.name, i) for i in range(capacity + 4)]
    running, waiting = futures[:capacity], futures[capacity:]
    assert_running_soon(running)
    assert not any(f.running() or f.done() for f in waiting)
    assert not running[0].cancel()
    assert waiting[0].cancel() and waiting[0].cancelled()
    ex.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in waiting)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(abs, 1)
    gate.set()
    assert [f.result(timeout=60) for f in running] == list(range(capacity))


def fail(message: str) -> None:
    raise ValueError(message)


class Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("no pickling")


def raise_unpicklable() -> None:
    raise Unpicklable("here")


class NeedsTwo(Exception):
    def __init__(self, a, b):  # pickles, but rebuilding calls NeedsTwo(*args): one short
        super().__init__(a)


def raise_needs_two() -> None:
    raise NeedsTwo(1, 2)


def test_exceptions_keep_their_type_with_the_remote_traceback(ex):
    with pytest.raises(ValueError, match="boom") as info:
        ex.submit(fail, "boom").result()
    cause = info.value.__cause__
    assert type(cause) is futures_process._RemoteTraceback  # the standard library's
    assert "in fail" in str(cause) and "ValueError: boom" in str(cause)
    with pytest.raises(RuntimeError, match="Unpicklable"):
        ex.submit(raise_unpicklable).result()
    # One that pickles but cannot be rebuilt fails its call alone, as on one machine.
    with pytest.raises(sharexec.ResultError, match="NeedsTwo"):
        ex.submit(raise_needs_two).result()
    assert ex.submit(abs, -4).result() == 4


def test_wait_and_as_completed(ex):
    futures = [ex.submit(fail, "bad") if i == 1 else ex.submit(abs, -i) for i in range(5)]
    done, _ = concurrent.futures.wait(futures, timeout=60, return_when=FIRST_EXCEPTION)
    assert futures[1] in done
    got = {f: f.exception() for f in as_completed(futures, timeout=60)}
    assert isinstance(got[futures[1]], ValueError)
    assert [f.result() for i, f in enumerate(futures) if i != 1] == [0, 2, 3, 4]


# ---------------------------------------------------------------------------------------
# 2. Large private arrays and buffers: sent once, copy semantics
# ---------------------------------------------------------------------------------------


def blobs_held(client: Any, ex: sharexec.ClusterExecutor) -> int:
    """The executor's blobs: those the client holds on the cluster (it lets go at once, on
    its event loop; the cluster follows), and the copies whose name it gives tasks."""
    client.sync(loop_turn)
    by_name = sum(sent.future is None for sent in ex._sender.sent.values())
    return by_name + sum(f"{ex._token}-blob" in str(key) for key in client.futures)


def bump_first(a: np.ndarray) -> float:
    a[0] += 1
    return float(a[0])


def test_an_array_is_sent_once_and_each_task_writes_its_own_copy(ex, client):
    a = np.ones(2 * MiB // 8)
    assert [ex.submit(bump_first, a).result() for _ in range(3)] == [2.0, 2.0, 2.0]
    assert list(ex.map(bump_first, [a] * 4)) == [2.0] * 4
    assert a[0] == 1.0  # the caller's array is untouched
    assert ex._sender.bytes_sent == a.nbytes  # seven calls, one send


def test_zeros_travel_as_their_length_and_each_task_writes_its_own(ex, client):
    a = np.zeros(2 * MiB // 8)
    out = sharexec.zeros(2 * MiB // 8)
    assert [ex.submit(bump_first, a).result() for _ in range(3)] == [1.0, 1.0, 1.0]
    assert list(ex.map(bump_first, [a] * 2)) == [1.0] * 2
    assert a[0] == 0.0  # the caller's array is untouched
    assert ex.submit(write_every_other, out[2:], 0, 3.0).result() is None
    assert not out[:2].any() and (out[2::2] == 3.0).all() and not out[3::2].any()
    assert ex._sender.bytes_sent == 0 and blobs_held(client, ex) == 0  # nothing sent, or held
    a[-1] = 1.0  # no longer zeros: sent
    assert ex.submit(np.sum, a).result() == 1.0
    assert ex._sender.bytes_sent == a.nbytes


def test_bytes_are_hashed_the_same_when_copied_as_they_are_hashed():
    data = memoryview(np.random.default_rng(2).integers(0, 256, 3 * MiB + 5, np.uint8))
    copy = bytearray(len(data))

    def write(offset: int, step: memoryview) -> None:
        copy[offset : offset + len(step)] = step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_cluster.blobs, "_HASH_PIECE", 2 * MiB)  # two pieces, on two threads
        assert _cluster.blobs._digest(data, write) == _cluster.blobs._digest(data)
    assert copy == data and _cluster.blobs._digest(data) != _cluster.blobs._digest(data[:-1])
    assert _cluster.blobs._zeros(memoryview(bytes(3 * MiB))) and not _cluster.blobs._zeros(data)


def test_a_changed_array_is_never_served_a_stale_copy(ex, client):
    a = np.arange(MiB // 8, dtype=np.float64)
    assert ex.submit(np.sum, a).result() == a.sum()
    a[-1] = -1.0  # in place: same object, new bytes
    assert ex.submit(np.sum, a).result() == a.sum()
    assert ex._sender.bytes_sent == 2 * a.nbytes
    assert blobs_held(client, ex) == 1  # the old bytes were let go
    del a
    gc.collect()
    assert blobs_held(client, ex) == 0  # and the new ones with the array


def nbytes_sum(b: Any) -> int:
    return int(np.frombuffer(b, np.uint8).sum(dtype=np.int64))


def test_protocol5_buffers_and_gappy_views_are_sent_once(ex, client):
    data = bytearray(os.urandom(MiB))
    expected = int(np.frombuffer(data, np.uint8).sum(dtype=np.int64))
    buffer = pickle.PickleBuffer(data)  # out of band at protocol 5
    futures = [ex.submit(nbytes_sum, buffer) for _ in range(3)]
    assert [f.result() for f in futures] == [expected] * 3
    assert ex._sender.bytes_sent == len(data)  # three calls, one send
    grid = np.random.default_rng(0).random((1024, 1024))
    gappy = grid[::2, ::2]
    assert ex.submit(np.sum, gappy).result() == pytest.approx(gappy.sum())
    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"x": np.arange(MiB // 8, dtype=np.float64)})
    assert ex.submit(lambda f: float(f["x"].sum()), frame).result() == frame["x"].sum()


class Handle:
    """Holds a lock, so it cannot be pickled by itself: a reducer registered with
    multiprocessing's ForkingPickler says how (as the standard library's executor, and
    the local one, pickle it)."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.lock = threading.Lock()


def rebuild_handle(value: int) -> Handle:
    return Handle(value)


def reduce_handle(handle: Handle) -> Any:
    return rebuild_handle, (handle.value,)


def handle_value(handle: Handle) -> int:
    return handle.value


@pytest.fixture
def handle_reducer() -> Iterator[None]:
    ForkingPickler.register(Handle, reduce_handle)
    try:
        yield
    finally:
        ForkingPickler._extra_reducers.pop(Handle, None)  # type: ignore[attr-defined]


def test_a_call_pickles_through_the_local_executors_pass_and_tables(ex, handle_reducer):
    # The reducer tables of the local executor's pass: what registered with ForkingPickler.
    assert ex.submit(handle_value, Handle(7)).result(timeout=60) == 7
    assert ex.submit(handle_value, handle=Handle(8)).result(timeout=60) == 8
    with sharexec.SharedProcessPoolExecutor(1) as local:
        assert local.submit(handle_value, Handle(7)).result(timeout=60) == 7
    # Less those that hand over a file descriptor: a socket does not cross hosts.
    with socket.socket() as sock, pytest.raises(TypeError, match="socket"):
        ex.submit(id, sock).result(timeout=60)


# ---------------------------------------------------------------------------------------
# 3. Shared arrays: copy-in, copy-out
# ---------------------------------------------------------------------------------------


def fill_rows(block: np.ndarray, first_row: int) -> None:
    rows = np.arange(first_row, first_row + block.shape[0])[:, None]
    block[...] = np.sin(rows * np.linspace(0.0, 1.0, block.shape[1]))


def test_the_seed_fill_program_gives_the_same_result(ex):
    """examples/fill_shared_array.py, with the cluster executor."""
    rows, cols, tasks = 512, 1024, 8
    out = sharexec.zeros((rows, cols))
    bounds = np.linspace(0, rows, tasks + 1).astype(int)
    futures = [ex.submit(fill_rows, out[lo:hi], lo) for lo, hi in itertools.pairwise(bounds)]
    for f in futures:
        f.result()
    expected = np.sin(np.arange(rows)[:, None] * np.linspace(0.0, 1.0, cols))
    assert np.array_equal(out, expected)


def write_every_other(view: np.ndarray, start: int, value: float) -> None:
    view[start::2] = value


def test_only_changed_elements_are_written_back(ex):
    """Two tasks writing the even and the odd elements of one slice: both land."""
    a = sharexec.zeros(1000)
    part = a[100:900]
    futures = [
        ex.submit(write_every_other, part, 0, 1.0),
        ex.submit(write_every_other, part, 1, 2.0),
    ]
    for f in futures:
        f.result()
    assert np.array_equal(a[100:900:2], np.ones(400)) and np.array_equal(
        a[101:900:2], 2 * np.ones(400)
    )
    assert not a[:100].any() and not a[900:].any()


def write_then_fail(view: np.ndarray) -> None:
    view[::3] = -1.0
    raise KeyError("after writing")


def read_wait_write(view: np.ndarray, started: str, gate: str) -> float:
    distributed.Queue(started).put(float(view.sum()))
    assert distributed.Event(gate).wait(timeout=60)
    seen = float(view.sum())
    view += 1.0
    return seen


def test_writes_come_back_when_the_task_raises_and_tasks_see_a_snapshot(ex, client):
    a = sharexec.share(np.arange(12.0).reshape(3, 4))
    with pytest.raises(KeyError):
        ex.submit(write_then_fail, a.T).result()  # a transposed view
    assert (a[:, [0, 3]] == -1.0).all() and np.array_equal(a[:, 1:3], [[1, 2], [5, 6], [9, 10]])
    b = sharexec.share(np.full(MiB, 0.5))  # 8 MB: its snapshot is sent as a blob
    started = distributed.Queue(f"started-{os.urandom(4).hex()}", client=client)
    gate = distributed.Event(f"gate-{os.urandom(4).hex()}", client=client)
    future = ex.submit(read_wait_write, b, started.name, gate.name)
    assert started.get(timeout=60) == 0.5 * MiB  # the task has read its values
    b[:] = 5.0  # the task does not see this: a snapshot, not live memory
    gate.set()
    assert future.result() == 0.5 * MiB
    assert np.array_equal(b, np.full(MiB, 1.5))  # it changed every element, after me: it wins


# ---------------------------------------------------------------------------------------
# 4. Results come back and leave the cluster
# ---------------------------------------------------------------------------------------


def test_results_come_back_and_leave_the_cluster(ex, client):
    r = ex.submit(np.full, MiB, 3.0).result()
    assert r.shape == (MiB,) and r.flags.writeable and (r == 3.0).all()
    client.sync(loop_turn)  # the client let go of it on its loop: after this turn
    assert not [k for k in client.futures if ex._token in str(k) and "blob" not in str(k)]


async def loop_turn() -> None:
    """Nothing, on the client's event loop: what was queued on it before is done."""


def test_differential_evolution_through_map(ex):
    scipy_optimize = pytest.importorskip("scipy.optimize")
    options: dict[str, Any] = {"updating": "deferred", "rng": 1234, "maxiter": 5}
    bounds = [(-2.0, 2.0)] * 3
    serial = scipy_optimize.differential_evolution(scipy_optimize.rosen, bounds, **options)
    remote = scipy_optimize.differential_evolution(
        scipy_optimize.rosen, bounds, workers=ex.map, **options
    )
    assert np.array_equal(remote.x, serial.x) and remote.fun == serial.fun


# ---------------------------------------------------------------------------------------
# 5. One copy per host
# ---------------------------------------------------------------------------------------


def blob_segment(key: str, dask_worker: Any = None) -> str | None:
    """In a worker: the segment holding the blob ``key``, if it holds that blob."""
    blob = dask_worker.data.get(key)
    return None if blob is None else blob.name


def segment_of_argument(a: np.ndarray, started: str, gate: str) -> tuple[int, str]:
    """In a task: its worker's pid and the segment its argument maps, once the other
    task of the test runs too (so the two run on the two workers)."""
    distributed.Queue(started).put(os.getpid())
    assert distributed.Event(gate).wait(timeout=60)
    base: Any = a
    while not isinstance(base, _segments.Mapping):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return os.getpid(), base.name


def test_workers_of_one_host_share_one_copy(ex, client):
    a = np.random.default_rng(1).random(8 * MiB // 8)
    started = distributed.Queue(f"started-{os.urandom(4).hex()}", client=client)
    gate = distributed.Event(f"gate-{os.urandom(4).hex()}", client=client)
    futures = [ex.submit(segment_of_argument, a, started.name, gate.name) for _ in range(2)]
    assert len({started.get(timeout=60) for _ in futures}) == 2  # both running: 2 workers
    gate.set()
    (first, name), (second, other) = (f.result() for f in futures)
    # The client copied it once into a segment of its own, and each worker of its host
    # mapped that segment by name: every worker is on this host, so the name went in
    # each task, and Dask holds nothing.
    assert first != second and name == other and name.startswith(f"sharexec-{os.getpid()}-")
    (sent,) = ex._sender.sent.values()
    assert sent.future is None and len(pickle.dumps(sent.copy, protocol=5)) < 1000
    assert [s for s in _shm_listing() if s[0] == name] == [(name, a.nbytes)]
    managed = client.run(lambda dask_worker: dask_worker.state.nbytes)
    assert sum(managed.values()) < a.nbytes // 8
    # the array is still a copy per task, whichever worker runs it
    assert list(ex.map(bump_first, [a] * 4)) == [a[0] + 1] * 4
    assert ex._sender.bytes_sent == a.nbytes


def mapped_before_reading(a: np.ndarray) -> tuple[int, int, float]:
    """In a task: its worker's pid, how many pages of its argument's mapping were mapped
    before it read them (all: a mapping kept from an earlier task; none: a fresh one),
    and their sum."""
    from test_kept import _pages_mapped

    base: Any = a
    while not isinstance(base, _segments.Mapping):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    return os.getpid(), _pages_mapped(base, 0, len(base)), float(a.sum())


def kept_in_worker() -> int:
    """In a worker: the mappings it keeps, less those of segments gone (as a task does)."""
    _kept.kept.drop_unlinked()
    return len(_kept.kept._kept)


def test_a_worker_reuses_its_mapping_of_a_copy_until_a_task_writes_into_it(ex, client):
    a = np.random.default_rng(3).random(2 * MiB // 8)
    pages = a.nbytes // os.sysconf("SC_PAGE_SIZE")
    runs = [ex.submit(mapped_before_reading, a).result() for _ in range(6)]
    first: dict[int, int] = {}
    for pid, mapped, total in runs:
        assert total == a.sum()
        assert mapped == (pages if pid in first else 0)  # fresh, then kept and reused
        first.setdefault(pid, mapped)
    assert list(ex.map(bump_first, [a] * 4)) == [a[0] + 1] * 4  # they write: not reused
    after: dict[int, int] = {}
    for _ in range(4):
        pid, mapped, _ = ex.submit(mapped_before_reading, a).result()
        after.setdefault(pid, mapped)
    assert set(after.values()) == {0}  # each worker's first mapping after the writes is new
    ex.shutdown(wait=True)  # the client frees its copy: the workers drop their mappings
    assert set(client.run(kept_in_worker).values()) == {0}


def test_a_name_without_its_bytes_fails_clearly_where_it_cannot_be_mapped():
    # The client sends its host's workers the name of its copy alone: a worker that
    # cannot map it (gone, or on another host) says so, and never makes up bytes.
    digest = b"\x00" * 32
    with pytest.raises(SegmentError, match="the client's copy of a 4096-byte argument"):
        _cluster.blobs._arrive(digest, 4096, _cluster.blobs._host(), "sharexec-1-gone", None)
    with pytest.raises(SegmentError, match="is on another host"):
        _cluster.blobs._arrive(digest, 4096, "another-host", "sharexec-1-gone", None)


WORKER_IN_PRIVATE_SHM = 'mount -t tmpfs -o mode=1777,size=1g tmpfs /dev/shm && exec "$0" "$@"'


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[tuple[Any, list[subprocess.Popen[bytes]]]]:
    """A scheduler here and two workers, each in its own /dev/shm (two "hosts")."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for private /dev/shm mounts")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace: {probe.stderr.decode().strip()}")
    cluster = distributed.LocalCluster(n_workers=0, processes=True, dashboard_address=":0")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
        ),
    }
    logs = [open(tmp_path / f"host{i}.log", "wb") for i in range(2)]  # noqa: SIM115
    workers = [
        subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                WORKER_IN_PRIVATE_SHM,
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                cluster.scheduler_address,
                "--nthreads",
                "1",
                "--no-nanny",
                "--no-dashboard",
                "--name",
                f"host{i}",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=logs[i],
        )
        for i in range(2)
    ]
    client = distributed.Client(cluster)
    try:
        client.wait_for_workers(2, timeout=60)
        yield client, workers
    finally:
        client.close()
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(timeout=30)
        for log in logs:
            log.close()
        cluster.close()


def test_two_hosts_one_copy_each(two_hosts):
    client, _ = two_hosts
    listings = client.run(_shm_listing)
    assert set(map(tuple, listings.values())) == {()}  # two fresh /dev/shm
    ex = sharexec.ClusterExecutor(client)
    try:
        a = np.random.default_rng(2).random(4 * MiB // 8)
        assert ex.submit(np.sum, a).result() == pytest.approx(a.sum())
        (sent,) = ex._sender.sent.values()
        client.replicate([sent.future], n=2)
        names = client.run(blob_segment, sent.future.key)
        assert len(set(names.values())) == 2  # a segment on each host
        listings = client.run(_shm_listing)
        assert sorted(len(v) for v in listings.values()) == [1, 1]
        for worker, listing in listings.items():
            assert listing == [(names[worker], a.nbytes)]
        assert list(ex.map(bump_first, [a] * 4)) == [a[0] + 1] * 4
    finally:
        ex.shutdown(wait=True)
    assert set(map(tuple, client.run(_shm_listing).values())) == {()}


# ---------------------------------------------------------------------------------------
# 6. get_executor, for library code
# ---------------------------------------------------------------------------------------


def library_norm(a: np.ndarray) -> float:
    """Library code: parallel over sharexec.get_executor(), unaware of any cluster."""
    ex = sharexec.get_executor()
    return math.sqrt(sum(ex.map(lambda part: float(part @ part), np.array_split(a, 4))))


def test_get_executor_returns_the_chosen_cluster(client):
    a = np.arange(100.0)
    with sharexec.use_cluster(client) as ex:
        assert sharexec.get_executor() is ex and sharexec.get_executor(3) is ex
        assert library_norm(a) == pytest.approx(np.linalg.norm(a))
        token = ex._token
    assert _cluster.chosen() is None
    assert client.run_on_scheduler(_cluster.worker._scheduler_holds, token) == 0
    with sharexec.use_cluster(ex2 := sharexec.ClusterExecutor(client)):
        assert sharexec.get_executor() is ex2
    assert _cluster.chosen() is None
    ex2.submit(abs, 1).result()  # left running: the caller's to shut down
    ex2.shutdown()
    assert_cluster_clean(client, ex2)


def test_an_owned_local_cluster_is_closed_at_shutdown():
    before = segments_now()
    started = time.monotonic()
    with sharexec.ClusterExecutor(n_workers=1, threads_per_worker=1, dashboard_address=":0") as ex:
        cluster = ex._connection.cluster
        assert ex.submit(abs, -3).result() == 3
    assert cluster.status.name == "closed" and ex.client.status == "closed"
    assert segments_now() - before == set()
    assert time.monotonic() - started < 60
    with pytest.raises(TypeError, match="cluster options"):
        sharexec.ClusterExecutor("tcp://127.0.0.1:1", n_workers=2)


# ---------------------------------------------------------------------------------------
# Dask's start methods
# ---------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_the_seed_program_under_each_start_method_of_dask_workers(method):
    """The workers are Dask's: they start with Dask's method (not the ``start_method``
    fixture's, which includes loky's own); the program runs the same under each."""
    before = segments_now()
    with dask.config.set({"distributed.worker.multiprocessing-method": method}):
        cluster = distributed.LocalCluster(
            processes=True, n_workers=1, threads_per_worker=1, dashboard_address=":0"
        )
    client = distributed.Client(cluster)
    try:
        with sharexec.ClusterExecutor(client) as ex:
            out = sharexec.zeros((256, 1024))
            bounds = [0, 64, 128, 256]
            for f in [
                ex.submit(fill_rows, out[lo:hi], lo) for lo, hi in itertools.pairwise(bounds)
            ]:
                f.result()
            a = np.ones(MiB // 8)
            assert list(ex.map(bump_first, [a] * 2)) == [2.0, 2.0] and a[0] == 1.0
        assert_cluster_clean(client, ex)
    finally:
        client.close()
        cluster.close()
    expected = np.sin(np.arange(256)[:, None] * np.linspace(0.0, 1.0, 1024))
    assert np.array_equal(out, expected)
    del out
    drop_warm_arrays()
    assert segments_now() - before == set()
