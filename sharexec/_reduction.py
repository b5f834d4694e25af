"""Deciding, per buffer, how it travels: by reference, copied once, or pickled.

One mechanism carries every call and every result: a cloudpickle pass at protocol 5
(:func:`dumps`) with

* a ``reducer_override`` that sees every :class:`numpy.ndarray` at any depth (inside
  tuples, dicts, dataclasses, dask graphs…). An array whose memory lies in a shared
  segment travels **by reference** (segment name + geometry, O(1)). A large private array
  is described as *a buffer over the bytes it spans + its geometry* (offset, shape,
  strides, dtype), so strided, transposed, F-order, datetime and negative-stride views
  all take the same road as contiguous ones; a gappy view is copied compactly. Object
  arrays and small arrays fall through to numpy's own pickling.
* a ``buffer_callback`` that receives every out-of-band buffer: the spans above, and
  those of any other protocol-5 object (pandas, pyarrow, …). One at or above
  ``min_share_bytes`` is **copied once** into a segment; smaller ones stay in-band.
* where torch is loaded, the same ``reducer_override`` sees every CPU tensor and untyped
  storage (:mod:`sharexec._tensors`), which follow torch's rules, not the copy rule: a
  storage in a shared segment travels by reference; a private one is moved into a
  segment first when sent to a task (the sender's tensor ends up shared, as torch's
  reducer does it), or copied as a buffer in a result. Whatever else torch registered
  with multiprocessing's ``ForkingPickler`` (its own shared memory, CUDA, sparse…) goes
  through its reducer, from the dispatch table (``_wire.Pickler``).

What the pass decides is the same both ways; *where the bytes go* is its :class:`Sink`'s.
The base puts each buffer in a fresh segment; the two directions refine it, side by side
at the end of this module:

* forward (parent → worker), :class:`ForwardSink`: a call's buffers, reused from a live
  copy of the same bytes or copied, on several cores (:func:`_in_parallel`: the workers
  wait for it), into a warm segment of the executor's pool or a fresh one; the parent
  owns the copies, and the worker maps them copy-on-write, so its writes stay private.
  It reaches the parent's ledgers (``_copies.CopyCache``, ``Counts``, the functions
  pickled once) through the :class:`Outbound` protocol: this module sits below the
  parent's side, which a worker never imports.
* backward (worker → parent), :class:`BackwardSink`: a result's buffers, copied on one
  core (the other workers have the other cores) into a warm segment the parent lent the
  task, or a fresh one whose ownership, with that of the shared arrays the worker
  allocated, passes to the parent once the pass succeeded.

A :class:`Packed` is what one pass made: the payload (small), its out-of-band buffers
(segment name, size, offset, length) and the mappings that must stay alive meanwhile.
"""

from __future__ import annotations

import bisect
import io
import logging
import os
import pickle
import sys
import threading
import types
from collections import ChainMap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeAlias

import numpy as np

from . import _segments, _tracking
from ._arrays import SharedArray, byte_bounds, rebuild_view, reduce_shared
from ._config import Options
from ._segments import Mapping
from ._wire import BufferRef, Pickler, share_globals
from .errors import SegmentError

logger = logging.getLogger("sharexec")

__all__ = [
    "BackwardSink",
    "ForwardSink",
    "Outbound",
    "Packed",
    "Reduced",
    "Sink",
    "argument_owner",
    "buffer_owner",
    "dumps",
]

# What a reducer returns (pickle's ``__reduce__`` protocol): a callable and its arguments,
# e.g. (rebuild_view, (buffer, 0, (1000,), (8,), dtype('float64'))).
Reduced: TypeAlias = tuple[Callable[..., object], tuple[object, ...]]


@dataclass
class Packed:
    """The outcome of one pass: what loky carries, and what must stay alive meanwhile."""

    payload: bytes
    buffers: list[BufferRef]
    # Mappings the payload refers to (copies, shared arrays): holding them keeps their
    # segments linked until the receiver has attached.
    keep: list[Mapping] = field(repr=False)
    # Those of them that are copies made for this payload (forward: poolable afterwards).
    copies: list[Mapping] = field(repr=False, default_factory=list)


def dumps(obj: object, sink: Sink, arguments: frozenset[int] = frozenset()) -> Packed:
    """Run one pass over ``obj``, its large buffers going where ``sink`` puts them.

    ``arguments``: the ids of the arrays a task was given as its arguments (see
    :func:`argument_owner`). If the pass fails, every segment it created is dropped (and
    so unlinked); if it succeeds, the sink has the last word (:meth:`Sink.done`).
    """
    state = Pass(sink, arguments)
    out = io.BytesIO()
    pickler = _Pickler(out, state)
    try:
        pickler.dump(obj)
        packed = Packed(out.getvalue(), state.buffers, state.keep, state.copies)
    finally:
        # The C pickler holds its own bound reducer_override: a reference cycle that
        # only the garbage collector would break. Empty it now, so that the arguments
        # it memoized and the segments of a failed pass are freed at once.
        pickler.clear_memo()
        state.buffers, state.keep, state.copied, state.copies = [], [], _Copied(), []
    sink.done(packed)
    return packed


class _Pickler(Pickler):
    # reducer_override sees every object and wins over the exact-type dispatch_table;
    # whatever is not an array must fall through to cloudpickle's own override, or
    # functions and classes defined in __main__ stop pickling by value.

    def __init__(self, file: io.BytesIO, state: Pass) -> None:
        if state.sink.dispatch_table is not None:
            # A carrier's own table: a pickler's attribute, which the C pickler reads as
            # it starts (pickle's documented per-pickler dispatch_table), over the class's.
            self.dispatch_table = state.sink.dispatch_table  # type: ignore[misc]
        super().__init__(file, protocol=5, buffer_callback=state.take_buffer)
        self._state = state
        self._torch = state.torch

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, np.ndarray):
            reduced = self._state.reduce_array(obj)
            if reduced is not None:
                return reduced
        elif type(obj) is types.FunctionType:
            sink = self._state.sink
            reduced = sink.reduce_function(obj)
            if reduced is not None:
                return reduced
            if sink.shares_globals:  # to a worker: rebuilt in its module's namespace there
                return share_globals(obj, super().reducer_override(obj))
        elif self._torch is not None:
            kind = type(obj)
            if kind in self._torch.TENSORS:
                reduced = self._torch.reduce_tensor(obj)
                if reduced is not None:
                    return reduced
            elif kind is self._torch.STORAGE:
                reduced = self._state.reduce_storage(obj)
                if reduced is not None:
                    return reduced
        return super().reducer_override(obj)


def _tensors() -> types.ModuleType | None:
    """sharexec._tensors if torch is loaded (else no object can be a tensor), else None."""
    if "torch" not in sys.modules:
        return None
    from . import _tensors  # imports torch, loaded already

    return _tensors


# ---------------------------------------------------------------------------------------
# The pass: what to do with each array and each out-of-band buffer
# ---------------------------------------------------------------------------------------


class Pass:
    """The state of one pickling pass: the buffers it took out of band, and why."""

    def __init__(self, sink: Sink, arguments: frozenset[int]) -> None:
        self.sink = sink
        self.min_share_bytes = sink.options.min_share_bytes
        self.arguments = arguments  # ids of the arrays the task was given as arguments
        self.buffers: list[BufferRef] = []
        self.keep: list[Mapping] = []
        self.copies: list[Mapping] = []  # the copies among keep
        self.copied = _Copied()  # byte ranges copied in this pass: a buffer inside one reuses it
        self.torch = _tensors()  # sharexec._tensors where torch is loaded, else None

    def reduce_array(self, a: np.ndarray) -> Reduced | None:
        """How ``a`` travels: a reduce tuple, or None to let numpy pickle it."""
        if type(a) is not np.ndarray and type(a) is not SharedArray:
            return None  # other subclasses (masked, memmap, …) pickle themselves
        if a.dtype.hasobject:
            return None
        low, high = byte_bounds(a)
        found = _tracking.find_shared(low, high)
        if found is not None and not self.sink.carries_segments:
            snapshot = self.sink.snapshot(a)
            if snapshot is not None:
                return snapshot
            found = None  # the sink's own snapshot: its bytes travel as a private array's
        if found is not None:
            mapping = found[0]
            self.keep.append(mapping)
            shared: Reduced = reduce_shared(a, mapping, self.sink.by_reference(mapping, a.nbytes))
            return shared
        if a.nbytes < self.min_share_bytes:
            if a.dtype.isnative:
                return None  # numpy pickles it, in-band
            # numpy's pickling of a non-contiguous, datetime or long double array turns
            # big-endian into native order: send its bytes in-band ourselves instead.
            data = bytearray(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            return rebuild_view, (data, 0, a.shape, None, a.dtype)
        if high - low != a.nbytes and not self._holds(low, high):
            return self._compact(a)
        # Dense (C, F, transposed, reversed: every byte it spans is its own), or inside
        # bytes this pass copied already: describe it over the source bytes it spans.
        span_low, span_high = _span_to_copy(a, low, high)
        return _describe(a, a, span_low, span_high, id(a) in self.arguments)

    def reduce_storage(self, storage: Any) -> Reduced | None:  # torch is typed Any
        """How a torch storage travels: by reference if its bytes lie in a shared segment;
        if private, moved into one first (a call: :attr:`Sink.moves_tensors`) or as a
        buffer (a result); None for torch's reducer (its own shared memory, a device's
        memory, or the ``tensor_sharing="torch"`` option for private ones)."""
        tensors = self.torch
        assert tensors is not None  # a storage is seen only where torch is loaded
        nbytes = storage.nbytes()
        if storage.device.type != "cpu":
            return None
        if nbytes == 0:
            return tensors.empty_storage, ()
        # A carrier without segments: the bytes as a buffer, whatever memory they lie in
        # (torch's reducer would pass a file descriptor or a shared-memory name).
        found = tensors.in_segment(storage) if self.sink.carries_segments else None
        if found is None:
            if self.sink.carries_segments and (
                storage.is_shared() or self.sink.options.tensor_sharing == "torch"
            ):
                return None
            if not self.sink.moves_tensors:
                span = np.asarray(_Span(storage, storage.data_ptr(), nbytes))
                return tensors.rebuild_storage, (pickle.PickleBuffer(span),)  # type: ignore[arg-type]
            if not tensors.CAN_MOVE:
                return None
            try:
                found = tensors.move(storage, self.sink.spill_to, self.sink.copy)
            except SegmentError as exc:
                self.sink.fell_back(f"{exc}; tensors of this size go through torch's reducer")
                return None
            self.sink.count("bytes_copied", nbytes)
        mapping, offset = found
        self.keep.append(mapping)
        adopt = self.sink.by_reference(mapping, nbytes)
        return tensors.rebuild_shared_storage, (mapping.name, len(mapping), offset, nbytes, adopt)

    def _holds(self, low: int, high: int) -> bool:
        return self.copied.find(low, high) is not None

    def _compact(self, a: np.ndarray) -> Reduced | None:
        """Copy a gappy view (``a[::2]``, ``a[:, :500]``) compactly: only its elements.

        Fresh shared pages cost far more than reading strided memory, so copying half
        the bytes beats a memcpy of the whole span. The copy keeps ``a``'s axis order.
        A carrier without segments gets the copy in this process's memory, as a buffer.
        """
        f_order = a.ndim > 1 and abs(a.strides[0]) < abs(a.strides[-1])
        if not self.sink.carries_segments:
            dense = np.array(a, order="F" if f_order else "C")
            low, high = byte_bounds(dense)
            return _describe(dense, dense, low, high)
        mapping = self.sink.segment_for(a.nbytes)
        if mapping is None:
            return None  # numpy pickles it
        self.sink.count("bytes_copied", a.nbytes)
        copy = np.ndarray(a.shape, a.dtype, buffer=mapping, order="F" if f_order else "C")
        np.copyto(copy, a)
        # Listed as copied, so take_buffer sends these bytes as they are.
        self._copied(mapping.address, a.nbytes, mapping)
        return _describe(copy, mapping, mapping.address, mapping.address + a.nbytes)

    def _copied(self, low: int, length: int, mapping: Mapping) -> None:
        self.copied.add(low, low + length, mapping)
        self.keep.append(mapping)
        self.copies.append(mapping)

    def take_buffer(self, buffer: pickle.PickleBuffer) -> bool:
        """``buffer_callback``: True keeps a buffer in-band, False sends it out of band."""
        raw = buffer.raw()
        length = raw.nbytes
        if length < self.min_share_bytes:
            return True
        if not self.sink.carries_segments:
            self.sink.send(raw)
            return False
        low = _address(raw)
        found = self.copied.find(low, low + length)
        if found is not None:
            mapping, offset = found
            self.sink.count("bytes_reused", length)
        else:
            placed = self.sink.place(raw, low)
            if placed is None:
                return True  # no segment to be had: pickled in-band
            mapping, offset = placed, 0
            self._copied(low, length, mapping)
        self.buffers.append((mapping.name, len(mapping), offset, length))
        return False


class _Copied:
    """The byte ranges one pass copied, and the copy holding each: a buffer that lies
    inside one of them is sent from that copy, at an offset.

    A lookup is a bisection, an insertion a bisection and a list insertion (a memmove of
    pointers), where a scan of every copy made the pass quadratic in its buffers (see
    ``bench/many_buffers.py``). The ranges are kept sorted by start,
    none inside another: a range that comes to contain earlier ones replaces them here
    (their copies still serve the buffers that took them, and hold the same bytes). So
    the ends are sorted too, and the only range that may hold ``[low, high)`` is the last
    one to start at or before ``low``.
    """

    def __init__(self) -> None:
        # Starts of the ranges, sorted, e.g. [140213, 9000000], and the ranges,
        # e.g. [(140213, 8140213, <Mapping>), (9000000, 9004096, <Mapping>)].
        self.starts: list[int] = []
        self.ranges: list[tuple[int, int, Mapping]] = []

    def find(self, low: int, high: int) -> tuple[Mapping, int] | None:
        """The copy holding the bytes ``[low, high)``, and ``low``'s offset in it."""
        i = bisect.bisect_right(self.starts, low) - 1
        if i < 0:
            return None
        start, end, mapping = self.ranges[i]
        return (mapping, low - start) if high <= end else None

    def add(self, low: int, high: int, mapping: Mapping) -> None:
        """``mapping`` holds a copy of the bytes ``[low, high)``."""
        if self.find(low, high) is not None:
            return  # inside a range already: that one serves these bytes too
        i = bisect.bisect_left(self.starts, low)
        j = i  # the ranges inside the new one (they start at or after it) end before it
        while j < len(self.ranges) and self.ranges[j][1] <= high:
            j += 1
        self.starts[i:j] = [low]
        self.ranges[i:j] = [(low, high, mapping)]


class _Span:
    """``length`` bytes at ``address``, as an array interface, keeping ``owner`` alive.

    ``argument``: ``owner`` is an array the task was given as one of its arguments (not
    one made while pickling): a copy of its bytes may serve that task as it is.
    """

    def __init__(self, owner: object, address: int, length: int, argument: bool = False) -> None:
        self.owner = owner
        self.argument = argument
        self.__array_interface__ = {
            "data": (address, False),  # read only, but not flagged: a
            # read-only flag would make pickle load the copy read-only (READONLY_BUFFER)
            "shape": (length,),
            "typestr": "|u1",
            "version": 3,
        }


def argument_owner(raw: memoryview) -> object:
    """The array owning the memory under ``raw`` (the root of its bases), if ``raw`` spans
    an array the task was given as an argument; else None.

    Only then can a copy be trusted without comparing: a buffer made while pickling (a
    temporary, or one rewritten by some ``__reduce__``) may hold other bytes at the same
    address for every task. Both carriers trust a copy by this rule (see
    ``_copies.CopyCache.reusable`` and ``_cluster.sending.Sender.send``).
    """
    span = getattr(raw.obj, "base", None)
    if not isinstance(span, _Span) or not span.argument:
        return None
    return buffer_owner(raw)


def buffer_owner(raw: memoryview) -> object:
    """The object whose memory ``raw`` lies in: the root of the bases of the array a span
    of the pass was made over, or the object that exported ``raw`` (a buffer of pandas,
    say)."""
    span = getattr(raw.obj, "base", None)
    owner = span.owner if isinstance(span, _Span) else raw.obj
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    return owner


def _address(buffer: memoryview) -> int:
    return int(np.frombuffer(buffer, np.uint8).__array_interface__["data"][0])


def _span_to_copy(a: np.ndarray, low: int, high: int) -> tuple[int, int]:
    """The bytes to copy for ``a``: its own span, or its base's if it spans most of it.

    Copying the whole base for a view that covers more than half of it lets the other
    views of that base in the same pass (``a``, ``a.T``, ``a[::2]`` after ``a``) share
    one copy; a small view of a big array copies only what it spans.
    """
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    root_low, root_high = byte_bounds(root)
    if root_low <= low and high <= root_high and 2 * (high - low) > root_high - root_low:
        return root_low, root_high
    return low, high


def _describe(
    a: np.ndarray, owner: object, low: int, high: int, argument: bool = False
) -> Reduced:
    """Reduce ``a`` to the bytes ``[low, high)`` it lies in, as a buffer, plus its geometry."""
    span = np.asarray(_Span(owner, low, high - low, argument))
    first = a.__array_interface__["data"][0] - low
    buffer = pickle.PickleBuffer(span)  # type: ignore[arg-type]  # an ndarray is a buffer
    return rebuild_view, (buffer, first, a.shape, a.strides, a.dtype)


# ---------------------------------------------------------------------------------------
# Sinks: where the bytes go
# ---------------------------------------------------------------------------------------


class Sink:
    """Where one pass puts the buffers it takes out of band, and what it tells of them.

    The base places each buffer in a fresh segment: shared memory first, then a
    file-backed segment on disk, then nothing (the buffer is pickled): a task never
    fails because shared memory was short. A direction refines :meth:`segment` (where
    a new copy goes), :meth:`place` (reuse), :meth:`copy` (on how many cores) and what
    it reports.
    """

    # Whether a private torch storage is moved into a shared segment before it goes (a
    # call: torch's semantics, the sender's tensor ends up shared), or copied as a buffer
    # (a result).
    moves_tensors = False
    # Whether functions sent by value are rebuilt in the receiver's one namespace of
    # their module (a call, to a worker: _wire.share_globals), or each over globals of
    # its own, as cloudpickle rebuilds them (a result).
    shares_globals = False
    # Whether the receiver shares this host's segments. False (the cluster executor,
    # whose tasks may run on other hosts): nothing goes by reference, no buffer is
    # copied into a segment; a view of a shared array goes as the sink's snapshot, and
    # every large buffer (a gappy view's compact copy, a torch storage's bytes) is
    # handed to the sink's :meth:`send`.
    carries_segments = True
    # The reducers by exact type, if not ``_wire.Pickler``'s (the cluster's leaves out
    # those that pass a file descriptor or a shared-memory name: ``_cluster.packing``).
    dispatch_table: ChainMap[Any, Any] | None = None

    def __init__(self, options: Options) -> None:
        self.options = options
        self.spill_to = options.spill_folder()

    def by_reference(self, mapping: Mapping, nbytes: int) -> bool:
        """An array of ``nbytes`` in the shared ``mapping`` travels by reference; whether
        the receiver takes over the segment's ownership."""
        return False

    def place(self, raw: memoryview, low: int) -> Mapping | None:
        """The segment that will hold the bytes ``raw`` (at address ``low``), copied into
        it; None if none can be had (they are pickled)."""
        mapping = self.segment_for(raw.nbytes)
        if mapping is None:
            return None
        self.count("bytes_copied", raw.nbytes)
        target = np.frombuffer(mapping, np.uint8, raw.nbytes)
        self.copy(target, np.frombuffer(raw, np.uint8))
        return mapping

    def segment_for(self, size: int) -> Mapping | None:
        """A segment (:meth:`segment`) to copy ``size`` bytes into, every byte past them
        zero; None when none can be had.

        A warm or lent segment may be up to twice as big, and held other bytes before:
        the receiver maps all of it, and reaches all of it through the array's ``.base``.
        A fresh one has nothing past ``size``.
        """
        mapping = self.segment(size)
        if mapping is not None:
            _segments.zero_from(mapping, size)
        return mapping

    def segment(self, size: int) -> Mapping | None:
        """A segment to copy ``size`` bytes into; None when none can be had."""
        try:
            mapping = _tracking.new_private(size, self.spill_to)
        except SegmentError as exc:
            self.fell_back(f"{exc}; buffers of this size are pickled instead")
            return None
        if os.path.isabs(mapping.name):
            self.fell_back(_tracking.spilled(mapping.name, "large buffers go"))
        return mapping

    def copy(self, target: np.ndarray, source: np.ndarray) -> None:
        """Copy ``source`` into ``target`` (bytes of the same length)."""
        target[:] = source

    def count(self, what: str, n: int) -> None:
        """What went where (``statistics()``); nothing by default."""

    def fell_back(self, message: str) -> None:
        """Shared memory fell short: the buffer went to a file, or is pickled."""
        logger.info("%s", message)

    def snapshot(self, a: np.ndarray) -> Reduced | None:
        """How a view of a shared array travels without segments (``carries_segments``
        False): a reduce tuple, or None for the sink's own snapshot (pickled as a private
        array). Only such a sink is asked."""
        raise NotImplementedError

    def send(self, raw: memoryview) -> None:
        """Take a large buffer out of band, without segments (``carries_segments`` False):
        the sink sends it; the receiver gets it in the pass's order. Only such a sink is
        asked."""
        raise NotImplementedError

    def reduce_function(self, fn: types.FunctionType) -> Reduced | None:
        """How a function travels: a reduce tuple, or None to let cloudpickle pickle it."""
        return None

    def done(self, packed: Packed) -> None:
        """The pass succeeded with ``packed``."""


# ---------------------------------------------------------------------------------------
# The two directions: a call's buffers (forward), a result's (backward)
# ---------------------------------------------------------------------------------------


class CachedFunction(Protocol):
    """A function's pickle made once per executor (``_transport._FunctionRef``)."""

    @property
    def keep(self) -> Sequence[Mapping]:
        """The segments that hold the pickle and its buffers."""

    def __reduce__(self) -> Reduced:
        """How a call names the function: its pickle, or the segments holding it."""


class FunctionCache(Protocol):
    """The functions an executor pickles once (``_transport.Functions``)."""

    def payload(self, fn: types.FunctionType) -> CachedFunction | None:
        """How ``fn`` travels by value, once per executor; None: by the pass."""


class CopyLedger(Protocol):
    """What the forward sink asks of the executor's copies (``_copies.CopyCache``)."""

    def reuse(self, raw: memoryview, low: int, task: int | None) -> Mapping | None:
        """A live copy of ``raw`` that is a valid snapshot for ``task``, out of the pool."""

    def take_warm(self, size: int) -> Mapping | None:
        """A pooled segment for ``size`` new bytes, if any."""

    def remember(self, raw: memoryview, low: int, mapping: Mapping, made: int) -> None:
        """``mapping`` holds the bytes ``raw`` at ``low``, copied after task ``made``."""


class Tally(Protocol):
    """What ``statistics()`` counts (``_copies.Counts``)."""

    def add(self, what: str, n: int = 1) -> None: ...


class Outbound(Protocol):
    """What a :class:`ForwardSink` needs of its executor's transport
    (``_transport.Transport``)."""

    @property
    def options(self) -> Options: ...

    @property
    def counts(self) -> Tally: ...

    @property
    def copies(self) -> CopyLedger: ...

    @property
    def functions(self) -> FunctionCache: ...

    def number(self) -> int:
        """The next number in submission order (tasks and copies alike)."""


class ForwardSink(Sink):
    """A call's buffers: reused from a live copy of the same bytes, or copied (on several
    cores: the workers wait for it) into a warm segment of the pool, or a fresh one;
    counted for ``statistics()``; a fallback warned of once.

    ``task``: the number of the task being sent, if this pass sends one;
    ``cache_functions``: functions of ``__main__`` go by their cached pickle;
    ``counted``: False for a call sent again after a worker handed it back unstarted,
    whose bytes by reference and reused copies were counted when it was first sent
    (only what it copies anew is). Private
    torch tensors are moved into shared memory before they go (``moves_tensors``).
    """

    moves_tensors = True
    shares_globals = True

    def __init__(
        self,
        transport: Outbound,
        task: int | None = None,
        cache_functions: bool = True,
        counted: bool = True,
    ) -> None:
        super().__init__(transport.options)
        self.transport = transport
        self.task = task
        self.cache_functions = cache_functions
        self.counted = counted
        self.held: list[Mapping] = []  # the segments of the functions sent by them

    def by_reference(self, mapping: Mapping, nbytes: int) -> bool:
        # What the task can reach through this view: its elements, and never more than
        # the segment (a broadcast view, stride 0, has more elements than bytes).
        self.count("bytes_by_reference", min(nbytes, len(mapping)))
        return False

    def place(self, raw: memoryview, low: int) -> Mapping | None:
        reused = self.transport.copies.reuse(raw, low, self.task)
        if reused is not None:  # a copy made for an earlier call: a copy avoided
            if self.counted:
                self.transport.counts.add("bytes_reused", raw.nbytes)
            return reused
        made = self.transport.number()  # tasks numbered below came before this copy
        mapping = super().place(raw, low)
        if mapping is not None:
            self.transport.copies.remember(raw, low, mapping, made)
        return mapping

    def segment(self, size: int) -> Mapping | None:
        return self.transport.copies.take_warm(size) or super().segment(size)

    def copy(self, target: np.ndarray, source: np.ndarray) -> None:
        # 128 MiB into warm pages: 19 ms on one core, 10 ms on two; fresh: 61 and 34 ms.
        def copy(low: int, high: int) -> bool:
            target[low:high] = source[low:high]  # numpy releases the GIL
            return True

        _in_parallel(len(source), copy)

    def count(self, what: str, n: int) -> None:
        # The pass reports a buffer inside bytes it copied earlier in the same pass as
        # reused; but a gappy view's compact copy is such a buffer too, at its first and
        # only use (copied, not reused). Reuse within a pass is counted in done()
        # instead, from the buffers themselves.
        if what != "bytes_reused" and (self.counted or what != "bytes_by_reference"):
            self.transport.counts.add(what, n)

    def done(self, packed: Packed) -> None:
        # The task holds the segments of the functions it sends by them (a function
        # made while pickling may be collected before the worker maps them).
        packed.keep.extend(self.held)
        # A buffer in a segment an earlier buffer of this pass went to shares that copy
        # (a second view of one base: a.T after a): a copy avoided. The first buffer in
        # each segment was copied there, or reused from an earlier call (see place()).
        if not self.counted:
            return
        seen: set[str] = set()
        reused = 0
        for name, _, _, length in packed.buffers:
            if name in seen:
                reused += length
            seen.add(name)
        if reused:
            self.transport.counts.add("bytes_reused", reused)

    def fell_back(self, message: str) -> None:
        self.count("fallbacks", 1)
        _tracking.warn_fallback(message)

    def reduce_function(self, fn: types.FunctionType) -> Reduced | None:
        if not self.cache_functions:
            return None
        ref = self.transport.functions.payload(fn)
        if ref is None:
            return None
        self.held.extend(ref.keep)
        return ref.__reduce__()


class BackwardSink(Sink):
    """A worker's result: into the warm segments the parent lent the task, or fresh ones
    handed over to the parent, copied on one core.

    ``lent``: those segments, ``(name, size)``; ``attach_lent(name, size)`` maps one
    (the worker keeps that mapping for the next task lent it); ``token``: the receiver
    of the executor the result goes to (the sweeper holds what is handed over in flight
    to it). Fallbacks are only logged: the parent warns when it receives a result in a
    file.
    """

    def __init__(
        self,
        options: Options,
        lent: list[tuple[str, int]],
        attach_lent: Callable[[str, int], Mapping],
        token: int,
    ) -> None:
        super().__init__(options)
        self.lent = list(lent)
        self.attach_lent = attach_lent
        self.token = token  # the receiver of the executor the result goes to

    def by_reference(self, mapping: Mapping, nbytes: int) -> bool:
        # A shared array this worker allocated goes to the parent's care.
        return _tracking.owns(mapping)

    def segment(self, size: int) -> Mapping | None:
        lent = next((s for s in self.lent if size <= s[1] <= 2 * size), None)
        if lent is not None:
            self.lent.remove(lent)
            try:
                return self.attach_lent(*lent)
            except SegmentError:  # gone: the executor was shut down meanwhile
                pass
        return super().segment(size)

    def done(self, packed: Packed) -> None:
        # Only now that the pass succeeded: the result's copies, and the shared arrays
        # this worker allocated, become the parent's to free.
        for mapping in packed.keep:
            _tracking.hand_off(mapping, self.token)


# ---------------------------------------------------------------------------------------
# Copying large buffers on several cores
# ---------------------------------------------------------------------------------------

_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_PARALLEL_SLICE = 16 << 20  # below this, a thread's start costs more than it saves


def _in_parallel(n: int, work: Callable[[int, int], bool]) -> list[bool]:
    """``work(low, high)`` over slices of ``range(n)``, on as many cores as help.

    For work that releases the GIL: a slice per core (at most 4), none under
    _PARALLEL_SLICE bytes; the calling thread takes the first. What a slice raised is
    raised here, once every slice has ended.
    """
    slices = max(1, min(_CORES, 4, n // _PARALLEL_SLICE))
    if slices == 1:
        return [work(0, n)]
    bounds = [n * i // slices for i in range(slices + 1)]
    done = [False] * slices
    failed: list[BaseException] = []

    def run(i: int) -> None:
        try:
            done[i] = work(bounds[i], bounds[i + 1])
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, slices)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return done
