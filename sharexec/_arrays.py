"""Arrays whose memory lives in shared segments, and the geometry of array views.

Defines the public allocators (:func:`empty`, :func:`zeros`, …, :func:`share`,
:func:`is_shared`), the :class:`SharedArray` type they return, and the two functions that
rebuild an array view from a buffer and its geometry (offset, shape, strides, dtype),
used on both sides of every transfer.

Allocations are served warm when they can be: the segment of a collected shared array
that no other process may still see goes to the process's pool of warm segments
(:data:`recycling`), and the next allocation of a size it fits is that segment, zeroed (or
filled) at memory speed instead of paying fresh page faults. Never another array's bytes:
:func:`zeros` and :func:`empty` zero it, :func:`full` and :func:`share` overwrite every
element, and the rest of the segment past the array (up to as much again) is zeroed:
the array's ``.base`` reaches it, and so does a worker's mapping of the segment.

Why a subclass: shared arrays must also travel by reference through
:mod:`multiprocessing`'s own pickler (``Process`` arguments, ``Queue``, ``Pool``), whose
reducers are looked up by exact type, and through loky's. Registering a reducer for
:class:`SharedArray` with each (done on first allocation, never at import) changes nothing
for any other array.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal, Protocol, SupportsIndex, TypeVar, overload

import numpy as np
import numpy.typing as npt
from loky.backend import reduction as loky_reduction

from . import _segments, _session, _tracking
from ._config import DEFAULT_MIN_SHARE_BYTES, Options
from ._segments import Mapping
from ._warm import SegmentPool, pool_limit

__all__ = [
    "SharedArray",
    "byte_bounds",
    "empty",
    "empty_like",
    "full",
    "full_like",
    "is_shared",
    "ones",
    "ones_like",
    "rebuild_shared",
    "rebuild_view",
    "recycling",
    "share",
    "zeros",
    "zeros_like",
]

ShapeLike = SupportsIndex | Sequence[SupportsIndex]


# ---------------------------------------------------------------------------------------
# Geometry of a view
# ---------------------------------------------------------------------------------------


def byte_bounds(a: np.ndarray) -> tuple[int, int]:
    """The lowest address ``a`` touches and one past the highest (equal if ``a`` is empty)."""
    low = high = a.__array_interface__["data"][0]
    if a.size == 0:
        return low, low
    for n, stride in zip(a.shape, a.strides, strict=False):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + a.itemsize


def rebuild_view(
    buffer: memoryview | bytes | bytearray | np.ndarray,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    dtype: np.dtype,
) -> np.ndarray:
    """An array over ``buffer`` (zero-copy), its first element at byte ``offset``."""
    view: np.ndarray = np.ndarray(shape, dtype, buffer=buffer, offset=offset, strides=strides)
    return view


# ---------------------------------------------------------------------------------------
# The shared array type
# ---------------------------------------------------------------------------------------


class SharedArray(np.ndarray):
    """A :class:`numpy.ndarray` whose memory lives in a shared-memory segment.

    Every view of it (slice, transpose, reshape) shares the same memory: passed to a
    sharexec executor or through :mod:`multiprocessing`, it travels by reference, and
    writes made by any process are seen by all. New arrays computed from it (``a + 1``)
    are ordinary arrays. Pickled to a file or with :mod:`pickle`, it stores its data and
    loads as a plain :class:`numpy.ndarray`.
    """

    def __array_wrap__(
        self, obj: np.ndarray, context: object = None, return_scalar: bool = False
    ) -> Any:  # numpy's: an array, or a scalar (return_scalar)
        if return_scalar:
            return obj[()]
        if is_shared(obj):
            return obj if isinstance(obj, SharedArray) else obj.view(SharedArray)
        return obj.view(np.ndarray)

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[object, ...]:
        # Plain pickle: the data, as an ordinary array. (sharexec's own pickler and
        # multiprocessing's reach this only for arrays not in a segment any more.)
        return self.view(np.ndarray).__reduce_ex__(protocol)

    def __reduce__(self) -> str | tuple[object, ...]:
        return self.view(np.ndarray).__reduce__()


def is_shared(a: object) -> bool:
    """Whether ``a`` is an array whose memory lies in a sharexec shared segment, or a
    PyTorch tensor in shared memory (a sharexec segment, or torch's own).

    Parameters
    ----------
    a : object
        Whatever object: only :class:`numpy.ndarray` instances and tensors can be shared.

    Returns
    -------
    bool
        True if passing ``a`` to a task or process passes a reference, not a copy.
    """
    if isinstance(a, np.ndarray):
        return _tracking.find_shared(*byte_bounds(a)) is not None
    if _is_tensor(a):
        from . import _tensors

        return _tensors.is_shared(a)
    return False


def _is_tensor(a: object) -> bool:
    """Whether ``a`` is a PyTorch tensor (without importing torch: if it is not loaded,
    nothing is a tensor)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(a, torch.Tensor)


def rebuild_shared(
    name: str,
    size: int,
    offset: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype,
    adopt: bool,
    writeable: bool = True,
) -> SharedArray:
    """Rebuild a view of a shared array from its segment's name and its geometry.

    Inside a worker's call (``_tracking.attached_shared`` with holders), the view is
    built over the call's own holder of the segment, by which the worker tells the
    parent once no view of the call is left (see :class:`Recycling`).
    """
    mapping = _tracking.attach_shared(name, size, adopt)
    holders = _tracking.call_holders()
    buffer: Mapping | np.ndarray = mapping
    if holders is not None:
        holder = holders.get(name)
        if holder is None:
            holder = holders[name] = np.frombuffer(mapping, np.uint8)
        buffer = holder
    view: SharedArray = SharedArray(shape, dtype, buffer=buffer, offset=offset, strides=strides)
    view.flags.writeable = writeable  # a read-only view stays read-only everywhere
    return view


def reduce_shared(
    a: np.ndarray, mapping: Mapping, adopt: bool = False
) -> tuple[Callable[..., SharedArray], tuple[object, ...]]:
    """The by-reference reduction of ``a``, a view into ``mapping``."""
    first = a.__array_interface__["data"][0] - mapping.address
    return rebuild_shared, (
        mapping.name,
        len(mapping),
        first,
        a.shape,
        a.strides,
        a.dtype,
        adopt,
        bool(a.flags.writeable),
    )


def _reduce_for_multiprocessing(
    a: SharedArray,
) -> str | tuple[Callable[..., object], tuple[object, ...]]:
    found = _tracking.find_shared(*byte_bounds(a))
    if found is None:
        return a.view(np.ndarray).__reduce__()
    recycling.escaped(found[0])  # a process may keep it that never tells us
    return reduce_shared(a, found[0])


_registered_with_multiprocessing = False


def _new(
    shape: ShapeLike, dtype: npt.DTypeLike, order: Literal["C", "F"], filled: bool = False
) -> SharedArray:
    """A new shared array; zeroed unless ``filled`` (the caller writes every element)."""
    global _registered_with_multiprocessing
    if not _registered_with_multiprocessing:
        # Both are public registration hooks for exact types: multiprocessing's pickler
        # (Process arguments, Queue, Pool) and loky's (its Process and queues).
        ForkingPickler.register(SharedArray, _reduce_for_multiprocessing)
        loky_reduction.register(SharedArray, _reduce_for_multiprocessing)
        _registered_with_multiprocessing = True
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"arrays of dtype {dtype} hold Python objects and cannot be shared")
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    shape = (
        (operator.index(shape),)
        if not isinstance(shape, Sequence)
        else tuple(operator.index(n) for n in shape)
    )
    if any(n < 0 for n in shape):
        raise ValueError("negative dimensions are not allowed")
    nbytes = math.prod(shape) * dtype.itemsize
    holder = recycling.take(nbytes, filled)
    if holder is None:
        spill_to = Options.resolve({}).spill_folder()
        mapping = _tracking.new_shared(nbytes, spill_to)
        if os.path.isabs(mapping.name):
            _tracking.warn_fallback(
                _tracking.spilled(mapping.name, "shared arrays are allocated in")
            )
        holder = recycling.hold(mapping)
    array: SharedArray = SharedArray(shape, dtype, buffer=holder, order=order)
    return array


# ---------------------------------------------------------------------------------------
# Warm allocations
# ---------------------------------------------------------------------------------------


class _State:
    """What decides whether a shared segment allocated here may serve again."""

    __slots__ = ("clean", "collected", "mapping", "tasks")

    def __init__(self) -> None:
        self.tasks = 0  # tasks in flight that refer to it
        self.clean = True  # no other process may hold a view of it
        self.collected = False  # no view of it is left in this process
        self.mapping: Mapping | None = None  # once collected, until the last task is done


class Recycling:
    """The segments of this process's shared arrays, served again once free.

    Every array :func:`_new` makes is built over a *holder* of its segment (an array of
    its bytes): when the holder is collected, no view of it is left here. The segment
    then goes to this process's pool of warm segments (a :class:`~sharexec._warm.
    SegmentPool`, with the executors' bounds), unless another process may still see
    it: the tasks it was passed to (by reference) must all be done, and each one's
    worker must have said that no view of that call is left there (``_worker.run``'s
    ``released``); it must never have gone through any other door (multiprocessing's or
    loky's pickler, a fork while it lived). Otherwise it is dropped as before (unlinked
    once no mapping is left here). Only outside workers (see :meth:`hold`): a worker's
    shared arrays are freed as before.

    Taken again by :meth:`take` for a size it fits (at most twice as big), it is zeroed
    (or, but for what lies past the new array, left for the caller to fill), so an array
    never shows another array's bytes.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: the finalizers run at any allocation
        self._pool: SegmentPool | None = None  # made at the first allocation
        # The state of each segment allocated here that may serve again, by the
        # mapping's id (the mapping is alive as long as the entry), e.g. {1401: _State}.
        self._states: dict[int, _State] = {}

    def take(self, nbytes: int, filled: bool) -> np.ndarray | None:
        """A holder of a warm segment for ``nbytes``, zeroed unless ``filled``; or None.

        Zeroed past ``nbytes`` either way: the segment may be up to twice as big, and the
        array's ``.base`` (the holder), like a worker's mapping, reaches all of it.
        """
        pool = self._pool
        mapping = pool.take(nbytes) if pool is not None and nbytes else None
        if mapping is None:
            return None
        _segments.zero_from(mapping, nbytes if filled else 0)
        return self.hold(mapping)

    def hold(self, mapping: Mapping) -> np.ndarray:
        """The holder of a segment just allocated, whose collection frees it.

        Not in a worker: its arrays go back to the parent or die with their task, its
        warm memory is its kept mappings, and it may exit (``os._exit``) with a pool
        nobody would unlink but the sweeper. Not below ``DEFAULT_MIN_SHARE_BYTES``.
        """
        holder = np.frombuffer(mapping, np.uint8)
        if _session.in_worker() or len(mapping) < DEFAULT_MIN_SHARE_BYTES:
            # Small ones too are freed at once: their fresh pages cost microseconds, and
            # the pool's places (WARM_SEGMENTS) are for the large ones.
            return holder
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = SegmentPool(pool_limit())
        with self._lock:
            self._states[id(mapping)] = _State()
        weakref.finalize(holder, self._collected, mapping)
        return holder

    def sent(self, mappings: Sequence[Mapping]) -> None:
        """A task in flight refers to ``mappings`` now (the shared ones by reference),
        until :meth:`done` for the same list."""
        with self._lock:
            for mapping in mappings:
                state = self._states.get(id(mapping))
                if state is not None:
                    state.tasks += 1

    def done(self, mappings: Sequence[Mapping], released: frozenset[str]) -> None:
        """A task referring to ``mappings`` is done; ``released``: the segments of which
        its worker holds no view of that call."""
        free = []
        with self._lock:
            for mapping in mappings:
                state = self._states.get(id(mapping))
                if state is None or state.tasks == 0:
                    continue
                state.tasks -= 1
                state.clean = state.clean and mapping.name in released
                if state.tasks == 0 and state.collected:
                    free.append(self._finish(mapping))
        self._put(free)

    def escaped(self, mapping: Mapping) -> None:
        """``mapping`` went where no release is reported: it never serves again."""
        with self._lock:
            state = self._states.get(id(mapping))
            if state is not None:
                state.clean = False

    def before_fork(self) -> None:
        # A forked child inherits every mapping, and never tells.
        with self._lock:
            for state in self._states.values():
                state.clean = False

    def after_fork_in_child(self) -> None:
        # The child serves nothing of its parent's: its own arrays start afresh.
        self._lock = threading.RLock()
        self._states = {}
        self._pool = None

    def clear(self) -> None:
        """Drop every pooled segment now (each is unlinked once no mapping is left)."""
        pool = self._pool
        if pool is not None:
            pool.clear()

    def names(self) -> list[str]:
        """The names of the pooled segments."""
        pool = self._pool
        return pool.names() if pool is not None else []

    def totals(self) -> tuple[int, int]:
        """Segments in the pool now, and their total size."""
        pool = self._pool
        return pool.totals() if pool is not None else (0, 0)

    def _collected(self, mapping: Mapping) -> None:
        free = []
        with self._lock:
            state = self._states.get(id(mapping))
            if state is None:
                return
            state.collected = True
            state.mapping = mapping  # kept until the tasks in flight are done
            if state.tasks == 0:
                free.append(self._finish(mapping))
        self._put(free)

    def _finish(self, mapping: Mapping) -> Mapping | None:
        """``mapping`` is free here and in flight nowhere: poolable or not (lock held)."""
        state = self._states.pop(id(mapping))
        state.mapping = None
        if state.clean and not os.path.isabs(mapping.name):  # never a file on disk
            return mapping
        return None

    def _put(self, free: list[Mapping | None]) -> None:
        pool = self._pool
        for mapping in free:
            if mapping is not None and pool is not None:
                pool.put(mapping)  # outside our lock: the pool's is of the same level


# The process's one: every shared array allocated here is built over its holders.
recycling = Recycling()
os.register_at_fork(before=recycling.before_fork, after_in_child=recycling.after_fork_in_child)


# ---------------------------------------------------------------------------------------
# Allocators
# ---------------------------------------------------------------------------------------


def empty(
    shape: ShapeLike, dtype: npt.DTypeLike = float, order: Literal["C", "F"] = "C"
) -> SharedArray:
    """A new shared array, as :func:`numpy.empty`.

    Parameters
    ----------
    shape : int or sequence of int
        Shape of the new array.
    dtype : data-type, default float
        A numpy dtype that holds no Python objects.
    order : {'C', 'F'}, default 'C'
        Row-major or column-major layout.

    Returns
    -------
    SharedArray
        The array, which reads as zeros (never another array's bytes: a fresh segment
        is zeroed by the system, a warm one served again by sharexec), so :func:`zeros`
        costs no more.
    """
    return _new(shape, dtype, order)


def zeros(
    shape: ShapeLike, dtype: npt.DTypeLike = float, order: Literal["C", "F"] = "C"
) -> SharedArray:
    """A new shared array of zeros, as :func:`numpy.zeros`.

    Parameters
    ----------
    shape : int or sequence of int
        Shape of the new array.
    dtype : data-type, default float
        A numpy dtype that holds no Python objects.
    order : {'C', 'F'}, default 'C'
        Row-major or column-major layout.

    Returns
    -------
    SharedArray
        The array; a fresh segment is zero-filled by the operating system, a warm one
        (the segment of a collected shared array, served again) by sharexec.
    """
    return _new(shape, dtype, order)


def ones(
    shape: ShapeLike, dtype: npt.DTypeLike | None = None, order: Literal["C", "F"] = "C"
) -> SharedArray:
    """A new shared array of ones, as :func:`numpy.ones`.

    Parameters
    ----------
    shape : int or sequence of int
        Shape of the new array.
    dtype : data-type, optional
        Defaults to float64.
    order : {'C', 'F'}, default 'C'
        Row-major or column-major layout.

    Returns
    -------
    SharedArray
        The array.
    """
    return full(shape, 1, float if dtype is None else dtype, order)


def full(
    shape: ShapeLike,
    fill_value: Any,  # numpy's
    dtype: npt.DTypeLike | None = None,
    order: Literal["C", "F"] = "C",
) -> SharedArray:
    """A new shared array filled with ``fill_value``, as :func:`numpy.full`.

    Parameters
    ----------
    shape : int or sequence of int
        Shape of the new array.
    fill_value : scalar or array_like
        The value to fill with.
    dtype : data-type, optional
        Defaults to the dtype of ``np.array(fill_value)``.
    order : {'C', 'F'}, default 'C'
        Row-major or column-major layout.

    Returns
    -------
    SharedArray
        The array.
    """
    if dtype is None:
        dtype = np.array(fill_value).dtype
    a = _new(shape, dtype, order, filled=True)
    np.copyto(a, fill_value, casting="unsafe")
    return a


def _like_args(
    prototype: npt.ArrayLike,
    dtype: npt.DTypeLike | None,
    order: Literal["C", "F", "A", "K"],
    shape: ShapeLike | None,
) -> tuple[ShapeLike, np.dtype, Literal["C", "F"]]:
    proto = np.asarray(prototype)
    new_shape: ShapeLike = proto.shape if shape is None else shape
    if order == "K" or order == "A":
        order = "F" if proto.flags.f_contiguous and not proto.flags.c_contiguous else "C"
    return new_shape, np.dtype(proto.dtype if dtype is None else dtype), order


def empty_like(
    prototype: npt.ArrayLike,
    dtype: npt.DTypeLike | None = None,
    order: Literal["C", "F", "A", "K"] = "K",
    shape: ShapeLike | None = None,
) -> SharedArray:
    """A new shared array with the shape and dtype of ``prototype``, as :func:`numpy.empty_like`.

    Parameters
    ----------
    prototype : array_like
        Gives the shape, dtype and, with ``order='K'``, the memory layout.
    dtype : data-type, optional
        Overrides the dtype.
    order : {'C', 'F', 'A', 'K'}, default 'K'
        Memory layout; 'K' and 'A' follow the prototype (C unless it is F-contiguous).
    shape : int or sequence of int, optional
        Overrides the shape.

    Returns
    -------
    SharedArray
        The array (its contents read as zeros).
    """
    return _new(*_like_args(prototype, dtype, order, shape))


def zeros_like(
    prototype: npt.ArrayLike,
    dtype: npt.DTypeLike | None = None,
    order: Literal["C", "F", "A", "K"] = "K",
    shape: ShapeLike | None = None,
) -> SharedArray:
    """A new shared array of zeros shaped like ``prototype``, as :func:`numpy.zeros_like`.

    Parameters
    ----------
    prototype : array_like
        Gives the shape, dtype and, with ``order='K'``, the memory layout.
    dtype : data-type, optional
        Overrides the dtype.
    order : {'C', 'F', 'A', 'K'}, default 'K'
        Memory layout; 'K' and 'A' follow the prototype.
    shape : int or sequence of int, optional
        Overrides the shape.

    Returns
    -------
    SharedArray
        The array.
    """
    return _new(*_like_args(prototype, dtype, order, shape))


def ones_like(
    prototype: npt.ArrayLike,
    dtype: npt.DTypeLike | None = None,
    order: Literal["C", "F", "A", "K"] = "K",
    shape: ShapeLike | None = None,
) -> SharedArray:
    """A new shared array of ones shaped like ``prototype``, as :func:`numpy.ones_like`.

    Parameters
    ----------
    prototype : array_like
        Gives the shape, dtype and, with ``order='K'``, the memory layout.
    dtype : data-type, optional
        Overrides the dtype.
    order : {'C', 'F', 'A', 'K'}, default 'K'
        Memory layout; 'K' and 'A' follow the prototype.
    shape : int or sequence of int, optional
        Overrides the shape.

    Returns
    -------
    SharedArray
        The array.
    """
    return full_like(prototype, 1, dtype, order, shape)


def full_like(
    prototype: npt.ArrayLike,
    fill_value: Any,  # numpy's
    dtype: npt.DTypeLike | None = None,
    order: Literal["C", "F", "A", "K"] = "K",
    shape: ShapeLike | None = None,
) -> SharedArray:
    """A new shared array filled with ``fill_value``, as :func:`numpy.full_like`.

    Parameters
    ----------
    prototype : array_like
        Gives the shape, dtype and, with ``order='K'``, the memory layout.
    fill_value : scalar or array_like
        The value to fill with.
    dtype : data-type, optional
        Overrides the dtype.
    order : {'C', 'F', 'A', 'K'}, default 'K'
        Memory layout; 'K' and 'A' follow the prototype.
    shape : int or sequence of int, optional
        Overrides the shape.

    Returns
    -------
    SharedArray
        The array.
    """
    a = _new(*_like_args(prototype, dtype, order, shape), filled=True)
    np.copyto(a, fill_value, casting="unsafe")
    return a


class _Tensor(Protocol):
    """What sets a PyTorch tensor apart from an array, for :func:`share`'s signature."""

    def untyped_storage(self) -> object: ...

    def share_memory_(self) -> object: ...


TensorT = TypeVar("TensorT", bound=_Tensor)


@overload
def share(a: TensorT) -> TensorT: ...


@overload
def share(a: npt.ArrayLike) -> SharedArray: ...


def share(a: object) -> object:
    """Shared memory holding ``a``: ``a`` itself if it is already shared, else a copy;
    a PyTorch tensor is moved into shared memory in place.

    Parameters
    ----------
    a : array_like or torch.Tensor
        The data. Arrays of Python objects cannot be shared. A tensor must be a CPU
        tensor with a strided layout.

    Returns
    -------
    SharedArray or torch.Tensor
        For an array: an array equal to ``a`` (same shape, dtype and layout) whose memory
        is shared. If ``a`` already lives in shared memory, no copy is made and writes to
        the result are writes to ``a``.

        For a tensor: ``a`` itself, as ``a.share_memory_()`` returns it, its storage now
        in a sharexec segment (every view of that storage follows), unless it was in
        shared memory already (a sharexec segment, or torch's own).
    """
    if _is_tensor(a):
        from . import _tensors

        return _tensors.share(a, Options.resolve({}).spill_folder())
    arr = np.asarray(a)
    if is_shared(arr):
        return arr if isinstance(arr, SharedArray) else arr.view(SharedArray)
    out = _new(*_like_args(arr, None, "K", None), filled=True)
    np.copyto(out, arr)
    return out
