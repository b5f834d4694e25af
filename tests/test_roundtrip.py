"""Odd inputs, exact round-trips, under the default start method and spawn.

Every kind of array goes to a worker and comes back bit for bit: as argument, as result,
nested in containers. Plain arrays take the shared path when large (docs/how-it-works.md,
"What is shared, and with which semantics"; datetime64 included although numpy pickles
it in band); subclasses keep their type or come back as plain pickling gives them, never
corrupted. A hypothesis property covers dtypes, shapes and views at random. The arrays
and the worker functions are in roundtrip_cases.py.
"""

from __future__ import annotations

import gc
import pickle
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import roundtrip_cases as rc
import workers
from conftest import TRANSPORT_METHODS, method_id
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst

import sharexec
from sharexec._config import DEFAULT_MIN_SHARE_BYTES

pytestmark = [pytest.mark.timeout(120), pytest.mark.transport]

# An x87 long double holds 10 meaningful bytes in 16; the rest is padding nobody reads.
_LONGDOUBLE_BYTES = 10 if np.finfo(np.longdouble).nmant == 63 else np.dtype(np.longdouble).itemsize


# ---------------------------------------------------------------------------------------
# Exact comparison
# ---------------------------------------------------------------------------------------


def assert_exact(got: Any, want: np.ndarray, where: str = "") -> None:
    """``got`` is ``want``: same type, dtype (byte order included), shape and bits.

    Floats are compared by bit pattern, so NaN payloads and negative zeros count;
    structured arrays field by field, so padding bytes (which hold no value) do not.
    """
    assert type(got) is type(want), f"{where}: type {type(got)} != {type(want)}"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype!r} != {want.dtype!r}"
    assert got.dtype.str == want.dtype.str, f"{where}: dtype {got.dtype.str} != {want.dtype.str}"
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    assert_same_values(np.asarray(got), np.asarray(want), where)


def assert_same_values(got: np.ndarray, want: np.ndarray, where: str = "") -> None:
    """The same values, bit for bit, whatever the byte order of either."""
    dtype = want.dtype
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    if dtype.names is not None:
        for name in dtype.names:
            assert_same_values(got[name], want[name], f"{where}[{name!r}]")
    elif dtype.kind == "c":
        assert_same_values(got.real, want.real, f"{where}.real")
        assert_same_values(got.imag, want.imag, f"{where}.imag")
    elif dtype.kind == "f":
        np.testing.assert_array_equal(_float_bits(got), _float_bits(want), err_msg=where)
    elif dtype.kind in "mM":
        ticks = got.view(got.dtype.str[0] + "i8"), want.view(want.dtype.str[0] + "i8")
        np.testing.assert_array_equal(*ticks, err_msg=where)
    elif dtype.kind == "V":
        assert got.tobytes() == want.tobytes(), where
    elif dtype.kind == "O":
        for g, w in zip(got.ravel(), want.ravel(), strict=True):
            if isinstance(w, np.ndarray):
                assert_round_trip(g, w, where=f"{where} (inside an object array)")
            else:
                assert type(g) is type(w) and g == w, f"{where}: {g!r} != {w!r}"
    else:
        np.testing.assert_array_equal(got, want, err_msg=where)


def _float_bits(a: np.ndarray) -> np.ndarray:
    """The bit patterns of a float array, as unsigned integers or rows of bytes."""
    if a.dtype.itemsize in (2, 4, 8):
        return a.view(a.dtype.str.replace("f", "u"))  # byte order kept
    native = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("="))).reshape(-1)
    rows = native.view(np.uint8).reshape(native.size, native.itemsize)
    return rows[:, :_LONGDOUBLE_BYTES]


def expect_shared(a: np.ndarray, min_share_bytes: int = DEFAULT_MIN_SHARE_BYTES) -> bool:
    """Whether sharexec sends ``a`` (and sends it back) through a segment."""
    return type(a) is np.ndarray and not a.dtype.hasobject and a.nbytes >= min_share_bytes


def as_pickled(a: Any, times: int = 1) -> Any:
    """What plain pickling makes of ``a``: the reference for what sharexec pickles."""
    for _ in range(times):
        a = pickle.loads(pickle.dumps(a, protocol=5))
    return a


def assert_round_trip(
    got: Any, a: np.ndarray, min_share_bytes: int = DEFAULT_MIN_SHARE_BYTES, where: str = ""
) -> None:
    """``got`` is what sharexec promises for ``a``: ``a`` exactly when it is shared or a plain
    array (byte order included, which numpy's own pickle loses for non-contiguous views,
    datetime64 and long double); otherwise (subclasses, objects) the same values and
    exactly what pickle makes of it.
    """
    plain = type(a) in (np.ndarray, sharexec.SharedArray) and not a.dtype.hasobject
    if plain or expect_shared(a, min_share_bytes):
        assert_exact(got, a, where)
    else:
        assert_exact(got, as_pickled(a), where)
        assert_same_values(np.asarray(got), np.asarray(a), where)


def _is_broadcast(a: np.ndarray) -> bool:
    return any(stride == 0 and n > 1 for stride, n in zip(a.strides, a.shape, strict=True))


def _check_all(got: dict[str, Any], want: dict[str, Any], check: Any) -> None:
    """Runs ``check(name, got[name])`` for every case; fails once, listing every failure."""
    assert got.keys() == want.keys()
    failures = []
    for name in want:
        try:
            check(name, got[name])
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------
# Every dtype and layout, large (shared) and small (pickled), both ways
# ---------------------------------------------------------------------------------------


def test_every_dtype_and_layout_both_ways(executor):
    cases = rc.all_cases()
    before = {name: a.copy() for name, a in cases.items()}

    def check_echo(name, received):
        array, arrived_in_segment = received
        want = cases[name]
        assert_round_trip(array, want, where=name)
        if _is_broadcast(want):
            # Its memory is a few elements: they travel in band when the pass copied
            # them already (with another case's base), else a full copy fills a segment.
            return
        assert arrived_in_segment == expect_shared(want), f"in a segment: {arrived_in_segment}"
        # large results come back through a segment, as writable, private arrays
        assert workers.in_segment(array) == expect_shared(want), "result in a segment"
        if expect_shared(want):
            assert array.flags.writeable and not sharexec.is_shared(array)

    _check_all(executor.submit(rc.echo_with_where, cases).result(), cases, check_echo)
    for name, a in cases.items():
        assert_exact(a, before[name], f"{name} (the parent's own array)")
    assert not cases["large <f8 read-only"].flags.writeable

    def check_made(name, array):
        """Results the worker makes itself: datetime64 too comes back through a segment."""
        assert_round_trip(array, cases[name], where=name)
        if not _is_broadcast(cases[name]):
            assert workers.in_segment(array) == expect_shared(cases[name]), "in a segment"

    _check_all(executor.submit(rc.all_cases).result(), cases, check_made)


def test_nested_in_containers_and_objects_both_ways(executor):
    big = rc.random_array(">f8", rc.LARGE_BYTES // 8, seed=1)
    arrays = [
        rc.random_array(">M8[ns]", rc.LARGE_BYTES // 8, seed=2),
        rc.random_array(rc.PADDED, rc.LARGE_BYTES // 32, seed=3),
        big[::-3],
        big.reshape(-1, 16).T,  # a second view of the same base, in the same task
        rc.random_array("<m8[s]", 3, seed=4),
        np.zeros((0, 4), ">c16"),
    ]
    # NaT with an explicit unit: a unitless np.datetime64("NaT") is deprecated (numpy 2.5).
    nat = np.datetime64("NaT", "ns")
    tree = rc.deep(rc.Record(nat, {"arrays": arrays, "again": arrays[0]}))
    got_tree, arrived = executor.submit(rc.where_nested, tree).result()
    assert arrived == [True, True, True, True, False, False]
    got = rc.undeep(got_tree)
    assert got.where["again"] is got.where["arrays"][0]  # identity kept, as pickle keeps it
    for g, w in zip(got.where["arrays"], arrays, strict=True):
        assert_round_trip(g, w)
    assert np.isnat(got.when) and got.when.dtype == nat.dtype

    def as_kwargs(*, first, rest):
        return {"first": first, "rest": rest}

    back = executor.submit(as_kwargs, first=arrays[0], rest=(arrays[1], {"k": arrays[2]})).result()
    assert_round_trip(back["first"], arrays[0])
    assert_round_trip(back["rest"][0], arrays[1])
    assert_round_trip(back["rest"][1]["k"], arrays[2])


def test_small_arrays_keep_byte_order(executor):
    cases = rc.byte_order_cases()
    for name, a in cases.items():  # numpy's own pickle does change them: sharexec must not
        assert as_pickled(a).dtype != a.dtype, name
    got = executor.submit(workers.identity, cases).result()
    made = executor.submit(rc.byte_order_cases).result()
    for name, a in cases.items():  # the values are right all the same
        assert_same_values(got[name], a, name)
        assert_same_values(made[name], a, name)
    failures = [
        f"{how} {name}: {a.dtype.str} came back as {back[name].dtype.str}"
        for how, back in (("argument", got), ("result", made))
        for name, a in cases.items()
        if back[name].dtype != a.dtype
    ]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------
# Shared arrays of odd dtypes travel by reference
# ---------------------------------------------------------------------------------------


def test_shared_arrays_of_odd_dtypes_by_reference(executor):
    for code in (">f8", "<M8[ns]", ">m8[s]", "G", ">c8", "?", "padded"):
        dtype = rc.as_dtype(code)
        values = rc.random_array(dtype, (40, 30), seed=9)
        shared = sharexec.zeros((40, 30), dtype, order="F")
        assert shared.dtype == dtype
        back = executor.submit(rc.copy_into, shared[::-2, 3:].T, values[::-2, 3:].T).result()
        assert sharexec.is_shared(back) and back.dtype == dtype, code
        assert_exact(np.asarray(shared[::-2, 3:]), values[::-2, 3:], code)
        untouched = np.concatenate([shared[::2].ravel(), shared[1::2, :3].ravel()])
        assert untouched.tobytes() == bytes(untouched.nbytes), code  # only the view written
        back[0, 0] = values[1, 1]  # the returned view writes into the parent's array
        assert_exact(np.asarray(shared[39:40, 3:4]), values[1:2, 1:2], code)


# ---------------------------------------------------------------------------------------
# Read-only arrays: exact, and the parent's array is never written
# ---------------------------------------------------------------------------------------


def test_read_only_private_arrays(executor):
    for nbytes in (rc.LARGE_BYTES, rc.SMALL_BYTES):
        base = rc.read_only(">f8", nbytes // 8, seed=10)
        from_bytes = np.frombuffer(base.tobytes(), ">f8")  # memory no one may write
        for a in (base, base[::-1], base[1::2], from_bytes):
            want = a.copy()
            seen, _ = executor.submit(rc.write_if_allowed, a).result()
            assert_round_trip(seen, a)
            assert_round_trip(executor.submit(workers.identity, a).result(), a)
            assert_exact(a, want)  # the worker's write never reached the parent
            assert not a.flags.writeable
        made = executor.submit(rc.read_only, ">f8", nbytes // 8, 11).result()
        assert_round_trip(made, rc.read_only(">f8", nbytes // 8, 11))


def test_read_only_view_of_shared_array_is_not_written_by_the_worker(executor):
    shared = sharexec.full(1000, 5.0)
    view = shared[10:20]
    view.flags.writeable = False
    seen, writeable = executor.submit(rc.write_if_allowed, view).result()
    after = view.tolist()
    del shared, view  # not kept alive by the failure's traceback: no leak reported
    assert seen.tolist() == [5.0] * 10
    assert after == [5.0] * 10, f"the worker wrote into it (it got writeable={writeable})"


# ---------------------------------------------------------------------------------------
# np.memmap, masked arrays, other subclasses: type kept, or pickled; never corrupted
# ---------------------------------------------------------------------------------------


def test_memmap(executor, tmp_path):
    for dtype in ("<f8", ">i4"):
        shape = (1000, rc.LARGE_BYTES // 8000)
        path = str(tmp_path / f"data{dtype[1:]}.bin")
        values = rc.random_array(dtype, shape, seed=12)
        values.tofile(path)
        for mode in ("r+", "r", "c"):
            mm = np.memmap(path, dtype=dtype, mode=mode, shape=shape)
            for a in (mm, mm[::-1, 1::3], mm[5], np.asarray(mm)[2:], np.asarray(mm).T):
                where = f"{dtype} {mode} {type(a).__name__} {a.shape}"
                got, kind, in_segment = executor.submit(rc.describe_any, a).result()
                if type(a) is np.ndarray:  # the file's memory as a plain array: shared path
                    assert kind == "ndarray" and in_segment, where
                    assert_exact(got, a, where)
                else:  # pickled, as pickle does it (a memmap without its file)
                    want = as_pickled(a, times=2)
                    assert kind == "memmap" and type(got) is type(want) is np.memmap, where
                    assert got.dtype == want.dtype, where
                    assert_same_values(np.asarray(got), np.asarray(a), where)
                seen, _ = executor.submit(rc.write_if_allowed, a).result()
                assert_same_values(seen, np.asarray(a), where)
            del mm, a
            np.testing.assert_array_equal(np.fromfile(path, dtype).reshape(shape), values)
        got = executor.submit(rc.open_memmap_and_views, path, dtype, shape).result()
        mm = np.memmap(path, dtype=dtype, mode="r", shape=shape)
        for g, w in zip(got, (mm, mm[::-1, 1::3], np.asarray(mm)[2:]), strict=True):
            assert type(g) is type(as_pickled(w)) and g.dtype == as_pickled(w).dtype
            assert_same_values(np.asarray(g), np.asarray(w), f"{dtype} result")


def _assert_masked_equal(got: Any, want: np.ma.MaskedArray, name: str, pickled: int) -> None:
    """``got`` is ``want`` pickled ``pickled`` times. (numpy's pickle of a masked array
    drops byte order and, the second time, changes the default fill value's dtype.)"""
    reference = as_pickled(want, pickled)
    assert type(got) is type(reference) is np.ma.MaskedArray, name
    assert got.dtype == reference.dtype, name
    assert_same_values(got.data, want.data, name)
    np.testing.assert_array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(want), name)
    assert_same_values(np.asarray(got.fill_value), np.asarray(reference.fill_value), name)


def test_masked_arrays_both_ways(executor):
    cases = rc.masked_cases()
    got = executor.submit(workers.identity, cases).result()
    made = executor.submit(rc.masked_cases).result()
    for name, want in cases.items():
        _assert_masked_equal(got[name], want, f"argument {name}", pickled=2)
        _assert_masked_equal(made[name], want, f"result {name}", pickled=1)


def test_other_subclasses_keep_type_or_pickle(executor):
    cases = rc.subclass_cases()
    got = executor.submit(workers.identity, cases).result()
    for name, want in cases.items():
        reference = as_pickled(want, 2)
        assert type(got[name]) is type(reference), name
        assert got[name].dtype == reference.dtype, name
        assert vars(got[name]) == vars(reference), name
        assert_same_values(np.asarray(got[name]), np.asarray(want), name)
    assert type(got["tagged"]) is rc.Tagged and got["tagged"].tag == {"unit": "m"}
    assert type(got["bare"]) is rc.Bare


# ---------------------------------------------------------------------------------------
# Object arrays: pickled, but the large arrays inside them are still shared
# ---------------------------------------------------------------------------------------


def test_object_arrays_both_ways(executor):
    cases = rc.object_cases()
    got = executor.submit(workers.identity, cases).result()
    made = executor.submit(rc.object_cases).result()
    for name, want in cases.items():
        for where, g in ((f"argument {name}", got[name]), (f"result {name}", made[name])):
            assert type(g) is np.ndarray and g.dtype == want.dtype, where
            if name == "strings":  # StringDType: values, not the arena pointers
                np.testing.assert_array_equal(g, want, strict=True)
            elif name == "object field":
                assert g.tolist() == want.tolist(), where
            else:
                assert_same_values(g, want, where)
    # the large arrays an object array holds are shared all the same (at any depth)
    assert executor.submit(rc.inner_in_segment, cases["arrays inside"]).result() == (True, True)
    assert workers.in_segment(made["arrays inside"][0])


# ---------------------------------------------------------------------------------------
# The property, at random: one executor per start method and threshold for all examples
# ---------------------------------------------------------------------------------------

ROOMY = 1024  # a min_share_bytes that sends small generated arrays through segments

SCALAR_DTYPES = st.one_of(
    npst.boolean_dtypes(),
    npst.integer_dtypes(endianness="?"),
    npst.unsigned_integer_dtypes(endianness="?"),
    npst.floating_dtypes(endianness="?", sizes=(16, 32, 64, 128)),  # 128: long double
    npst.complex_number_dtypes(endianness="?", sizes=(64, 128, 256)),
    npst.datetime64_dtypes(endianness="?"),
    npst.timedelta64_dtypes(endianness="?"),
    npst.byte_string_dtypes(max_len=5),
    npst.unicode_string_dtypes(endianness="?", max_len=3),
)


@st.composite
def padded_dtypes(draw: Any) -> np.dtype:
    """Records with gaps before, between and after their fields."""
    formats = draw(st.lists(SCALAR_DTYPES, min_size=1, max_size=3))
    offsets, end = [], 0
    for f in formats:
        end += draw(st.integers(0, 5))
        offsets.append(end)
        end += f.itemsize
    names = [f"f{i}" for i in range(len(formats))]
    itemsize = end + draw(st.integers(0, 5))
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize})


DTYPES = st.one_of(
    SCALAR_DTYPES,
    npst.array_dtypes(SCALAR_DTYPES, max_size=3, allow_subarrays=True),
    npst.nested_dtypes(SCALAR_DTYPES, max_leaves=4),
    padded_dtypes(),
)


@st.composite
def array_views(draw: Any) -> np.ndarray:
    """An array of any dtype and shape (0-d and empty too), seen through a random view:
    F-order, slices with negative steps, new axes, transposition, read-only."""
    dtype = draw(DTYPES)
    shape = draw(npst.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9))
    a = draw(npst.arrays(dtype, shape))
    if draw(st.booleans()):
        a = np.asfortranarray(a)
    a = a[draw(npst.basic_indices(a.shape, allow_newaxis=True))]
    if not isinstance(a, np.ndarray):  # every axis indexed by an integer: a scalar
        a = np.asarray(a)
    if a.ndim > 1 and draw(st.booleans()):
        a = a.transpose(draw(st.permutations(range(a.ndim))))
    if draw(st.booleans()):
        a.flags.writeable = False
    return a


@pytest.fixture(
    scope="class",
    params=[(m, t) for t in (ROOMY, None) for m in TRANSPORT_METHODS],
    ids=lambda p: f"{method_id(p[0])}-{p[1] or 'default'}",
)
def reused_executor(request: pytest.FixtureRequest) -> Iterator[tuple[Any, int]]:
    """One executor for every example (class-scoped: gone before the next test class or
    module-level test runs, whose own leak checks count processes); no leaks after it."""
    from conftest import segments_now, workers_left

    start_method, min_share_bytes = request.param
    options = {} if min_share_bytes is None else {"min_share_bytes": min_share_bytes}
    before = segments_now()
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method, **options)
    try:
        yield ex, min_share_bytes or DEFAULT_MIN_SHARE_BYTES
    finally:
        ex.shutdown(wait=True)
        assert ex._flags.broken is None, "the pool was broken"
        gc.collect()
        left = segments_now() - before
        assert not left, f"segments left behind: {sorted(left)}"
        assert not workers_left(), f"processes left behind: {workers_left()}"


class TestRoundTripProperty:
    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(a=array_views())
    def test_any_array_comes_back_exact(self, reused_executor, a):
        ex, min_share_bytes = reused_executor
        before, writeable = a.copy(), a.flags.writeable
        got, arrived_in_segment = ex.submit(rc.echo_one, a).result()
        assert_round_trip(got, a, min_share_bytes)
        shared = expect_shared(a, min_share_bytes)
        assert arrived_in_segment == shared, "arrived through a segment"
        assert workers.in_segment(got) == shared, "came back through a segment"
        assert_exact(a, before)  # the parent's array is untouched
        assert a.flags.writeable == writeable


def test_many_buffers_in_one_call(start_method, no_leaks):
    """One call with 20,000 small arrays, each shared (min_share_bytes of 2 KiB), and
    views of them inside the bytes already copied: every one comes back exact. The pass
    stays linear in its buffers (it was quadratic: bench/many_buffers.py)."""
    rng = np.random.default_rng(17)
    arrays = list(rng.random((20_000, 512)))  # rows of 4 KiB
    views = [a[10:500] for a in arrays[::1000]]  # inside copied bytes: sent from them
    with sharexec.SharedProcessPoolExecutor(
        2, mp_context=start_method, min_share_bytes=2048
    ) as ex:
        sums = ex.submit(workers.sums, arrays + views).result()
        stats = ex.statistics()
    np.testing.assert_array_equal(sums, [a.sum() for a in arrays + views])
    assert stats.bytes_copied == 20_000 * 4096
    assert stats.bytes_reused == len(views) * 490 * 8


# ---------------------------------------------------------------------------------------
# Over 4 GiB
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_array_over_4_gib(executor):
    """A 4.1 GiB shared array by reference, then a private one copied once: values at the
    31/32-bit boundaries, a checksum, and views that start past 4 GiB, both ways."""
    marks = list(range(1, len(rc.MARKS) + 1))
    patch_crc = zlib.crc32(rc.patch())

    shared = sharexec.zeros(rc.HUGE, np.uint8)
    total = rc.mark(shared)
    got = executor.submit(rc.check_huge, shared, shared[1 << 32 :]).result()
    assert got["size"] == rc.HUGE and got["shared"] and got["in_segment"]
    assert got["marks"] == marks and got["sum"] == total and got["crc"] == patch_crc
    assert got["tail_crc"] == zlib.crc32(np.ascontiguousarray(shared[-1000:]))
    assert sharexec.is_shared(got["back"])  # a view past 4 GiB, back by reference
    got["back"][0] = 99
    assert shared[rc.PATCH] == 99
    del shared, got
    gc.collect()

    private = np.zeros(rc.HUGE, np.uint8)
    total = rc.mark(private)
    got = executor.submit(rc.check_huge, private, private[1 << 32 :]).result()
    assert got["size"] == rc.HUGE and got["in_segment"] and not got["shared"]
    assert got["marks"] == marks and got["sum"] == total and got["crc"] == patch_crc
    assert got["tail_crc"] == zlib.crc32(np.ascontiguousarray(private[-1000:]))
    assert_exact(got["back"], rc.patch())


# ---------------------------------------------------------------------------------------
# Never another array's bytes
# ---------------------------------------------------------------------------------------

MARK = 0xA5  # the bytes of an array freed before


@pytest.mark.parametrize(
    "allocate",
    [
        lambda n: sharexec.empty(n, np.uint8),
        lambda n: sharexec.full(n, 1, np.uint8),
        lambda n: sharexec.share(np.ones(n, np.uint8)),
    ],
    ids=["empty", "full", "share"],
)
def test_a_warm_shared_array_never_shows_a_freed_arrays_bytes(executor, allocate):
    """A shared array served from a freed one's segment, larger than it needs: no byte
    of the segment reachable through it (``.base``), here or in a worker given it by
    reference, is the freed array's."""
    old = sharexec.full(1_000_000, MARK, np.uint8)
    name = workers._mapping_of(old).name
    del old
    gc.collect()
    new = allocate(700_000)
    assert workers._mapping_of(new).name == name  # served from the freed one's segment
    assert len(workers.in_reach(new)) == 1_000_000
    assert np.count_nonzero(workers.in_reach(new) == MARK) == 0
    assert executor.submit(workers.marks_in_reach, new, MARK).result() == (0, name)


def test_a_warm_copy_or_result_never_shows_an_earlier_ones_bytes(executor):
    """The executor's warm segments, lent for a result or served again for an argument's
    copy smaller than they are: no byte the parent or a worker can reach through the new
    array is the earlier one's."""
    result = executor.submit(workers.marked, 1_000_000, MARK).result()
    lent = workers._mapping_of(result).name
    del result
    gc.collect()
    assert executor._transport.pooled() == [lent]
    result = executor.submit(workers.marked, 700_000, 1).result()
    assert workers._mapping_of(result).name == lent  # written into the lent segment
    assert np.count_nonzero(workers.in_reach(result) == MARK) == 0
    del result
    first = workers.marked(1_000_000, MARK)
    marks, copy = executor.submit(workers.marks_in_reach, first, MARK).result()
    assert marks == 1_000_000
    del first
    gc.collect()
    assert copy in executor._transport.pooled()
    got = executor.submit(workers.marks_in_reach, np.ones(700_000, np.uint8), MARK).result()
    assert got == (0, copy)  # served from the pool, nothing of the earlier copy
