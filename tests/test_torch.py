"""PyTorch tensors through sharexec: torch's semantics, sharexec's transport.

Every behaviour under every start method. Skipped as a whole where torch is not
installed: torch is an optional dependency (the ``torch`` extra; CI installs it).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import textwrap
from multiprocessing import get_context
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is optional: pip install 'sharexec[torch]'")

import torch_workers  # noqa: E402  (imports torch)
from conftest import assert_none_left  # noqa: E402
from test_faults import finish, left_by, run_scenario  # noqa: E402

import sharexec  # noqa: E402
from sharexec import _tensors  # noqa: E402

# Tensors are transport semantics (the default start method and spawn), each test on a
# pool of its own: most count the bytes copied and the segments live from zero.
pytestmark = [pytest.mark.timeout(180), pytest.mark.transport, pytest.mark.fresh_pool]

# A process forked after torch ran a parallel region on its OpenMP threads (torch.zeros of
# a large tensor does) deadlocks in its own first one: GNU OpenMP is not fork-safe. That is
# torch's caveat with the fork start method, the standard library's executor included (the
# user's risk). This test process runs torch on one thread so that every
# start method can be tested; test_moving_a_tensor_leaves_a_later_fork_safe checks, with
# torch's default threads, that sharexec itself adds no OpenMP region to the parent.
torch.set_num_threads(1)

LARGE = 1 << 20  # float32 elements: 4 MiB, above the 256 KiB threshold and the arena's
SMALL = 16


@dataclasses.dataclass
class Box:
    payload: Any


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------------------------------
# The seed program, and torch's own shared memory
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["share_memory_", "private", "sharexec segment"])
def test_the_seed_program_sees_the_parents_write_after_submit(executor, kind):
    """The first program of our founding material, with an executor: the task waits, the
    parent writes after submit, the task reads the new value (as under the stdlib)."""
    if kind == "share_memory_":
        a = torch.zeros(2).share_memory_()
    elif kind == "private":
        a = torch.zeros(2)  # moved into shared memory when the task is sent
    else:
        a = torch.from_numpy(sharexec.zeros(2, dtype=np.float32))
    with get_context("spawn").Manager() as manager:
        started, go = manager.Event(), manager.Event()
        future = executor.submit(torch_workers.wait_then_read, a, started, go)
        assert started.wait(60)
        a[0] = 1.0
        go.set()
        assert future.result(timeout=60) == 1.0
    assert sharexec.is_shared(a)


def test_a_tensor_in_torchs_shared_memory_goes_through_torchs_reducer(executor):
    a = torch.zeros(4).share_memory_()
    assert executor.submit(torch_workers.shared_by_torch, a).result(timeout=60)
    executor.submit(torch_workers.add_one, a).result(timeout=60)
    assert a.tolist() == [1.0] * 4
    assert _tensors.in_segment(a.untyped_storage()) is None  # still torch's memory


def test_tensor_sharing_torch_leaves_private_tensors_to_torchs_reducer(start_method, no_leaks):
    with sharexec.SharedProcessPoolExecutor(
        2, mp_context=start_method, tensor_sharing="torch"
    ) as ex:
        t = torch.zeros(LARGE)
        assert ex.submit(torch_workers.shared_by_torch, t).result(timeout=60)
        ex.submit(torch_workers.add_one, t).result(timeout=60)
        assert float(t[0]) == 1.0 and t.is_shared()  # torch's shared memory, torch's way
        r = ex.submit(torch_workers.full, LARGE, 2.0).result(timeout=60)
        assert r.is_shared() and float(r[-1]) == 2.0  # a result too, as under the stdlib
        by_ref = torch.from_numpy(sharexec.zeros(LARGE, dtype=np.float32))
        ex.submit(torch_workers.add_one, by_ref).result(timeout=60)
        assert float(by_ref[-1]) == 1.0 and _tensors.in_segment(by_ref.untyped_storage())


def test_other_tensors_go_through_torchs_reducer(executor):
    """Sparse tensors: torch's reducers, as through the stdlib (their storages, which
    those reduce to, through sharexec's segments). A conjugate view keeps its bit (torch's
    reducer would drop it)."""
    with torch.sparse.check_sparse_tensor_invariants():  # else torch's rebuild warns
        sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
        back = executor.submit(pow, sparse, 1).result(timeout=60)
    assert back.layout == torch.sparse_coo and torch.equal(back.to_dense(), sparse.to_dense())
    conj = torch.tensor([1 + 2j, 3 - 1j]).conj()
    out = executor.submit(torch_workers.describe, conj).result(timeout=60)
    assert torch.equal(out[6].resolve_conj(), conj.resolve_conj())


# ---------------------------------------------------------------------------------------
# Private tensors in: moved into shared memory, torch's semantics
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [SMALL, LARGE], ids=["small", "large"])
def test_a_private_tensor_sent_to_a_task_ends_up_shared(executor, n):
    t = torch.zeros(n)
    view = t[-4:]  # made before the send: every view of the storage moves with it
    assert not sharexec.is_shared(t)
    executor.submit(torch_workers.add_one, t).result(timeout=60)
    assert float(t[0]) == 1.0 and view.tolist() == [1.0] * 4
    assert sharexec.is_shared(t) and sharexec.is_shared(view)
    t[0] = 5.0  # and the parent's writes are the worker's: the same memory, both ways
    assert executor.submit(torch_workers.describe, t).result(timeout=60)[6][0] == 5.0


def test_a_large_move_keeps_every_byte_around_chunks_of_zeros(executor):
    """A storage with a segment of its own is written as the segment is created, all
    but its chunks of zeros (fresh shared memory reads as zeros): every byte arrives,
    in the worker and in the parent's moved tensor, an odd tail included."""
    chunk = _tensors._ZERO_CHUNK
    t = torch.randint(1, 256, (3 * chunk + 5,), dtype=torch.uint8)
    t[chunk : 2 * chunk] = 0  # a whole chunk of zeros, skipped
    t[2 * chunk + 7] = 0  # a zero inside a chunk that is written
    expected = t.clone()
    values = executor.submit(torch_workers.describe, t).result(timeout=60)[6]
    assert torch.equal(values, expected) and torch.equal(t, expected)
    assert _tensors.in_segment(t.untyped_storage()) is not None


def test_private_tensors_nested_in_containers_and_kwargs(executor):
    tensors = [torch.zeros(n) for n in (SMALL, LARGE, SMALL, LARGE, SMALL)]
    in_segment = torch.from_numpy(sharexec.zeros(LARGE, dtype=np.float32))  # by reference
    nested = {"a": [tensors[0], (tensors[1],)], "b": Box({"deep": [Box(tensors[2])]})}
    nested["c"] = Box({"deeper": (Box([in_segment[1:]]),)})
    future = executor.submit(torch_workers.add_one, [nested, tensors[3], Box(tensors[4])])
    future.result(timeout=60)
    assert all(float(t[0]) == 1.0 and float(t[-1]) == 1.0 for t in tensors)
    assert all(map(sharexec.is_shared, tensors))
    assert float(in_segment[0]) == 0.0 and float(in_segment[1]) == float(in_segment[-1]) == 1.0
    moved = sum(t.untyped_storage().nbytes() for t in tensors[1::2])  # the large private
    assert executor.statistics().bytes_copied <= moved + 3 * 4096  # never the segment's
    kwargs = {"x": torch.zeros(LARGE)}
    executor.submit(torch_workers.add_one, **kwargs).result(timeout=60)
    assert float(kwargs["x"][-1]) == 1.0


DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.bool,
    torch.complex64,
    torch.int64,
]


def test_every_dtype_and_geometry_arrives_as_it_was(executor):
    for dtype in DTYPES:  # one executor for all of them
        base = (torch.arange(4 * 6 * 5) % 7).to(dtype).reshape(4, 6, 5)
        for t in (base, base.transpose(0, 2), base[1:, ::2, 3], base[2, 3, 4], base[:0]):
            expected = t.clone()
            name, kind, shape, stride, offset, grad, values, shared = executor.submit(
                torch_workers.describe, t
            ).result(timeout=60)
            assert (name, kind, shape, stride, offset) == (
                "Tensor",
                dtype,
                tuple(t.shape),
                t.stride(),
                t.storage_offset(),
            ), dtype
            assert torch.equal(values, expected) and not grad and shared, dtype


def test_a_parameter_stays_a_parameter_and_keeps_requires_grad(executor):
    p = torch.nn.Parameter(torch.ones(3))
    name, _, _, _, _, grad, values, _ = executor.submit(torch_workers.describe, p).result(
        timeout=60
    )
    assert name == "Parameter" and grad and values.tolist() == [1.0] * 3
    leaf = torch.ones(2, requires_grad=True)
    assert executor.submit(torch_workers.describe, leaf).result(timeout=60)[5]


def test_a_non_leaf_that_requires_grad_is_refused_as_torch_refuses_it(executor):
    with pytest.raises(Exception) as info:  # loky's PicklingError, torch's error its cause
        executor.submit(torch_workers.describe, torch.ones(2, requires_grad=True) * 2).result(
            timeout=60
        )
    causes = [info.value, info.value.__cause__]
    assert any("non-leaf tensor which requires_grad" in str(e) for e in causes)


def test_two_views_of_one_storage_arrive_as_views_of_one_storage(executor):
    t = torch.zeros(LARGE)
    back, same = executor.submit(torch_workers.write_through_first, t[::2], t[:10]).result(
        timeout=60
    )
    assert back == 42.0 and same and float(t[0]) == 42.0


def test_a_tensor_sent_again_goes_by_reference(executor):
    t = torch.zeros(LARGE)
    executor.submit(torch_workers.add_one, t).result(timeout=60)
    copied = executor.statistics().bytes_copied
    assert copied == t.untyped_storage().nbytes()  # moved once
    executor.submit(torch_workers.add_one, t).result(timeout=60)
    assert executor.statistics().bytes_copied == copied  # not again
    assert float(t[0]) == 2.0


def test_two_thousand_tensors_in_one_call(executor):
    """2,000 small tensors take a few segments (arenas), not 2,000 segments and file
    descriptors, and each is shared."""
    tensors = [torch.full((SMALL + i % 7,), 1.0) for i in range(2000)]
    expected = sum(t.numel() for t in tensors)
    before = open_fds()
    assert executor.submit(torch_workers.set_each, tensors).result(timeout=120) == expected
    assert [float(t[0]) for t in tensors] == [float(i) for i in range(2000)]
    assert open_fds() - before < 20
    names = {_tensors.in_segment(t.untyped_storage())[0].name for t in tensors}
    assert len(names) <= 3


# ---------------------------------------------------------------------------------------
# Tensors over sharexec segments: by reference, write-through
# ---------------------------------------------------------------------------------------


def test_fill_one_big_tensor_from_many_workers(executor):
    """A tensor over a sharexec array: every task writes its slice in place; nothing is
    copied, and no descriptor is opened per task."""
    a = sharexec.zeros(64 * 4096, dtype=np.float32)
    t = torch.from_numpy(a)
    executor.submit(torch_workers.fill, t, 0, 1, 0.0).result(timeout=60)  # workers up
    before = open_fds()
    futures = [
        executor.submit(torch_workers.fill, t, i * 4096, (i + 1) * 4096, float(i))
        for i in range(64)
    ]
    for f in futures:
        f.result(timeout=60)
    assert open_fds() - before < 5
    assert np.array_equal(a, np.repeat(np.arange(64, dtype=np.float32), 4096))
    stats = executor.statistics()
    assert stats.bytes_copied == 0 and stats.bytes_by_reference >= 64 * a.nbytes


def test_sharexec_share_moves_a_tensor_in_place(executor):
    t = torch.zeros(LARGE)
    view = t[10:20]
    assert sharexec.share(t) is t
    assert sharexec.is_shared(t) and sharexec.is_shared(view)
    executor.submit(torch_workers.fill, view, 0, 10, 3.0).result(timeout=60)
    assert float(t[15]) == 3.0
    assert executor.statistics().bytes_copied == 0
    with pytest.raises(TypeError, match="strided"):
        sharexec.share(torch.ones(2).to_sparse())
    torch_shared = torch.zeros(2).share_memory_()
    assert sharexec.share(torch_shared) is torch_shared  # shared already: left as it is
    assert _tensors.in_segment(torch_shared.untyped_storage()) is None


def test_a_result_that_views_an_argument_comes_back_by_reference(executor):
    t = sharexec.share(torch.zeros(LARGE))
    back = executor.submit(torch_workers.view_of, t).result(timeout=60)
    back[0] = 9.0
    assert float(t[1]) == 9.0


def test_a_tensor_the_worker_shares_is_handed_to_the_parent(executor):
    r = executor.submit(torch_workers.allocate_shared, LARGE).result(timeout=60)
    assert sharexec.is_shared(r) and float(r[-1]) == 5.0
    owner = _tensors.in_segment(r.untyped_storage())[0]
    assert sharexec._tracking.owns(owner)  # the parent frees it now (no_leaks checks)


# ---------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------


def test_results_keep_their_type_dtype_and_geometry(executor):
    out = executor.submit(torch_workers.results, LARGE).result(timeout=60)
    expected = torch_workers.results(LARGE)
    for key in ("large", "small", "half", "empty", "scalar"):
        assert type(out[key]) is torch.Tensor and out[key].dtype == expected[key].dtype
        assert torch.equal(out[key], expected[key])
    assert type(out["param"]) is torch.nn.Parameter and out["param"].requires_grad
    for got, want in zip(out["views"], expected["views"], strict=True):
        assert torch.equal(got, want) and got.stride() == want.stride()
    base, transposed, strided = out["views"]
    base[0, 0] = -1.0  # the three views came back over one storage, as they left
    assert float(transposed[0, 0]) == -1.0 and float(strided[0, 0]) == -1.0
    assert [float(t[0]) for t in out["list"]] == [0.0, 1.0, 2.0]
    out["large"][0] = 8.0  # writable, and the parent's own
    assert float(out["large"][0]) == 8.0


def test_large_results_come_back_through_segments_lent_for_them(executor):
    for i in range(4):
        r = executor.submit(torch_workers.full, LARGE, float(i)).result(timeout=60)
        assert float(r[0]) == i and float(r[-1]) == i
        del r
        gc.collect()
    assert executor._transport.pooled()  # the results' segments, warm for the next


def test_a_result_sent_back_to_a_task_is_shared_with_it(executor):
    r = executor.submit(torch_workers.full, LARGE, 1.0).result(timeout=60)
    executor.submit(torch_workers.add_one, r).result(timeout=60)
    assert float(r[0]) == 2.0 and sharexec.is_shared(r)


# ---------------------------------------------------------------------------------------
# Crashes, and torch stays optional
# ---------------------------------------------------------------------------------------


@pytest.mark.process
def test_no_segment_left_after_a_worker_is_killed(start_method, tmp_path):
    proc = run_scenario(
        tmp_path,
        """
        import torch
        torch.set_num_threads(1)  # fork after torch's OpenMP threads: see the top of the file
        sys.path.insert(0, os.environ["TESTS"])
        import torch_workers

        if __name__ == "__main__":
            ex = sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD)
            shared = sharexec.share(torch.zeros(1 << 20))
            small = [torch.ones(16) for _ in range(50)]
            large = torch.ones(1 << 20)
            futures, refused = [], 0
            for _ in range(4):
                try:
                    futures.append(ex.submit(torch_workers.die, shared, small, large))
                except BrokenProcessPool:
                    refused += 1
            broken = [isinstance(f.exception(), BrokenProcessPool) for f in futures]
            print("broken", all(broken) and len(broken) + refused == 4)
            print("moved", sharexec.is_shared(large) or refused == 4)
            ex.shutdown()
            announce_sweeper()
        """,
        start_method,
        env={**os.environ, "TESTS": os.path.dirname(__file__)},
    )
    out = finish(proc)
    assert "broken True" in out and "moved True" in out
    assert_none_left(left_by(proc))


def test_moving_a_tensor_leaves_a_later_fork_safe(tmp_path):
    """sharexec copies with NumPy, never on torch's OpenMP threads: a process that only
    moved tensors (never ran a parallel torch op itself) forks workers that can."""
    script = tmp_path / "fork_after_move.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import sharexec

            def add_one(t):
                t += 1  # a parallel region, on the worker's OpenMP threads
                return float(t[-1])

            if __name__ == "__main__":
                t = torch.empty(1 << 22)
                t.numpy()[:] = 1  # no torch op on threads in this process
                sharexec.share(t)  # moved, in the main thread
                small = torch.empty(16)
                with sharexec.SharedProcessPoolExecutor(1, mp_context="spawn") as ex:
                    ex.submit(add_one, small).result(timeout=60)  # moved by the feeder
                with sharexec.SharedProcessPoolExecutor(1, mp_context="fork") as ex:
                    print(ex.submit(add_one, t).result(timeout=60))
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.0"]


def test_import_sharexec_does_not_import_torch():
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import sharexec
        a = sharexec.zeros(10)
        with sharexec.SharedProcessPoolExecutor(1, mp_context="spawn") as ex:
            ex.submit(float, 1).result()
            ex.submit(np.sum, a).result()
        print("torch" in sys.modules, "sharexec._tensors" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "False"], out.stderr


@pytest.mark.process
def test_a_worker_imports_torch_only_for_a_task_that_carries_a_tensor(start_method, no_leaks):
    # Unless it starts with the parent's modules, torch among them: a forked worker
    # inherits them, the warm server of the default start method imported them.
    warm = start_method in ("fork", None)
    loaded = "'torch' in __import__('sys').modules"
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        assert ex.submit(eval, loaded).result(timeout=60) is warm
        assert ex.submit(eval, loaded, {"t": np.zeros(LARGE)}).result(timeout=60) is warm
        assert ex.submit(eval, loaded, {"t": torch.zeros(2)}).result(timeout=60) is True
