"""Arrays whose memory lives in shared segments, and the geometry of array views.

Defines the public allocators (:func:`empty`, :func:`zeros`, …, :func:`share`,
:func:`is_shared`), the :class:`SharedArray` type they return, and the two functions that
rebuild an array view from a buffer and its geometry (offset, shape, strides, dtype),
used on both sides of every transfer.

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
import tempfile
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal, Protocol, SupportsIndex, TypeVar, overload

import numpy as np
import numpy.typing as npt
from loky.backend import reduction as loky_reduction

from . import _tracking
from ._config import Options
from ._segments import Mapping

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
    buffer: Any,
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

    Any view of it (slice, transpose, reshape) shares the same memory: passed to a
    sharexec executor or through :mod:`multiprocessing`, it travels by reference, and
    writes made by any process are seen by all. New arrays computed from it (``a + 1``)
    are ordinary arrays. Pickled to a file or with :mod:`pickle`, it stores its data and
    loads as a plain :class:`numpy.ndarray`.
    """

    def __array_wrap__(
        self, obj: np.ndarray, context: Any = None, return_scalar: bool = False
    ) -> Any:
        if return_scalar:
            return obj[()]
        if is_shared(obj):
            return obj if isinstance(obj, SharedArray) else obj.view(SharedArray)
        return obj.view(np.ndarray)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        # Plain pickle: the data, as an ordinary array. (sharexec's own pickler and
        # multiprocessing's reach this only for arrays not in a segment any more.)
        return self.view(np.ndarray).__reduce_ex__(protocol)

    def __reduce__(self) -> Any:
        return self.view(np.ndarray).__reduce__()


def is_shared(a: Any) -> bool:
    """Whether ``a`` is an array whose memory lies in a sharexec shared segment, or a
    PyTorch tensor in shared memory (a sharexec segment, or torch's own).

    Parameters
    ----------
    a : object
        Any object; only :class:`numpy.ndarray` instances and tensors can be shared.

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


def _is_tensor(a: Any) -> bool:
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
    """Rebuild a view of a shared array from its segment's name and its geometry."""
    mapping = _tracking.attach_shared(name, size, adopt)
    view: SharedArray = SharedArray(shape, dtype, buffer=mapping, offset=offset, strides=strides)
    view.flags.writeable = writeable  # a read-only view stays read-only everywhere
    return view


def reduce_shared(a: np.ndarray, mapping: Mapping, adopt: bool = False) -> Any:
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


def _reduce_for_multiprocessing(a: SharedArray) -> Any:
    found = _tracking.find_shared(*byte_bounds(a))
    if found is None:
        return a.view(np.ndarray).__reduce__()
    return reduce_shared(a, found[0])


_registered_with_multiprocessing = False


def _new(shape: ShapeLike, dtype: npt.DTypeLike, order: Literal["C", "F"]) -> SharedArray:
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
    spill_to = Options.resolve({}).temp_folder or tempfile.gettempdir()
    mapping = _tracking.new_shared(math.prod(shape) * dtype.itemsize, spill_to)
    if os.path.isabs(mapping.name):
        _tracking.warn_fallback(_tracking.spilled(mapping.name, "shared arrays are allocated in"))
    array: SharedArray = SharedArray(shape, dtype, buffer=mapping, order=order)
    return array


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
        Any numpy dtype that holds no Python objects.
    order : {'C', 'F'}, default 'C'
        Row-major or column-major layout.

    Returns
    -------
    SharedArray
        The array. A new segment reads as zeros, so :func:`zeros` costs no more.
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
        Any numpy dtype that holds no Python objects.
    order : {'C', 'F'}, default 'C'
        Row-major or column-major layout.

    Returns
    -------
    SharedArray
        The array; fresh segments are zero-filled by the operating system.
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
    fill_value: Any,
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
    a = _new(shape, dtype, order)
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
    fill_value: Any,
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
    a = _new(*_like_args(prototype, dtype, order, shape))
    np.copyto(a, fill_value, casting="unsafe")
    return a


class _Tensor(Protocol):
    """What sets a PyTorch tensor apart from an array, for :func:`share`'s signature."""

    def untyped_storage(self) -> Any: ...

    def share_memory_(self) -> Any: ...


TensorT = TypeVar("TensorT", bound=_Tensor)


@overload
def share(a: TensorT) -> TensorT: ...


@overload
def share(a: npt.ArrayLike) -> SharedArray: ...


def share(a: Any) -> Any:
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

        return _tensors.share(a, Options.resolve({}).temp_folder or tempfile.gettempdir())
    arr = np.asarray(a)
    if is_shared(arr):
        return arr if isinstance(arr, SharedArray) else arr.view(SharedArray)
    out = empty_like(arr)
    np.copyto(out, arr)
    return out
