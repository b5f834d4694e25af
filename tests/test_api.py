"""The public surface: exports, allocators, options and the drop-in constructor."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import workers

import sharexec

pytestmark = pytest.mark.timeout(120)


def test_all_names_exist_and_are_documented():
    for name in sharexec.__all__:
        obj = getattr(sharexec, name)
        assert obj.__doc__, f"{name} has no docstring"


def test_import_starts_nothing_and_creates_nothing():
    code = textwrap.dedent(
        """
        import os, threading
        mine = f"sharexec-{os.getpid()}-"  # other programs on the machine make theirs
        before = set(n for n in os.listdir("/dev/shm") if n.startswith(mine))
        import sharexec
        after = set(n for n in os.listdir("/dev/shm") if n.startswith(mine))
        def parent(pid):
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    return stat.read().rsplit(")", 1)[1].split()[1]
            except OSError:  # gone meanwhile: other programs' processes come and go
                return None
        children = [p for p in os.listdir("/proc") if p.isdigit() and
                    parent(p) == str(os.getpid())]
        sharexec.SharedProcessPoolExecutor  # the executor's module, not the cluster's
        import sys
        print(threading.active_count(), len(after - before), len(children),
              "sharexec._cluster" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "0", "False"], out.stderr


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: sharexec.empty((2, 3)), np.zeros((2, 3))),
        (lambda: sharexec.zeros(5, dtype=np.int16), np.zeros(5, dtype=np.int16)),
        (lambda: sharexec.ones((2, 2), order="F"), np.ones((2, 2), order="F")),
        (lambda: sharexec.full(3, 7), np.full(3, 7)),
        (lambda: sharexec.full((2,), 1.5, dtype=np.float32), np.full(2, 1.5, np.float32)),
        (lambda: sharexec.zeros_like(np.ones((3, 4), np.uint8)), np.zeros((3, 4), np.uint8)),
        (lambda: sharexec.ones_like(np.zeros(3), dtype=int), np.ones(3, dtype=int)),
        (lambda: sharexec.full_like(np.zeros((2, 2)), 4.0), np.full((2, 2), 4.0)),
        (lambda: sharexec.empty_like(np.zeros((4, 2), order="F")), np.zeros((4, 2), order="F")),
        (lambda: sharexec.zeros(0), np.zeros(0)),
        (lambda: sharexec.zeros(()), np.zeros(())),
    ],
)
def test_allocators_match_numpy(make, expected, no_leaks):
    a = make()
    assert isinstance(a, sharexec.SharedArray) and sharexec.is_shared(a)
    assert a.dtype == expected.dtype and a.shape == expected.shape
    assert a.flags.f_contiguous == expected.flags.f_contiguous
    if a.size:
        np.testing.assert_array_equal(a, expected)


def test_allocators_refuse_object_dtype_and_bad_arguments():
    with pytest.raises(TypeError, match="object"):
        sharexec.zeros(3, dtype=object)
    with pytest.raises(ValueError, match="negative"):
        sharexec.zeros(-1)
    with pytest.raises(ValueError, match="order"):
        sharexec.zeros(3, order="X")


def test_share_copies_private_arrays_and_passes_shared_ones_through(no_leaks):
    p = np.arange(12.0).reshape(3, 4)
    s = sharexec.share(p)
    assert sharexec.is_shared(s) and np.array_equal(s, p) and not np.shares_memory(s, p)
    again = sharexec.share(s[1:])
    assert np.shares_memory(again, s)
    assert sharexec.share([1, 2, 3]).tolist() == [1, 2, 3]


def test_computations_on_shared_arrays_give_ordinary_arrays(no_leaks):
    a = sharexec.ones(10)
    assert type(a + 1) is np.ndarray and not sharexec.is_shared(a + 1)
    assert type(a[2:]) is sharexec.SharedArray
    assert type(a.sum()) is np.float64
    np.add(a, 1, out=a)
    assert sharexec.is_shared(a) and a[0] == 2.0
    assert not sharexec.is_shared(np.ones(3)) and not sharexec.is_shared([1, 2])


# ---------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------


def test_unknown_option_is_an_error_naming_it():
    with pytest.raises(sharexec.ConfigError, match="min_share_byte"):
        sharexec.SharedProcessPoolExecutor(1, min_share_byte=10)
    with pytest.raises(ValueError, match="min_share_bytes"):
        sharexec.SharedProcessPoolExecutor(1, min_share_bytes=0)
    with pytest.raises(ValueError, match="min_share_bytes"):
        sharexec.SharedProcessPoolExecutor(1, min_share_bytes="lots")


def test_environment_variable_sets_the_threshold(monkeypatch):
    from sharexec._config import Options

    monkeypatch.setenv("SHAREXEC_MIN_SHARE_BYTES", "4096")
    assert Options.resolve({}).min_share_bytes == 4096
    assert Options.resolve({"min_share_bytes": 10}).min_share_bytes == 10
    monkeypatch.setenv("SHAREXEC_MIN_SHARE_BYTES", "x")
    with pytest.raises(sharexec.ConfigError, match="SHAREXEC_MIN_SHARE_BYTES"):
        Options.resolve({})


def test_tensor_sharing_takes_one_of_its_roads(monkeypatch):
    from sharexec._config import Options

    assert Options.resolve({}).tensor_sharing == "sharexec"
    assert Options.resolve({"tensor_sharing": "torch"}).tensor_sharing == "torch"
    monkeypatch.setenv("SHAREXEC_TENSOR_SHARING", "torch")
    assert Options.resolve({}).tensor_sharing == "torch"
    with pytest.raises(sharexec.ConfigError, match=r"tensor_sharing.*sharexec, torch"):
        Options.resolve({"tensor_sharing": "pickle"})
    monkeypatch.setenv("SHAREXEC_TENSOR_SHARING", "fd")
    with pytest.raises(sharexec.ConfigError, match="SHAREXEC_TENSOR_SHARING"):
        Options.resolve({})


@pytest.mark.transport
def test_threshold_decides_what_is_shared(start_method, no_leaks):
    a = np.ones(1000)  # 8 kB
    with sharexec.SharedProcessPoolExecutor(
        1, mp_context=start_method, min_share_bytes=4096
    ) as ex:
        assert ex.submit(workers.in_segment, a).result()
        assert not ex.submit(workers.in_segment, a[:100]).result()


# ---------------------------------------------------------------------------------------
# The drop-in constructor and methods
# ---------------------------------------------------------------------------------------


def test_constructor_validates_like_the_stdlib():
    with pytest.raises(ValueError):
        sharexec.SharedProcessPoolExecutor(0)
    with pytest.raises(TypeError, match="initializer"):
        sharexec.SharedProcessPoolExecutor(1, initializer=3)
    with pytest.raises(TypeError, match="mp_context"):
        sharexec.SharedProcessPoolExecutor(1, mp_context=3.5)
    with pytest.raises(ValueError):
        sharexec.SharedProcessPoolExecutor(1, mp_context="no-such-method")
    with pytest.raises(ValueError, match="max_tasks_per_child"):
        sharexec.SharedProcessPoolExecutor(1, max_tasks_per_child=0)
    with pytest.raises(TypeError, match="max_tasks_per_child"):
        sharexec.SharedProcessPoolExecutor(1, max_tasks_per_child=1.5)
    with pytest.raises(ValueError, match="fork"):
        sharexec.SharedProcessPoolExecutor(1, mp_context="fork", max_tasks_per_child=2)


def test_is_a_concurrent_futures_executor():
    import concurrent.futures

    assert issubclass(sharexec.SharedProcessPoolExecutor, concurrent.futures.Executor)


def test_submit_after_shutdown_raises_runtime_error(executor):
    executor.shutdown()
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown") as info:
        executor.submit(workers.identity, 1)
    assert type(info.value) is RuntimeError


@pytest.mark.transport
def test_keyword_named_fn_reaches_the_function(executor):
    assert executor.submit(_kw, fn=1, self=2).result() == {"fn": 1, "self": 2}
    with pytest.raises(TypeError):
        executor.submit(fn=_kw)


def _kw(**kwargs):
    return kwargs


@pytest.mark.transport
def test_map_with_chunksize_and_timeout(executor):
    chunks = [np.full(200_000, i, dtype=float) for i in range(10)]
    got = list(executor.map(workers.total, chunks, chunksize=3, timeout=60))
    assert got == [200_000.0 * i for i in range(10)]
    with pytest.raises(ValueError):
        executor.map(workers.total, chunks, chunksize=0)


def test_cancel_futures_on_shutdown(start_method, no_leaks):
    ex = sharexec.SharedProcessPoolExecutor(1, mp_context=start_method)
    futures = [ex.submit(workers.total, np.ones(300_000)) for _ in range(30)]
    ex.shutdown(wait=True, cancel_futures=True)
    assert all(f.done() for f in futures)
    for f in futures:
        if not f.cancelled():
            assert f.result() == 300_000


def test_environment_of_workers_is_untouched(executor):
    assert executor.submit(os.getenv, "SHAREXEC_MIN_SHARE_BYTES").result() is None


def test_max_tasks_per_child_replaces_workers(start_method, no_leaks):
    if start_method == "fork":
        pytest.skip("max_tasks_per_child is refused with fork (tested above)")
    with sharexec.SharedProcessPoolExecutor(
        1, mp_context=start_method, max_tasks_per_child=2
    ) as ex:
        pids = [ex.submit(os.getpid).result() for _ in range(5)]
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
        assert len(ex._processes) == 1


def test_max_tasks_per_child_defaults_to_spawn(no_leaks):
    ex = sharexec.SharedProcessPoolExecutor(1, max_tasks_per_child=3)
    try:
        assert ex._context.get_start_method() == "spawn"
    finally:
        ex.shutdown()


def test_max_tasks_of_one_still_completes_every_future_on_shutdown(start_method, no_leaks):
    if start_method == "fork":
        pytest.skip("max_tasks_per_child is refused with fork")
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method, max_tasks_per_child=1)
    futures = [ex.submit(workers.total, np.full(300_000, i, float)) for i in range(12)]
    ex.shutdown(wait=True)
    assert [f.result() for f in futures] == [300_000.0 * i for i in range(12)]


def test_functions_of_main_are_pickled_once_per_executor():
    code = textwrap.dedent(
        """
        import sharexec

        def square(x):
            return x * x

        def times(k):
            return lambda x: x * k

        if __name__ == "__main__":
            with sharexec.SharedProcessPoolExecutor(2, mp_context="spawn") as ex:
                assert list(ex.map(square, range(50))) == [x * x for x in range(50)]
                cell = [3]
                f = times(cell)
                assert ex.submit(f, 2).result() == [3, 3]
                cell.append(4)  # a closure's captured state may change: never cached
                assert ex.submit(f, 2).result() == [3, 4, 3, 4]
                cached = dict(ex._transport.functions._payloads)
            assert list(cached) == [square] and cached[square], cached
            print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
