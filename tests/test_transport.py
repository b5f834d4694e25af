"""The sharing rules (docs/how-it-works.md), each checked by value, under the default start
method and spawn."""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
from concurrent.futures import process as futures_process
from typing import Any

import numpy as np
import pytest
import workers

import sharexec

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]

LARGE = 300_000  # float64 elements: 2.4 MB, above the 256 KiB default threshold
SMALL = 100


@dataclasses.dataclass
class Box:
    """A user object hiding arrays inside it, several levels deep."""

    payload: Any


def deep(x: Any, depth: int = 6) -> Any:
    for i in range(depth):
        x = [{"level": i, "inner": (Box(x),)}]
    return x


def undeep(x: Any, depth: int = 6) -> Any:
    for _ in range(depth):
        x = x[0]["inner"][0].payload
    return x


# ---------------------------------------------------------------------------------------
# Rule 1: shared arrays travel by reference, writes are seen both ways
# ---------------------------------------------------------------------------------------


def test_fill_one_array_from_slices(executor):
    """Our users' first problem, as written, with only the allocation changed."""
    arr = sharexec.zeros(4)
    futures = [executor.submit(workers.do_stuff, i, arr[i : i + 1]) for i in range(4)]
    for f in futures:
        f.result()
    assert arr.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_fill_one_array_with_pool_apply(mp_context, no_leaks):
    arr = sharexec.zeros(4)
    with mp_context.Pool(2) as pool:
        for i in range(4):
            pool.apply(workers.do_stuff, (i, arr[i : i + 1]))
    assert arr.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(lambda a: a, id="whole"),
        pytest.param(lambda a: a[3:17], id="slice"),
        pytest.param(lambda a: a[::3], id="strided"),
        pytest.param(lambda a: a[::-2], id="negative-stride"),
        pytest.param(lambda a: a.reshape(20, 30).T, id="transposed"),
        pytest.param(lambda a: a.reshape(20, 30)[2:9, ::-4], id="2d-offset-odd-strides"),
        pytest.param(lambda a: a[5:6].reshape(()), id="0-d"),
        pytest.param(lambda a: a[7:7], id="empty"),
    ],
)
def test_worker_writes_through_shared_views(executor, view):
    a = sharexec.zeros(600)
    v = view(a)
    expected = np.zeros(600)
    view(expected)[...] = 5.0
    executor.submit(workers.fill, v, 5.0).result()
    np.testing.assert_array_equal(a, expected)


def test_f_order_shared_array(executor):
    a = sharexec.zeros((40, 30), order="F")
    executor.submit(workers.fill, a[:, 10:20], 2.0).result()
    assert a.flags.f_contiguous
    assert a[:, 10:20].sum() == 2.0 * 400 and a.sum() == 2.0 * 400


def test_parent_writes_seen_by_worker_after_dispatch(executor):
    """Our users' second problem, through a task: the worker reads after the parent wrote."""
    from multiprocessing import get_context

    a = sharexec.zeros(2)
    with get_context("spawn").Manager() as manager:
        started, go = manager.Event(), manager.Event()
        future = executor.submit(workers.wait_then_read, a, started, go)
        assert started.wait(60)
        a[0] = 1.0
        go.set()
        assert future.result() == 1.0


def test_parent_writes_seen_by_plain_process(mp_context, no_leaks):
    """Our users' second problem, with a plain multiprocessing.Process."""
    a = sharexec.zeros(2)
    started, go = mp_context.Event(), mp_context.Event()
    queue = mp_context.Queue()
    p = mp_context.Process(target=_child_reads, args=(a, started, go, queue))
    p.start()
    try:
        assert started.wait(60)
        a[0] = 1.0
        go.set()
        assert queue.get(timeout=60) == 1.0
    finally:
        p.join(60)
    assert p.exitcode == 0


def _child_reads(a, started, go, queue):
    started.set()
    go.wait(60)
    queue.put(float(a[0]))


def test_what_forkingpickler_registers_pickles_by_that_reducer_both_ways(executor):
    """Parity with the standard library's pickler: a reducer registered with
    multiprocessing's ForkingPickler (after sharexec was imported) pickles the object in
    the call and in the result, and wins over copyreg's, as it does in the stdlib."""
    from multiprocessing.reduction import ForkingPickler

    assert pickle.loads(ForkingPickler.dumps(workers.Marked([]))).trail == ["ForkingPickler"]
    back = executor.submit(workers.identity, {"deep": [workers.Marked([])]}).result()
    assert back["deep"][0].trail == ["ForkingPickler", "ForkingPickler"]


def test_shared_arrays_nested_in_containers_and_kwargs(executor):
    a = sharexec.zeros(10)
    b = sharexec.zeros(10)
    executor.submit(workers.fill, undeep(deep(a[2:5])), 1.0).result()
    executor.submit(_fill_kw, out={"x": (b[::2],)}, value=3.0).result()
    assert a.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert b.tolist() == [3, 0] * 5


def _fill_kw(*, out, value):
    out["x"][0][...] = value


def test_shared_result_view_comes_back_by_reference(executor):
    a = sharexec.zeros(LARGE)
    r = executor.submit(workers.return_arg_view, a).result()
    assert sharexec.is_shared(r) and isinstance(r, sharexec.SharedArray)
    r[...] = 9.0  # writes into a, as the view did in the worker
    assert a[1:-1:2].sum() == 9.0 * r.size and a[0] == 0.0


def test_worker_allocated_shared_array_is_handed_to_parent(executor):
    r = executor.submit(workers.make_shared, 1000, 4.0).result()
    assert sharexec.is_shared(r) and r.tolist() == [4.0] * 1000
    # the parent now owns it: another worker writes into it, the parent sees the write
    executor.submit(workers.fill, r[:10], -1.0).result()
    assert r[:10].tolist() == [-1.0] * 10 and r[10] == 4.0


@pytest.mark.process
def test_shared_array_passed_as_initarg(start_method, no_leaks):
    flags = sharexec.zeros(64)
    table = np.arange(LARGE, dtype=float)
    with sharexec.SharedProcessPoolExecutor(
        2, mp_context=start_method, initializer=workers.init_worker, initargs=(table, flags)
    ) as ex:
        results = [ex.submit(workers.read_initialized).result() for _ in range(4)]
    assert flags.sum() >= 1  # each initializer wrote into the shared array
    for value, in_segment, shared in results:
        assert value == table.sum()
        assert shared
        assert in_segment or start_method == "fork"  # fork inherits, nothing is sent


def test_shared_array_pickled_to_bytes_stores_its_data():
    a = sharexec.full(5, 3.0)
    b = pickle.loads(pickle.dumps(a))
    assert type(b) is np.ndarray and b.tolist() == [3.0] * 5
    b[0] = 0
    assert a[0] == 3.0


# ---------------------------------------------------------------------------------------
# Rule 2: large private arrays are copied once, seen copy-on-write
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.arange(LARGE, dtype=np.float64), id="contiguous"),
        pytest.param(lambda: np.arange(4 * LARGE, dtype=np.int32)[5::3], id="offset-strided"),
        pytest.param(lambda: np.arange(2 * LARGE, dtype=np.float64)[::-1], id="negative"),
        pytest.param(
            lambda: np.asfortranarray(np.arange(LARGE, dtype=np.float32).reshape(600, -1)),
            id="f-order",
        ),
        pytest.param(
            lambda: np.arange(2 * LARGE, dtype=np.float64).reshape(1000, -1)[:, :500],
            id="non-contiguous-columns",
        ),
        pytest.param(lambda: np.arange(LARGE, dtype=">f8"), id="big-endian"),
        pytest.param(lambda: np.arange(LARGE).astype("datetime64[s]"), id="datetime64"),
        pytest.param(lambda: np.zeros(LARGE, dtype=[("x", "<i4"), ("y", "<f8")]), id="structured"),
        pytest.param(lambda: np.arange(LARGE, dtype=complex), id="complex"),
    ],
)
def test_large_private_arrays_arrive_exact_through_a_segment(executor, make):
    a = make()
    got = executor.submit(workers.describe, a).result()
    assert got["in_segment"] and not got["shared"] and got["writeable"]
    assert got["dtype"] == a.dtype  # byte order included
    np.testing.assert_array_equal(got["copy"], a)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.arange(SMALL, dtype=float), id="small"),
        pytest.param(lambda: np.array(3.5), id="0-d"),
        pytest.param(lambda: np.zeros((0, 5)), id="empty"),
        pytest.param(lambda: np.array([{"a": 1}, None, "x"] * 100_000, dtype=object), id="object"),
    ],
)
def test_small_and_object_arrays_are_pickled(executor, make):
    a = make()
    got = executor.submit(workers.describe, a).result()
    assert not got["in_segment"]
    assert got["dtype"] == a.dtype and got["copy"].shape == a.shape
    assert got["copy"].tolist() == a.tolist()


def test_worker_writes_to_private_argument_stay_private(executor):
    a = np.arange(LARGE, dtype=float)
    expected = a.copy()
    assert executor.submit(workers.write_and_sum, a).result() == 7.0 * LARGE
    np.testing.assert_array_equal(a, expected)
    # a second task gets its own, untouched view
    assert executor.submit(workers.total, a).result() == expected.sum()


def test_private_arrays_nested_in_containers_kwargs_and_objects(executor):
    a = np.arange(LARGE, dtype=float)
    got = executor.submit(workers.describe, undeep(deep(a))).result()
    assert got["in_segment"]
    np.testing.assert_array_equal(got["copy"], a)
    x = np.ones(LARGE)
    y = {"nested": [np.full(LARGE, 2.0)]}
    assert executor.submit(workers.kwargs_sum, x=x, y=y).result() == 3.0 * LARGE


def test_views_of_one_private_array_in_one_task_alias_as_in_the_parent(executor):
    """Several views of one base in one task share one copy: they alias in the worker as
    they do in the parent (a write through one shows through the other)."""
    a = np.arange(LARGE, dtype=float)
    before = a.copy()
    got = executor.submit(_write_first_read_second, a, a[::-1]).result()
    assert got == 7.0  # a[::-1][-1] is a[0]
    np.testing.assert_array_equal(a, before)  # and the parent never sees it


def _write_first_read_second(first, second):
    first[0] = 7.0
    return float(second[-1])


def test_changed_array_is_never_served_a_stale_copy(executor):
    from multiprocessing import get_context

    a = np.ones(LARGE)
    with get_context("spawn").Manager() as manager:
        go = manager.Event()
        held = executor.submit(workers.hold, a, go)  # keeps its copy of `a` in flight
        same = executor.submit(workers.total, a).result()
        a[123] = 1000.0
        changed = executor.submit(workers.total, a).result()
        go.set()
        assert held.result() == LARGE
    assert same == LARGE
    assert changed == LARGE - 1 + 1000.0


def test_large_copies_and_comparisons_run_in_slices_and_miss_no_byte(executor, monkeypatch):
    """Copies and comparisons of 16 MiB or more run on several cores in the parent: a
    change in the last slice is seen, and every byte of every slice arrives."""
    from sharexec import _reduction

    monkeypatch.setattr(_reduction, "_CORES", 3)  # 3 slices, even on a 2-core machine
    a = np.random.default_rng(5).random(6_000_000 + 3)  # 48 MB and a ragged end
    a_sum = float(a.sum())
    from multiprocessing import get_context

    with get_context("spawn").Manager() as manager:
        go = manager.Event()
        held = executor.submit(workers.hold, a, go)  # keeps the copy in flight
        assert executor.submit(workers.total, a).result() == pytest.approx(a_sum, rel=1e-12)
        a[-1] += 1000.0  # in the last slice of the comparison
        changed = executor.submit(workers.describe, a).result()
        go.set()
        assert held.result() == pytest.approx(a_sum, rel=1e-12)
    np.testing.assert_array_equal(changed["copy"], a)


def test_a_slice_that_fails_fails_the_whole_and_every_slice_ends_first(monkeypatch):
    from sharexec import _reduction

    monkeypatch.setattr(_reduction, "_CORES", 4)
    n = 4 * _reduction._PARALLEL_SLICE + 5
    seen: list[tuple[int, int]] = []

    def work(low: int, high: int) -> bool:
        seen.append((low, high))
        if low > 0 and high == n:
            raise OSError("the last slice failed")
        return True

    with pytest.raises(OSError, match="last slice"):
        _reduction._in_parallel(n, work)
    seen.sort()
    assert len(seen) == 4 and seen[0][0] == 0 and seen[-1][1] == n
    assert all(high == low for (_, high), (low, _) in itertools.pairwise(seen))


def test_a_copy_serves_tasks_submitted_before_it_as_is_and_later_ones_once_compared(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """A copy made after a task was submitted is a snapshot of that task's
    argument, taken no later than the stdlib would; a later task's bytes are compared."""
    from sharexec import _copies, _transport
    from sharexec._config import Options

    compared: list[int] = []
    same_bytes = _copies._same_bytes
    monkeypatch.setattr(
        _copies, "_same_bytes", lambda a, b, n: compared.append(n) or same_bytes(a, b, n)
    )
    transport = _transport.Transport(Options.resolve({}))
    a = np.ones(LARGE)

    def submitted() -> _transport.Task:
        return _transport.Task(workers.total, (a,), {}, transport)

    def segment(task: _transport.Task) -> str:
        _, (_, buffers, *_) = task.__reduce__()
        return str(buffers[0][0])

    burst = [submitted() for _ in range(4)]  # all submitted before anything is sent
    sent = {segment(t) for t in burst}
    assert len(sent) == 1
    assert compared == []  # one copy, then reused as it is: no comparison
    a[123] = 1000.0
    late = submitted()
    renewed = segment(late)
    assert renewed not in sent  # compared, changed: a new copy
    again = submitted()
    assert segment(again) == renewed  # compared, unchanged: reused
    assert compared == [a.nbytes, a.nbytes]
    for task in [*burst, late, again]:
        task.release()
    transport.close()


class Rewritten:
    """Pickles as a buffer it rewrites each time: the same address, other bytes."""

    scratch = np.empty(LARGE)

    def __init__(self, value: float) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        Rewritten.scratch[:] = self.value
        return np.array, (Rewritten.scratch,)


class Temporary:
    """Pickles as a temporary array, freed after the pass (its address is reused)."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __reduce__(self) -> Any:
        return np.array, (np.full(LARGE, self.value),)


@pytest.mark.parametrize("kind", [Rewritten, Temporary])
def test_a_buffer_made_while_pickling_is_compared_never_trusted(
    kind: type, no_leaks: None
) -> None:
    """Only an array the task was given as an argument can be trusted without a
    comparison: bytes made by a __reduce__ differ from task to task at one address."""
    from sharexec import _transport
    from sharexec._config import Options

    transport = _transport.Transport(Options.resolve({}))
    burst = [_transport.Task(workers.total, (kind(float(i)),), {}, transport) for i in range(3)]
    for task in burst:  # all submitted before the first is sent
        task.__reduce__()
    sent = [np.frombuffer(task.keep[0], np.float64, LARGE) for task in burst]
    assert [float(x[0]) for x in sent] == [0.0, 1.0, 2.0]
    assert [float(x[-1]) for x in sent] == [0.0, 1.0, 2.0]
    del sent
    for task in burst:
        task.release()
    transport.close()


def test_memory_is_bounded_by_tasks_in_flight(executor):
    a = np.random.default_rng(0).random(4_000_000)  # 32 MB
    futures = [executor.submit(workers.sum_and_segment_bytes, a, os.getpid()) for _ in range(50)]
    results = [f.result() for f in futures]
    assert all(s == a.sum() for s, _ in results)
    peak = max(b for _, b in results)
    assert peak <= 2 * a.nbytes + (1 << 20), f"{peak / a.nbytes:.1f} copies in shared memory"


def test_map_over_chunks_of_a_large_array(executor):
    a = np.random.default_rng(1).random(4_000_000)  # 2 MB chunks
    chunks = np.array_split(a, 16)
    assert list(executor.map(workers.total, chunks)) == [float(c.sum()) for c in chunks]
    assert list(executor.map(workers.in_segment, chunks)) == [True] * 16


@pytest.mark.process
def test_private_array_passed_as_initarg_is_copied_once(start_method, no_leaks):
    table = np.arange(LARGE, dtype=float)
    flags = sharexec.zeros(64)
    with sharexec.SharedProcessPoolExecutor(
        2, mp_context=start_method, initializer=workers.init_worker, initargs=(table, flags)
    ) as ex:
        value, in_segment, _ = ex.submit(workers.read_initialized).result()
    assert value == table.sum()
    assert in_segment == (start_method != "fork")


# ---------------------------------------------------------------------------------------
# Rule 3: out-of-band buffers of any protocol-5 object
# ---------------------------------------------------------------------------------------


class ZeroCopyBytes(bytearray):
    """A protocol-5 object, as in the pickle documentation."""

    def __reduce_ex__(self, protocol):
        if protocol >= 5:
            return type(self)._reconstruct, (pickle.PickleBuffer(self),), None
        return type(self)._reconstruct, (bytearray(self),)

    @classmethod
    def _reconstruct(cls, obj):
        with memoryview(obj) as m:
            return cls(m)  # a copy, as pickle's example does on load


def test_protocol5_buffers_of_other_objects_go_through_segments(executor):
    big = ZeroCopyBytes(b"ab" * 1_000_000)
    small = ZeroCopyBytes(b"xy" * 10)
    got_big, got_small = executor.submit(workers.identity, (big, small)).result()
    assert type(got_big) is ZeroCopyBytes and got_big == big
    assert type(got_small) is ZeroCopyBytes and got_small == small


def test_protocol5_buffer_seen_in_worker_comes_from_a_segment(executor):
    assert executor.submit(_buffer_in_segment, _Raw(np.arange(LARGE))).result()


class _Raw:
    """Hands its array's bytes out of band and rebuilds without copying."""

    def __init__(self, a):
        self.a = a

    def __reduce_ex__(self, protocol):
        return _raw_rebuild, (pickle.PickleBuffer(self.a.view(np.uint8)),)


def _raw_rebuild(buf):
    return np.frombuffer(buf, np.uint8)


def _buffer_in_segment(raw):
    return workers.in_segment(raw)


# ---------------------------------------------------------------------------------------
# Rule 5: results come back through shared memory
# ---------------------------------------------------------------------------------------


def test_large_result_comes_back_through_a_segment(executor):
    r = executor.submit(workers.make_private, LARGE, 2.5).result()
    assert type(r) is np.ndarray and r.flags.writeable
    assert workers.in_segment(r) and not sharexec.is_shared(r)
    assert r.tolist() == [2.5] * LARGE
    r[0] = 0  # private: nobody else sees it


def test_small_result_is_pickled(executor):
    r = executor.submit(workers.make_private, SMALL, 2.5).result()
    assert not workers.in_segment(r) and r.tolist() == [2.5] * SMALL


def test_returned_private_argument_is_copied_back(executor):
    a = np.arange(LARGE, dtype=float)
    r = executor.submit(workers.return_arg_view, a).result()
    np.testing.assert_array_equal(r, a[1:-1:2])
    assert not sharexec.is_shared(r)


def test_nested_results(executor):
    r = executor.submit(workers.identity, deep({"x": np.arange(LARGE)})).result()
    np.testing.assert_array_equal(undeep(r)["x"], np.arange(LARGE))


def test_result_passed_to_another_task_is_copied(executor):
    r = executor.submit(workers.make_private, LARGE, 1.0).result()
    assert executor.submit(workers.write_and_sum, r).result() == 7.0 * LARGE
    assert r.tolist() == [1.0] * LARGE


# ---------------------------------------------------------------------------------------
# Errors keep their types
# ---------------------------------------------------------------------------------------


def test_task_exception_keeps_type_and_remote_traceback(executor):
    f = executor.submit(workers.raise_value_error, "boom")
    with pytest.raises(ValueError, match="boom") as info:
        f.result()
    assert "raise_value_error" in str(info.value.__cause__)
    # Of the standard library's type, as its executor gives it.
    assert type(info.value.__cause__) is futures_process._RemoteTraceback


def test_task_with_large_argument_that_raises_frees_its_segments(executor):
    f = executor.submit(_raise_after_reading, np.ones(LARGE))
    with pytest.raises(ZeroDivisionError):
        f.result()


def _raise_after_reading(a):
    return a.sum() / 0 if False else 1 / 0


def test_lambdas_and_closures_work(executor):
    k = 3.0
    assert executor.submit(lambda a: float(a.sum()) * k, np.ones(LARGE)).result() == 3.0 * LARGE


def test_gappy_view_copies_only_its_elements(executor):
    a = np.random.default_rng(2).random(4_000_000)  # 32 MB
    for view in (a[::4], a.reshape(2000, 2000)[:, :500], a.reshape(2000, 2000)[::-2, 1::2].T):
        total, in_use = executor.submit(workers.sum_and_segment_bytes, view, os.getpid()).result()
        assert total == pytest.approx(view.sum(), rel=1e-12)
        assert in_use < 2 * view.nbytes, f"{in_use} bytes shared for a {view.nbytes}-byte view"
        got = executor.submit(workers.describe, view).result()
        np.testing.assert_array_equal(got["copy"], view)


def test_views_of_a_copied_base_add_no_copy(executor):
    a = np.random.default_rng(3).random(2_000_000)  # 16 MB
    (_, in_use), *_ = executor.submit(_sum_all, os.getpid(), a, a[::2], a.T, a[::-3]).result()
    assert in_use < 1.5 * a.nbytes


def _sum_all(creator, *arrays):
    return [workers.sum_and_segment_bytes(x, creator) for x in arrays]


def test_warm_segments_are_reused_but_never_under_a_view_a_worker_kept(start_method, no_leaks):
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        first = np.full(400_000, 1.0)
        assert ex.submit(workers.keep_and_sum, first).result() == 400_000.0
        for i in range(2, 6):  # same size: would reuse the first copy if it were pooled
            assert ex.submit(workers.total, np.full(400_000, float(i))).result() == 400_000 * i
        assert ex.submit(workers.kept_sums).result() == [10.0]  # what it kept never changed
        # copies no worker kept are pooled and reused: few segments for many tasks
        names = set()
        for i in range(6):
            future = ex.submit(workers.total, np.full(400_000, float(i)))
            assert future.result() == 400_000 * i
            names |= set(ex._transport.pooled())
        assert 1 <= len(names) <= 3


# ---------------------------------------------------------------------------------------
# Calls that cannot hold a buffer skip the pass (many tiny tasks)
# ---------------------------------------------------------------------------------------


def _scaled(x: float, *, by: float = 2.0) -> float:
    return x * by


scaled_by_value = eval("lambda x, by=2.0: x * by")  # reachable by no name: pickled by value
ATOMS = (None, True, 3, 2.5, 1j, "text", b"bytes")


@pytest.mark.parametrize(
    "call",
    [
        (workers.identity, (ATOMS,), {}),
        (workers.identity, (list(ATOMS),), {}),
        (_scaled, (3.0,), {"by": 4.0}),
        (scaled_by_value, (3.0,), {"by": 4.0}),
        (scaled_by_value, (), {"x": 1.5}),
    ],
    ids=["atoms", "list-of-atoms", "kwargs", "by-value", "kwargs-only"],
)
def test_a_plain_call_pickles_as_the_pass_would(call: tuple[Any, ...]) -> None:
    """The plain road writes what the pass writes, only cheaper."""
    from sharexec import _reduction, _transport
    from sharexec._config import Options

    transport = _transport.Transport(Options.resolve({}))
    fn, args, kwargs = call
    plain = transport.plain_call(fn, args, kwargs)
    assert plain is not None
    by_pass = _reduction.dumps(call, _reduction.ForwardSink(transport))
    assert by_pass.buffers == [] and by_pass.keep == []
    (fn1, args1, kwargs1), (fn2, args2, kwargs2) = (
        pickle.loads(plain),
        pickle.loads(by_pass.payload),
    )
    assert (args1, kwargs1) == (args2, kwargs2) == (args, kwargs)
    assert fn1(*args1, **kwargs1) == fn2(*args2, **kwargs2) == fn(*args, **kwargs)
    # a by-value function is sent as the pickle cached for it, as the pass sends it
    assert (fn1 is fn) == (fn2 is fn) == (fn is not scaled_by_value)


def test_a_function_of_a_module_registered_by_value_is_sent_by_value(executor):
    """cloudpickle.register_pickle_by_value: a module the workers cannot import."""
    import cloudpickle

    from sharexec import _transport
    from sharexec._config import Options

    cloudpickle.register_pickle_by_value(workers)
    try:
        transport = _transport.Transport(Options.resolve({}))
        plain = transport.plain_call(workers.identity, (1,), {})
        assert plain is not None
        fn, args, _ = pickle.loads(plain)
        assert fn is not workers.identity and fn(*args) == 1  # rebuilt from its pickle
        assert executor.submit(workers.identity, (1, "a")).result() == (1, "a")
    finally:
        cloudpickle.unregister_pickle_by_value(workers)


def _closure() -> Any:
    k = 2

    def times_k(x: int) -> int:
        return x * k

    return times_k


@pytest.mark.parametrize(
    "call",
    [
        (workers.identity, (np.ones(3),), {}),  # an array, even small: numpy's pickle
        (workers.identity, (), {"x": np.ones(LARGE)}),
        (workers.identity, ([1] * 17,), {}),  # long: not scanned
        (workers.identity, ({"a": 1},), {}),
        (workers.identity, (np.float64(1.0),), {}),
        (workers.identity, (bytearray(b"x"),), {}),  # a protocol-5 buffer
        (workers.identity, ((1, (2,)),), {}),  # nested
        (_closure(), (3,), {}),  # by value, not cacheable: its cells may change
        (len, ("abc",), {}),  # not a Python function
    ],
    ids=[
        "small-array",
        "large-array-kwarg",
        "long-list",
        "dict",
        "numpy-scalar",
        "bytearray",
        "nested",
        "closure",
        "builtin",
    ],
)
def test_a_call_that_may_hold_a_buffer_takes_the_pass(call: tuple[Any, ...]) -> None:
    from sharexec import _transport
    from sharexec._config import Options

    transport = _transport.Transport(Options.resolve({}))
    assert transport.plain_call(*call) is None


def test_plain_calls_of_every_kind_of_function(executor):
    k = 5
    calls = [
        (workers.identity, (ATOMS,), {}),
        (_scaled, (3.0,), {"by": 4.0}),
        (scaled_by_value, (), {"x": 1.5}),
        (lambda x: x + k, (1,), {}),  # a closure: the pass
        (divmod, (7, 2), {}),  # a builtin: the pass
    ]
    futures = [executor.submit(fn, *args, **kwargs) for fn, args, kwargs in calls * 50]
    expected = [fn(*args, **kwargs) for fn, args, kwargs in calls * 50]
    assert [f.result() for f in futures] == expected


def test_a_cancelled_task_lets_go_of_its_arguments_and_counts_as_done(start_method, no_leaks):
    import weakref
    from multiprocessing import get_context

    with (
        sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex,
        get_context("spawn").Manager() as manager,
    ):
        started, go = manager.Event(), manager.Event()
        busy = ex.submit(workers.wait_then_read, np.ones(4), started, go)
        assert started.wait(60)
        # loky queues at most a few calls ahead of its one worker: the last is pending
        queued = [ex.submit(workers.total, np.ones(SMALL)) for _ in range(5)]
        argument = np.ones(LARGE)
        alive = weakref.ref(argument)
        last = ex.submit(workers.total, argument)
        del argument
        assert last.cancel()
        assert alive() is None  # the cancelled call holds its arguments no more
        go.set()
        assert busy.result() == 1.0
        assert [f.result() for f in queued] == [float(SMALL)] * 5
        stats = ex.statistics()
        assert stats.tasks_submitted == stats.tasks_done == 7


def test_a_function_collected_while_the_function_table_is_locked_does_not_deadlock() -> None:
    """The collector may run in a thread that holds the table's lock (an allocation under
    it), and then run the weak reference's callback of a function it frees, which takes
    the lock too."""
    import gc
    import threading

    from sharexec._transport import Functions

    functions = Functions(None)  # type: ignore[arg-type]

    def make() -> Any:
        def again(n: int) -> int:  # refers to itself through its cell: only gc frees it
            return again(n - 1) if n else 0

        return again

    fn = make()
    assert not functions.by_name(fn)
    del fn
    done = threading.Event()

    def collect_under_the_lock() -> None:
        with functions._lock:
            gc.collect()
        done.set()

    threading.Thread(target=collect_under_the_lock, daemon=True).start()
    assert done.wait(30), "the callback waited for a lock its own thread held"
    assert functions._by_name == {}


# ---------------------------------------------------------------------------------------
# A function sent by value: its large globals travel once, not with every call
# ---------------------------------------------------------------------------------------

# About 800 KB of a script's module-level data, of each kind.
SCRIPT_DATA = {
    "array": "np.arange(100_000, dtype=np.float64)",
    "list": "[float(i) for i in range(100_000)]",
    "bytes": "bytes(range(256)) * 3125",
}

SCRIPT = """
import numpy as np

DATA = {data}


def fitness(individual):
    return len(DATA), float(sum(individual)), float(DATA[-1])
"""


@pytest.fixture(params=sorted(SCRIPT_DATA))
def script(request: pytest.FixtureRequest, no_leaks: None) -> Any:
    """A module pickled by value (as a script's ``__main__`` is), with 800 KB of globals;
    dropped afterwards, with this process's namespace of it (before ``no_leaks`` looks:
    the segments its function was sent by go with it)."""
    from conftest import module_by_value

    name = f"sharexec_test_globals_{request.param}_{os.getpid()}"
    with module_by_value(name, SCRIPT.format(data=SCRIPT_DATA[request.param])) as module:
        yield module


def _call_bytes(transport: Any, fn: Any, *args: Any) -> int:
    """What the call queue pickles for one call of ``fn(*args)``."""
    from sharexec._transport import Task

    task = Task(fn, args, {}, transport)
    try:
        return len(pickle.dumps(task))
    finally:
        task.release()


def test_a_function_sent_by_value_carries_its_globals_once(executor, script):
    fitness = script.fitness
    expected = (len(script.DATA), 3.0, float(script.DATA[-1]))
    before = executor.statistics()
    calls = [(fitness, [1.0, 2.0])] * 60 + [(fitness, np.array([1.0, 2.0]))] * 60
    futures = [executor.submit(fn, arg) for fn, arg in calls]
    assert [f.result() for f in futures] == [expected] * len(calls)
    after = executor.statistics()
    # The function's pickle (and the array among its globals) copied once, for every
    # worker, and never again: no copy made or compared per call.
    assert after.bytes_copied - before.bytes_copied <= 1_000_000
    assert after.bytes_reused == before.bytes_reused
    # A call names it: a few hundred bytes with plain arguments or through the pass.
    assert _call_bytes(executor._transport, fitness, [1.0, 2.0]) < 2_000
    assert _call_bytes(executor._transport, fitness, np.array([1.0, 2.0])) < 2_000
    assert executor.submit(fitness, [1.0, 2.0]).result() == expected
    assert executor.statistics().bytes_copied == after.bytes_copied


def test_a_function_s_segments_go_at_shutdown_while_it_lives(start_method, script):
    from conftest import segments_now

    before = segments_now()
    with sharexec.SharedProcessPoolExecutor(2, mp_context=start_method) as ex:
        assert ex.submit(script.fitness, [1.0]).result()[0] == len(script.DATA)
        assert segments_now() - before, "the function's pickle lies in a segment"
    assert not segments_now() - before
    assert script.fitness  # it lives on


class _Fresh:
    """Pickles as a new function object each time, made while the call is pickled."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __reduce__(self) -> Any:
        import operator
        import types

        fn = self.fn
        fresh = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__)
        return operator.itemgetter(0), ((fresh,),)


def test_a_function_made_while_pickling_keeps_its_segments_until_its_call_is_done(
    executor, script
):
    # Collected once the call is pickled: its call still finds the segments it names.
    import operator

    expected = (len(script.DATA), 3.0, float(script.DATA[-1]))
    futures = [
        executor.submit(operator.call, _Fresh(script.fitness), [1.0, 2.0]) for _ in range(6)
    ]
    assert [f.result() for f in futures] == [expected] * 6
