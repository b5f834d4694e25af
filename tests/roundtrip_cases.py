"""Odd arrays for test_roundtrip.py, and the functions that run on them in workers.

A module of its own, without hypothesis, so that spawned workers import it quickly. Every
builder makes the same bits in any process, so a worker can make what the parent expects.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any

import numpy as np
import workers

import sharexec

LARGE_BYTES = 1 << 20  # views of it that keep a third of it still exceed the default
SMALL_BYTES = 200

NUMERIC = [
    *(f"i{n}" for n in (1, 2, 4, 8)),
    *(f"u{n}" for n in (1, 2, 4, 8)),
    "f2",
    "f4",
    "f8",
    "g",
    "c8",
    "c16",
    "G",
]
TIMES = ["M8[ns]", "M8[s]", "M8[D]", "m8[ns]", "m8[us]", "m8[Y]"]

PADDED = np.dtype(
    {
        "names": ["a", "b", "c"],
        "formats": ["<i2", ">f8", "u1"],
        "offsets": [2, 12, 22],
        "itemsize": 32,
    }
)
NESTED = np.dtype(
    [("p", [("x", ">i4"), ("y", "<f4", (3,)), ("t", ">M8[ms]")]), ("q", "u1"), ("z", ">c16")]
)
ALIGNED = np.dtype([("a", "u1"), ("b", "<f8"), ("c", ">u2")], align=True)
STRUCTURED = {"padded": PADDED, "nested": NESTED, "aligned": ALIGNED}


def as_dtype(code: str) -> np.dtype:
    return STRUCTURED[code] if code in STRUCTURED else np.dtype(code)


def random_array(dtype: Any, shape: int | tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bit patterns of ``dtype`` (NaNs with payloads, subnormals, NaT, padding):
    the same for the same arguments, in any process."""
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, int) else shape
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind in "SU":
        letters = np.array(list("aé€𝄞 z"), dtype="U1")
        words = ["".join(rng.choice(letters, rng.integers(0, 5))) for _ in range(97)]
        if dtype.kind == "S":
            words = [w.encode("utf-8")[: dtype.itemsize] for w in words]
        return np.resize(np.array(words, dtype=dtype), shape)
    raw = rng.integers(0, 256, math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _elements(nbytes: int, dtype: np.dtype) -> int:
    return max(1, nbytes // dtype.itemsize)


# ---------------------------------------------------------------------------------------
# Plain arrays of every dtype and layout
# ---------------------------------------------------------------------------------------


def dtype_cases(nbytes: int) -> dict[str, np.ndarray]:
    """One contiguous array of about ``nbytes`` of every dtype, in both byte orders."""
    cases = {}
    for i, code in enumerate([*NUMERIC, *TIMES]):
        for order in "<>":
            dtype = np.dtype(code).newbyteorder(order)
            name = dtype.str if code[0] not in "gG" else order + code
            cases[name] = random_array(dtype, _elements(nbytes, dtype), seed=i)
    cases["bool"] = random_array(bool, nbytes, seed=100)
    cases["S7"] = random_array("S7", _elements(nbytes, np.dtype("S7")), seed=101)
    for order in "<>":
        dtype = np.dtype("U3").newbyteorder(order)
        cases[dtype.str] = random_array(dtype, _elements(nbytes, dtype), seed=102)
    for name, dtype in STRUCTURED.items():
        cases[name] = random_array(dtype, _elements(nbytes, dtype), seed=103)
    return cases


def layout_cases(nbytes: int) -> dict[str, np.ndarray]:
    """Arrays of about ``nbytes`` in every layout, of a few dtypes each."""
    cases = {}
    for code in ("<f8", ">f8", ">M8[us]", "padded", "<c8"):
        dtype = as_dtype(code)
        n = max(24, _elements(nbytes, dtype))
        side = max(6, math.isqrt(n))
        flat = random_array(dtype, n, seed=7)
        square = random_array(dtype, (side, side), seed=8)
        cases[f"{code} F-order"] = np.asfortranarray(square)
        cases[f"{code} reversed"] = flat[::-1]
        cases[f"{code} 2-d negative strides"] = square[::-1, ::-2]
        cases[f"{code} every third"] = flat[1::3]
        cases[f"{code} columns"] = square[:, 1 : side // 2 + 1]
        cases[f"{code} transposed view"] = square[1:, ::2].T
        cases[f"{code} 3-d permuted"] = flat[: (n // 12) * 12].reshape(2, 6, -1).transpose(2, 0, 1)
        cases[f"{code} 0-d"] = flat[5:6].reshape(())
        cases[f"{code} 0-d view of a row"] = square[3, 4, ...]
        cases[f"{code} empty"] = flat[7:7]
        cases[f"{code} empty 2-d"] = square[:0, ::-1]
        cases[f"{code} broadcast (stride 0)"] = np.broadcast_to(flat[:3], (n // 3, 3))
        readonly = flat.copy()
        readonly.flags.writeable = False
        cases[f"{code} read-only"] = readonly
        cases[f"{code} read-only view"] = readonly[::-2]
    unaligned = np.frombuffer(b"\0" + random_array("<f8", nbytes // 8).tobytes(), "<f8", offset=1)
    cases["<f8 unaligned"] = unaligned
    cases["<f8 in bytes (read-only)"] = np.frombuffer(random_array("u1", nbytes).tobytes(), "<f8")
    cases["0-d of a big void"] = np.zeros((), dtype=f"V{nbytes}")
    cases["0-d of a big record"] = random_array([("x", ">f8", (max(1, nbytes // 8),))], ())
    cases["empty of a big void"] = np.zeros((0, 3), dtype=f"V{nbytes}")
    return cases


def all_cases() -> dict[str, np.ndarray]:
    """Every dtype and layout, large (above the default threshold) and small."""
    cases = {}
    for size, nbytes in (("large", LARGE_BYTES), ("small", SMALL_BYTES)):
        for name, a in {**dtype_cases(nbytes), **layout_cases(nbytes)}.items():
            cases[f"{size} {name}"] = a
    return cases


def byte_order_cases() -> dict[str, np.ndarray]:
    """Small arrays (pickled) whose dtype numpy's own pickle turns to native byte order."""
    return {
        "reversed >f8": random_array(">f8", 64, seed=26)[::-1],
        "every other >i2": random_array(">i2", 64, seed=27)[::2],
        "transposed >c8 columns": random_array(">c8", (8, 8), seed=28)[:, :3].T,
        ">M8[ns]": random_array(">M8[ns]", 10, seed=29),
        ">m8[s]": random_array(">m8[s]", 10, seed=30),
        "0-d >M8[D]": random_array(">M8[D]", (), seed=31),
        "empty >m8[us]": np.zeros(0, ">m8[us]"),
        ">g": random_array(">g", 10, seed=32),
        ">G": random_array(">G", 10, seed=33),
    }


def read_only(dtype: Any, n: int, seed: int) -> np.ndarray:
    a = random_array(dtype, n, seed)
    a.flags.writeable = False
    return a


# ---------------------------------------------------------------------------------------
# Subclasses and object arrays
# ---------------------------------------------------------------------------------------


def masked_cases() -> dict[str, np.ma.MaskedArray]:
    n = LARGE_BYTES // 8
    data = random_array("<f8", n, seed=13)
    mask = random_array(bool, n, seed=14)
    return {
        "float": np.ma.array(data, mask=mask, fill_value=-1.5),
        "no mask": np.ma.array(random_array("<i8", n, seed=15)),
        "view": np.ma.array(data, mask=mask)[::-3],
        "big-endian": np.ma.array(random_array(">f4", n, seed=16), mask=mask),
        "datetime": np.ma.array(random_array("<M8[s]", n, seed=17), mask=mask),
        "structured": np.ma.array(random_array(PADDED, n // 4, seed=18)),
        "small": np.ma.array([1.0, 2.0, 3.0], mask=[0, 1, 0]),
        "0-d": np.ma.array(2.0, mask=True),
    }


class Tagged(np.ndarray):
    """A subclass with an attribute, pickled with it."""

    tag: Any

    def __new__(cls, a: Any, tag: Any) -> Tagged:
        obj = np.asarray(a).view(cls)
        obj.tag = tag
        return obj

    def __array_finalize__(self, obj: Any) -> None:
        self.tag = getattr(obj, "tag", None)

    def __reduce__(self) -> Any:
        rebuild, args, state = super().__reduce__()
        return rebuild, args, (state, self.tag)

    def __setstate__(self, state: Any) -> None:
        base, self.tag = state
        super().__setstate__(base)


class Bare(np.ndarray):
    """A subclass that knows nothing of pickling: pickle loses its attributes."""


def subclass_cases() -> dict[str, np.ndarray]:
    n = LARGE_BYTES // 8
    bare = random_array("<f8", n, seed=19).view(Bare)
    bare.extra = "lost by pickle"
    return {
        "tagged": Tagged(random_array("<f8", n, seed=20), {"unit": "m"}),
        "tagged view": Tagged(random_array("<i2", 4 * n, seed=21), "t")[::-5],
        "tagged datetime": Tagged(random_array("<M8[ns]", n, seed=22), 1),
        "tagged big-endian structured": Tagged(random_array(NESTED, n // 8, seed=23), None),
        "bare": bare,
        "bare 0-d": np.array(1.5).view(Bare),
        "tagged over a shared array": Tagged(sharexec.full(n, 3.0), "s"),
    }


def object_cases() -> dict[str, np.ndarray]:
    inner = random_array(">M8[us]", LARGE_BYTES // 8, seed=24)
    holder = np.empty(4, dtype=object)
    holder[:] = [inner, inner[::-2], None, np.float16(1.5)]
    return {
        "mixed": np.array([{"a": 1}, None, "x", 2.5, b"y", (1, 2)] * 20_000, dtype=object),
        "arrays inside": holder,
        "2-d view": np.array([[1, "a"], [None, 2.5]] * 1000, dtype=object)[::-3, ::-1],
        "0-d": np.array(None, dtype=object),
        "empty": np.empty((3, 0), dtype=object),
        "object field": np.array([(1, [1, 2]), (2, "x")] * 1000, dtype=[("i", "<i4"), ("o", "O")]),
        "strings": np.array(["x" * 40, "", "é"] * 10_000, dtype=np.dtypes.StringDType()),
    }


# ---------------------------------------------------------------------------------------
# Nesting
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Record:
    """A user object holding arrays of odd dtypes."""

    when: Any
    where: dict[str, Any]


def deep(x: Any, depth: int = 5) -> Any:
    for i in range(depth):
        x = [{"level": i, "inner": (Record(np.datetime64("2020-01-01", "D"), {"x": x}),)}]
    return x


def undeep(x: Any, depth: int = 5) -> Any:
    for _ in range(depth):
        x = x[0]["inner"][0].where["x"]
    return x


# ---------------------------------------------------------------------------------------
# What runs in the workers (the builders above too: their arrays come back as results)
# ---------------------------------------------------------------------------------------


def echo_one(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """``a`` back, with whether it reached the worker through a segment."""
    return a, workers.in_segment(a)


def echo_with_where(arrays: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, bool]]:
    return {name: echo_one(a) for name, a in arrays.items()}


def where_nested(tree: Any) -> tuple[Any, list[bool]]:
    """The tree back, and whether each array at its bottom arrived through a segment."""
    leaf = undeep(tree)
    return tree, [workers.in_segment(a) for a in leaf.where["arrays"]]


def copy_into(out: np.ndarray, values: np.ndarray) -> np.ndarray:
    out[...] = values
    return out  # back by reference


def write_if_allowed(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """What the worker received; then it writes into it if it may."""
    seen = np.array(a, copy=True)
    writeable = bool(a.flags.writeable)
    if writeable:
        a[...] = 0
    return seen, writeable


def describe_any(a: Any) -> tuple[Any, str, bool]:
    return a, type(a).__name__, workers.in_segment(a)


def open_memmap_and_views(path: str, dtype: str, shape: tuple[int, ...]) -> Any:
    mm = np.memmap(path, dtype=dtype, mode="r", shape=shape)
    return mm, mm[::-1, 1::3], np.asarray(mm)[2:]


def inner_in_segment(holder: np.ndarray) -> tuple[bool, bool]:
    return workers.in_segment(holder[0]), workers.in_segment(holder[1])


# Over 4 GiB: marks at the 31- and 32-bit boundaries, and a random patch past 4 GiB.
HUGE = (4 << 30) + (100 << 20)  # 4.1 GiB of uint8
MARKS = [0, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, HUGE - 1]
PATCH = (1 << 32) + 12_345
PATCH_BYTES = 1 << 20


def patch() -> np.ndarray:
    return random_array("u1", PATCH_BYTES, seed=25)


def mark(a: np.ndarray) -> int:
    """Writes the marks and the patch into zeros; returns the sum it then has."""
    for i, position in enumerate(MARKS):
        a[position] = i + 1
    a[PATCH : PATCH + PATCH_BYTES] = patch()
    return sum(range(1, len(MARKS) + 1)) + int(patch().sum(dtype=np.uint64))


def check_huge(a: np.ndarray, tail: np.ndarray) -> dict[str, Any]:
    """In the worker: a few values, a checksum, and a view past 4 GiB to send back."""
    return {
        "size": a.size,
        "marks": [int(a[p]) for p in MARKS],
        "sum": int(a.sum(dtype=np.uint64)),
        "crc": zlib.crc32(a[PATCH : PATCH + PATCH_BYTES]),
        "tail_crc": zlib.crc32(np.ascontiguousarray(tail[-1000:])),
        "in_segment": workers.in_segment(a),
        "shared": sharexec.is_shared(a),
        "back": a[PATCH : PATCH + PATCH_BYTES],
    }
