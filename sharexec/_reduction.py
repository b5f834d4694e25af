"""Deciding, per buffer, how it travels: by reference, copied once, or pickled.

One mechanism carries every call and every result: a cloudpickle pass at protocol 5 with

* a ``reducer_override`` that sees every :class:`numpy.ndarray` at any depth (inside
  tuples, dicts, dataclasses, dask graphs…). An array whose memory lies in a shared
  segment travels **by reference** (segment name + geometry, O(1)). A large private array
  is described as *a buffer over the bytes it spans + its geometry* (offset, shape,
  strides, dtype), so strided, transposed, F-order, datetime and negative-stride views
  all take the same road as contiguous ones. Object arrays and small arrays fall through
  to numpy's own pickling.
* a ``buffer_callback`` that receives every out-of-band buffer: the spans above, and
  those of any other protocol-5 object (pandas, pyarrow, …). One at or above
  ``min_share_bytes`` is **copied once** into a segment; smaller ones stay in-band.

The two directions are deliberately asymmetric (see :class:`Pass`):

* forward (parent → worker): copies are owned by the parent and live while a task in
  flight refers to them; the worker maps them copy-on-write, so its writes stay private.
  A copy still in flight is reused for the same bytes, so submitting one array many
  times holds one copy. It is reused as it is by a task submitted before the copy was
  made (the stdlib would pickle that task later still: any moment between submit and
  dispatch is the task's), and after comparing the bytes for any later task: a changed
  array never reuses a stale copy. A copy no task holds and no worker maps any more goes
  to a pool of warm segments for the next copies.
* backward (worker → parent): the worker copies a large result into a segment: a warm
  one the parent lent the task from its pool (sized after the function's last result),
  or a fresh one whose ownership it hands to the parent, which maps it and unlinks it at
  once. Either way the result is an ordinary private array (no other process maps it);
  a lent segment goes back to the pool when the result is collected. Shared arrays the
  worker allocated go back by reference, their ownership handed over too.

Loky stays the carrier of small bytes only. :class:`Task` and ``_worker.Reply`` are what
loky pickles; their ``__reduce__`` returns our payload (the pickle, small) and the list
of out-of-band buffers (segment name, size, offset, length).
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import pickle
import shutil
import sys
import tempfile
import threading
import time
import types
import weakref
from collections import ChainMap, Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any, ClassVar

import cloudpickle
import numpy as np

from . import _segments, _tracking
from ._arrays import SharedArray, byte_bounds, rebuild_view, reduce_shared
from ._config import Options
from ._loky import DISPATCH_TABLE
from ._segments import Mapping
from ._worker import BufferRef, Delivered, attach_lent, is_plain, load_call, load_function
from .errors import SegmentError

logger = logging.getLogger("sharexec")

__all__ = ["Task", "Transport", "dumps", "is_lent", "receive"]

_COMPARE_CHUNK = 8 << 20  # compare in slices this big: no n-byte temporary
_FUNCTIONS_REMEMBERED = 256  # functions whose last result sizes are kept
_POOL_IDLE_SECONDS = 10.0  # a pooled segment unused this long is dropped


def _same_bytes(a: int, b: int, n: int) -> bool:
    """Whether the ``n`` bytes at addresses ``a`` and ``b`` are equal.

    libc's memcmp, about twice as fast as numpy's comparison here; it releases the GIL,
    so a large comparison runs in slices on several cores (128 MiB: 18 ms on one, 10 ms
    on two). Numpy, in slices (no n-byte temporary), where there is no libc to call.
    """
    if _memcmp is not None:
        memcmp = _memcmp
        return all(_in_parallel(n, lambda low, high: memcmp(a + low, b + low, high - low) == 0))
    x = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(a))
    y = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(b))
    return all(
        np.array_equal(x[i : i + _COMPARE_CHUNK], y[i : i + _COMPARE_CHUNK])
        for i in range(0, n, _COMPARE_CHUNK)
    )


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


_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_PARALLEL_SLICE = 16 << 20  # below this, a thread's start costs more than it saves


def _load_memcmp() -> Any:
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # pragma: no cover - no libc symbols
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_memcmp = _load_memcmp()


def _pool_limit() -> int:
    """Bytes of warm segments an executor keeps: a quarter of shared memory, <= 1 GiB."""
    try:
        total = shutil.disk_usage(_segments.SHM_FOLDER).total
    except OSError:
        return 0
    return min(1 << 30, total // 4)


# ---------------------------------------------------------------------------------------
# One pickling pass
# ---------------------------------------------------------------------------------------


@dataclass
class Packed:
    """The outcome of one pass: what loky carries, and what must stay alive meanwhile."""

    payload: bytes
    buffers: list[BufferRef]
    # Mappings the payload refers to (copies, shared arrays): holding them keeps their
    # segments linked until the receiver has attached.
    keep: list[Mapping] = field(repr=False)
    # Those of them that are copies made for this payload (forward): poolable afterwards.
    copies: list[Mapping] = field(repr=False, default_factory=list)


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


def _describe(a: np.ndarray, owner: object, low: int, high: int, argument: bool = False) -> Any:
    """Reduce ``a`` to the bytes ``[low, high)`` it lies in, as a buffer, plus its geometry."""
    span = np.asarray(_Span(owner, low, high - low, argument))
    first = a.__array_interface__["data"][0] - low
    buffer = pickle.PickleBuffer(span)  # type: ignore[arg-type]  # an ndarray is a buffer
    return rebuild_view, (buffer, first, a.shape, a.strides, a.dtype)


class Pass:
    """The state of one pickling pass: the buffers it took out of band, and why."""

    def __init__(
        self,
        options: Options,
        transport: Transport | None,
        cache_functions: bool = True,
        task: int | None = None,
        lent: list[tuple[str, int]] | None = None,
        arguments: frozenset[int] = frozenset(),
    ) -> None:
        self.task = task  # the number of the task being sent, if this pass sends one
        self.arguments = arguments  # ids of the arrays the task was given as arguments
        # Backward: warm segments the parent lent this task for its result, (name, size).
        self.lent = list(lent or [])
        self.min_share_bytes = options.min_share_bytes
        self.spill_to = options.temp_folder or tempfile.gettempdir()
        self.transport = transport  # None: the backward pass of a worker
        self.cache_functions = cache_functions and transport is not None
        self.buffers: list[BufferRef] = []
        self.keep: list[Mapping] = []
        # Byte ranges copied in this pass, e.g. [(140213, 8140213, <Mapping>)]: a buffer
        # inside one of them reuses it.
        self._copied: list[tuple[int, int, Mapping]] = []
        self.copies: list[Mapping] = []  # the copies among keep

    def reduce_array(self, a: np.ndarray) -> Any:
        """How ``a`` travels: a reduce tuple, or None to let numpy pickle it."""
        if type(a) is not np.ndarray and type(a) is not SharedArray:
            return None  # other subclasses (masked, memmap, …) pickle themselves
        if a.dtype.hasobject:
            return None
        low, high = byte_bounds(a)
        found = _tracking.find_shared(low, high)
        if found is not None:
            mapping = found[0]
            self.keep.append(mapping)
            self._count("bytes_by_reference", a.nbytes)
            # Backward, a shared array this worker allocated goes to the parent's care.
            adopt = self.transport is None and _tracking.owns(mapping)
            return reduce_shared(a, mapping, adopt)
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

    def _holds(self, low: int, high: int) -> bool:
        return any(lo <= low and high <= hi for lo, hi, _ in self._copied)

    def _new_copy(self, size: int) -> Mapping | None:
        """A segment to copy ``size`` bytes into; None when none can be had (pickle them).

        Shared memory first, then a file-backed segment on disk, then nothing: a task
        never fails because shared memory was short. The user hears of it once.
        """
        if self.transport is not None:
            pooled = self.transport.take_pooled(size)
            if pooled is not None:
                return pooled
        lent = next((s for s in self.lent if size <= s[1] <= 2 * size), None)
        if lent is not None:
            self.lent.remove(lent)
            try:
                return attach_lent(*lent)  # in a worker: kept between the tasks lent it
            except SegmentError:  # gone: the executor was shut down meanwhile
                pass
        try:
            mapping = _tracking.new_private(size, self.spill_to)
        except SegmentError as exc:
            self._fell_back(f"{exc}; buffers of this size are pickled instead")
            return None
        if os.path.isabs(mapping.name):
            self._fell_back(
                f"shared memory is full or missing ({_segments.SHM_FOLDER}): large "
                f"buffers go through files in {os.path.dirname(mapping.name)} instead"
            )
        return mapping

    def _count(self, what: str, n: int) -> None:
        if self.transport is not None:  # the parent's side: what statistics() reports
            self.transport.counts[what] += n

    def _fell_back(self, message: str) -> None:
        self._count("fallbacks", 1)
        if self.transport is not None:
            _tracking.warn_fallback(message)
        else:  # a worker: the parent warns when it receives the result
            logger.info("%s", message)

    def _compact(self, a: np.ndarray) -> Any:
        """Copy a gappy view (``a[::2]``, ``a[:, :500]``) compactly: only its elements.

        Fresh shared pages cost far more than reading strided memory, so copying half
        the bytes beats a memcpy of the whole span. The copy keeps ``a``'s axis order.
        """
        mapping = self._new_copy(a.nbytes)
        if mapping is None:
            return None  # numpy pickles it
        self._count("bytes_copied", a.nbytes)
        f_order = a.ndim > 1 and abs(a.strides[0]) < abs(a.strides[-1])
        copy = np.ndarray(a.shape, a.dtype, buffer=mapping, order="F" if f_order else "C")
        np.copyto(copy, a)
        # Listed as copied, so take_buffer sends these bytes as they are.
        self._copied.append((mapping.address, mapping.address + a.nbytes, mapping))
        self.keep.append(mapping)
        self.copies.append(mapping)
        return _describe(copy, mapping, mapping.address, mapping.address + a.nbytes)

    def reduce_function(self, fn: types.FunctionType) -> Any:
        """A function pickled once per executor, or None to let cloudpickle pickle it."""
        if not self.cache_functions:
            return None
        assert self.transport is not None
        payload = self.transport.function_payload(fn)
        return None if payload is None else (load_function, (payload,))

    def take_buffer(self, buffer: pickle.PickleBuffer) -> bool:
        """``buffer_callback``: True keeps a buffer in-band, False sends it out of band."""
        raw = buffer.raw()
        length = raw.nbytes
        if length < self.min_share_bytes:
            return True
        low = _address(raw)
        for copied_low, copied_high, copied in self._copied:
            if copied_low <= low and low + length <= copied_high:
                mapping, offset = copied, low - copied_low
                self._count("bytes_reused", length)
                break
        else:
            fresh = self._copy(raw, low)
            if fresh is None:
                return True  # no segment to be had: pickled in-band
            mapping, offset = fresh, 0
            self._copied.append((low, low + length, mapping))
            self.keep.append(mapping)
            self.copies.append(mapping)
        self.buffers.append((mapping.name, len(mapping), offset, length))
        return False

    def _copy(self, raw: memoryview, low: int) -> Mapping | None:
        if self.transport is not None:
            reused = self.transport.reusable_copy(raw, low, self.task)
            if reused is not None:
                self._count("bytes_reused", raw.nbytes)
                return reused
            made = self.transport.number()  # tasks numbered below came before this copy
        mapping = self._new_copy(raw.nbytes)
        if mapping is None:
            return None
        self._count("bytes_copied", raw.nbytes)
        target, source = np.frombuffer(mapping, np.uint8, raw.nbytes), np.frombuffer(raw, np.uint8)
        if self.transport is None:  # a worker: the other workers have the other cores
            target[:] = source
        else:  # the parent, dispatching: its workers wait for this copy (128 MiB, warm:
            # 19 ms on one core, 10 ms on two; fresh: 61 and 34 ms)

            def copy(low: int, high: int) -> bool:
                target[low:high] = source[low:high]  # numpy releases the GIL
                return True

            _in_parallel(raw.nbytes, copy)
            self.transport.remember_copy(raw, low, mapping, made)
        return mapping


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    # reducer_override sees every object and wins over the exact-type dispatch_table;
    # whatever is not an array must fall through to cloudpickle's own override, or
    # functions and classes defined in __main__ stop pickling by value.
    #
    # The dispatch table is the one loky's own pickler uses (loky's reducers first:
    # bound methods by reference, sockets and multiprocessing connections through the
    # process being spawned, partials; then cloudpickle's and copyreg's): an object
    # pickles inside our payload exactly as it would have in loky's.
    dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
        DISPATCH_TABLE, cloudpickle.Pickler.dispatch_table
    )

    def __init__(self, file: io.BytesIO, state: Pass) -> None:
        super().__init__(file, protocol=5, buffer_callback=state.take_buffer)
        self._state = state

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            reduced = self._state.reduce_array(obj)
            if reduced is not None:
                return reduced
        elif type(obj) is types.FunctionType:
            reduced = self._state.reduce_function(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


def dumps(
    obj: Any,
    options: Options,
    transport: Transport | None = None,
    cache_functions: bool = True,
    task: int | None = None,
    lent: list[tuple[str, int]] | None = None,
    arguments: frozenset[int] = frozenset(),
) -> Packed:
    """Run one pass over ``obj``: forward with a ``transport``, backward without one.

    ``task``: the number of the task this pass sends (see :meth:`Transport.number`), and
    ``arguments`` the ids of the arrays it was given as arguments; ``lent``: backward,
    the segments lent for the result. If the pass fails, every segment it created is
    dropped (and so unlinked).
    """
    state = Pass(options, transport, cache_functions, task, lent, arguments)
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
        state.buffers, state.keep, state._copied, state.copies = [], [], [], []
    if transport is None:
        # Only now that the pass succeeded: the result's copies, and the shared arrays
        # this worker allocated, become the parent's to free.
        for mapping in packed.keep:
            _tracking.hand_off(mapping)
    return packed


# ---------------------------------------------------------------------------------------
# The parent's side of an executor
# ---------------------------------------------------------------------------------------


class Transport:
    """One executor's forward transport: its options and its copies in flight."""

    def __init__(self, options: Options) -> None:
        self.options = options
        # What went where, for statistics(), e.g. {"bytes_copied": 8000000, "tasks": 3}.
        self.counts: Counter[str] = Counter()
        self._lock = threading.RLock()  # re-entrant: a weakref callback may fire while held
        # Numbers tasks in the order they are submitted, and copies in the order they are
        # made: a copy made after a task was submitted is a valid snapshot for it.
        self._numbers = count()
        # Copies alive (held by tasks in flight, or pooled), by the source bytes they hold,
        # e.g. {(140213, 8000000): _Remembered(<weakref to Mapping>, valid_below=17)}.
        self._copies: dict[tuple[int, int], _Remembered] = {}
        # Copies held by tasks in flight: {id(mapping): [mapping, tasks holding it, every
        # worker let go of it so far]}, e.g. {1401: [<Mapping>, 2, True]}.
        self._held: dict[int, list[Any]] = {}
        # Copies no task holds and no worker maps any more: segments whose pages are
        # already faulted in, reused for the next copies (a memcpy into them runs ~10x
        # faster than into fresh shared pages). Oldest first, with the time each came
        # in, e.g. [(<Mapping>, 5012.5)]; bounded in bytes and in age (_trim).
        self._pool: list[tuple[Mapping, float]] = []
        self._pool_limit = _pool_limit()  # once: the size of shared memory does not change
        self._closed = False  # shut down: nothing goes back to the pool any more
        # Its number, by which results find their way back to its pool (see load_result).
        self.token = next(_tokens)
        _transports[self.token] = self
        self._trimmer: threading.Timer | None = None  # trims the pool once idle
        # Sizes of the large buffers each function's last result came back in, by
        # function, e.g. {("app", "render"): [67108864]}: what to lend its next tasks.
        self._result_sizes: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        # Functions pickled once, e.g. {<function f>: b"\x80\x05…"}; None: not cacheable.
        self._functions: weakref.WeakKeyDictionary[Callable[..., Any], bytes | None] = (
            weakref.WeakKeyDictionary()
        )
        self._context: bytes | None = None  # see context()

    def number(self) -> int:
        """The next number: every task numbered below it was submitted before now."""
        return next(self._numbers)

    def context(self) -> bytes:
        """What every call tells its worker about this executor, pickled once: the
        options, the address of the session's sweeper (started if need be), and the
        token by which results find this transport (see ``_worker.load_call``)."""
        if self._context is None:
            about = (self.options, _tracking.sweeper_address(), self.token)
            self._context = pickle.dumps(about, protocol=pickle.HIGHEST_PROTOCOL)
        return self._context

    def plain_call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes | None:
        """The pickle of a call that cannot hold a buffer, made by the standard pickler;
        None if the call must take the pass (:func:`dumps`).

        Every argument is plain (``_worker.is_plain``: atoms, short tuples and lists of
        them) and the function is pickled by name, or by the pickle cached for it: the
        pass would write the very same call, at a third of the cost (it runs Python code
        for every object). Many tiny tasks take this road.
        """
        if type(fn) is not types.FunctionType or not all(map(is_plain, args)):
            return None
        if kwargs and not all(map(is_plain, kwargs.values())):
            return None
        ref: Any = fn
        if _pickled_by_value(fn):
            payload = self.function_payload(fn)
            if payload is None:
                return None
            ref = _FunctionRef(payload)
        return pickle.dumps((ref, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)

    def function_payload(self, fn: types.FunctionType) -> bytes | None:
        """The pickle of ``fn``, made once while ``fn`` lives, or None if it must not be cached.

        cloudpickle pickles a function of ``__main__`` or a notebook by value, at a cost
        that dominates small tasks (and loky pays it per task). A function is cached with
        the globals it had when first sent, as the standard library's workers see the
        module state of their own import; a closure is not cached (its cells may change
        between calls), nor a function whose pickle holds large buffers.
        """
        if fn.__closure__ is not None or not _pickled_by_value(fn):
            return None
        with self._lock:
            if fn in self._functions:
                return self._functions[fn]
        packed = dumps(fn, self.options, self, cache_functions=False)
        payload = None if packed.buffers or packed.keep else packed.payload
        with self._lock:
            self._functions[fn] = payload
        return payload

    def hold(self, copies: Sequence[Mapping]) -> None:
        """A task in flight now refers to these copies."""
        with self._lock:
            for mapping in copies:
                entry = self._held.setdefault(id(mapping), [mapping, 0, True])
                entry[1] += 1

    def let_go(self, copies: Sequence[Mapping], released: frozenset[str]) -> None:
        """A task is done; ``released``: the copies its worker no longer maps.

        A copy that no task holds and every worker released goes to the pool; any other
        is dropped (and unlinked). A worker that kept a view of its argument (in a
        global, in its result) keeps the copy out of the pool: its content must never
        change under that view.
        """
        with self._lock:
            for mapping in copies:
                entry = self._held.get(id(mapping))
                if entry is None:
                    continue
                entry[1] -= 1
                entry[2] = entry[2] and mapping.name in released
                if entry[1] == 0:
                    del self._held[id(mapping)]
                    if entry[2] and not os.path.isabs(mapping.name):
                        self._pool.append((mapping, time.monotonic()))
            self._trim()

    def _trim(self) -> None:
        """Drop (and so unlink) pooled segments idle too long, or beyond the byte limit.

        A timer trims again later while the pool holds anything: an executor left idle
        does not keep its warm segments.
        """
        old = time.monotonic() - _POOL_IDLE_SECONDS
        self._pool = [(m, t) for m, t in self._pool if t >= old]
        while sum(len(m) for m, _ in self._pool) > self._pool_limit:
            self._pool.pop(0)
        if self._pool and self._trimmer is None and not self._closed:
            self._trimmer = threading.Timer(_POOL_IDLE_SECONDS, self._trim_later)
            self._trimmer.daemon = True
            self._trimmer.start()

    def _trim_later(self) -> None:
        with self._lock:
            self._trimmer = None
            self._trim()

    def take_pooled(self, size: int) -> Mapping | None:
        """A pooled segment to hold ``size`` new bytes (at most twice as big), if any."""
        with self._lock:
            self._trim()
            fits = [entry for entry in self._pool if size <= len(entry[0]) <= 2 * size]
            if not fits:
                return None
            entry = min(fits, key=lambda e: len(e[0]))
            self._pool.remove(entry)
            mapping = entry[0]
            # its content changes: it no longer holds the bytes it was remembered for
            source = mapping.source
            found = self._copies.get(source) if source is not None else None
            if source is not None and found is not None and found.ref() is mapping:
                del self._copies[source]
        return mapping

    def close(self) -> None:
        """The executor is shut down: drop the pool; segments coming back are dropped."""
        with self._lock:
            self._closed = True
            self._pool = []
            if self._trimmer is not None:
                self._trimmer.cancel()
                self._trimmer = None

    def lend(self, function: tuple[str, str] | None) -> list[Mapping]:
        """Warm segments for a task of ``function`` to write its large results into.

        Sized after that function's last results; none if the pool has nothing that
        fits. They are the parent's all along (see :func:`load_result`).
        """
        with self._lock:
            sizes = self._result_sizes.get(function) if function is not None else None
        if not sizes:
            return []
        lent = []
        for size in sizes:
            mapping = self.take_pooled(size)
            if mapping is not None:
                mapping.source = None
                lent.append(mapping)
        with _lent_lock:
            for mapping in lent:
                _lent[mapping.name] = mapping
        return lent

    def learn(self, function: tuple[str, str] | None, sizes: list[int]) -> None:
        """``function``'s last result came back in buffers of these sizes."""
        if function is None:
            return
        with self._lock:
            self._result_sizes[function] = sizes
            self._result_sizes.move_to_end(function)
            if len(self._result_sizes) > _FUNCTIONS_REMEMBERED:
                self._result_sizes.popitem(last=False)

    def give_back(self, mapping: Mapping) -> None:
        """A lent segment is free again: unused by its task, or its result collected."""
        with self._lock:
            if not self._closed:
                self._pool.append((mapping, time.monotonic()))
                self._trim()

    def pooled(self) -> list[str]:
        """Names of the segments in the pool."""
        with self._lock:
            return [m.name for m, _ in self._pool]

    def reusable_copy(self, raw: memoryview, low: int, task: int | None) -> Mapping | None:
        """A copy of these very bytes that is a valid snapshot of them for ``task``.

        A copy made after the task was submitted, from the very object whose bytes the
        task sends now (still alive: its memory was never freed and reused), is one as
        it is: the copy took the task's own argument, unsent since its submit, and the
        stdlib would have pickled it later still. Otherwise (a task submitted after the
        copy, a temporary made while pickling, no task: None), the bytes are compared
        first; equal, the copy becomes valid for every task submitted up to the
        comparison.
        """
        with self._lock:
            remembered = self._copies.get((low, raw.nbytes))
        if remembered is None or (mapping := remembered.ref()) is None:
            return None
        owner = _argument_owner(raw)
        trusted = (
            task is not None
            and task < remembered.valid_below
            and owner is not None
            and remembered.owner() is owner
        )
        if not trusted:
            compared = self.number()
            if not _same_bytes(low, mapping.address, raw.nbytes):
                return None
            with self._lock:
                remembered.valid_below = compared
                remembered.owner = _weak(owner)
        with self._lock:  # the same bytes again: out of the pool (if there), as they are
            self._pool = [e for e in self._pool if e[0] is not mapping]
        return mapping

    def remember_copy(self, raw: memoryview, low: int, mapping: Mapping, made: int) -> None:
        """``mapping`` holds the bytes ``raw`` at ``low``, copied after task ``made``."""
        key = mapping.source = (low, raw.nbytes)

        def forget(ref: weakref.ref[Mapping]) -> None:
            with self._lock:
                remembered = self._copies.get(key)
                if remembered is not None and remembered.ref is ref:
                    del self._copies[key]

        owner = _weak(_argument_owner(raw))
        with self._lock:
            self._copies[key] = _Remembered(weakref.ref(mapping, forget), made, owner)


@dataclass
class _Remembered:
    """A copy of some bytes (its key in ``Transport._copies``), valid for tasks numbered
    below ``valid_below``."""

    ref: weakref.ref[Mapping]
    valid_below: int
    owner: Callable[[], object]  # a weak reference to the object whose bytes were taken


def _argument_owner(raw: memoryview) -> object:
    """The array owning the memory under ``raw`` (the root of its bases), if ``raw`` spans
    an array the task was given as an argument; else None.

    Only then can a copy be trusted without comparing: a buffer made while pickling (a
    temporary, or one rewritten by some ``__reduce__``) may hold other bytes at the same
    address for every task.
    """
    span = getattr(raw.obj, "base", None)
    if not isinstance(span, _Span) or not span.argument:
        return None
    owner = span.owner
    while isinstance(owner, np.ndarray) and owner.base is not None:
        owner = owner.base
    return owner


def _weak(owner: object) -> Callable[[], object]:
    """A weak reference to ``owner``, or one that is always dead if it cannot have one."""
    try:
        return weakref.ref(owner)
    except TypeError:  # bytes, memoryview…: never trusted, always compared
        return _dead


def _dead() -> None:
    return None


def _pickled_by_value(fn: types.FunctionType) -> bool:
    """Whether cloudpickle pickles ``fn`` by value: not reachable by name in its module,
    or of a module (or package) registered with ``cloudpickle.register_pickle_by_value``.
    """
    module = sys.modules.get(fn.__module__)
    if module is None or fn.__module__ == "__main__":
        return True
    registered = cloudpickle.list_registry_pickle_by_value()
    if registered:
        name = fn.__module__
        while name:
            if name in registered:
                return True
            name = name.rpartition(".")[0]
    found: Any = module
    for part in fn.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is not fn


class _FunctionRef:
    """A function in a plain pickle, by the pickle cached for it (see ``plain_call``)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __reduce__(self) -> Any:
        return load_function, (self.payload,)


class Task:
    """A call on its way to a worker.

    Loky pickles it when the call leaves its queue (as the stdlib does): only then are
    its large arguments copied, so memory is bounded by the tasks in flight.
    """

    # Slots, and tuples for empty lists: every object a task allocates is one more for
    # the garbage collector to walk while thousands of tiny tasks are pending.
    __slots__ = (
        "args",
        "copies",
        "fn",
        "function",
        "keep",
        "kwargs",
        "lent",
        "number",
        "sent",
        "transport",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        transport: Transport,
    ) -> None:
        # The call, until the task is done; None for no keywords (one dict less per task).
        self.fn: Callable[..., Any] | None = fn
        self.args: tuple[Any, ...] | None = args
        self.kwargs: dict[str, Any] | None = kwargs or None
        self.transport = transport
        self.number = transport.number()  # its place in submission order
        self.sent = False
        self.keep: Sequence[Mapping] = ()
        self.copies: Sequence[Mapping] = ()
        self.function: tuple[str, str] | None = None  # whose last results size what is lent
        self.lent: Sequence[Mapping] = ()  # warm segments lent for the result

    def __reduce__(self) -> Any:
        fn, args, kwargs = self.fn, self.args, self.kwargs or {}
        if fn is None or args is None:
            raise RuntimeError("this task was already completed")
        if self.sent:  # sent again (an initializer, for a new worker): as if submitted now
            self.number = self.transport.number()
        self.sent = True
        payload = self.transport.plain_call(fn, args, kwargs)
        buffers: list[BufferRef] = []
        if payload is None:
            payload, buffers = self._pass((fn, args, kwargs))
        self._take_back_lent()
        self.function = _function_key(fn)
        self.lent = self.transport.lend(self.function)
        lent = [(m.name, len(m)) for m in self.lent]
        return load_call, (payload, buffers, lent, self.transport.context())

    def _pass(self, call: tuple[Any, Any, Any]) -> tuple[bytes, list[BufferRef]]:
        """Reduce the call by the pass: its large buffers copied (or reused), held."""
        _, args, kwargs = call
        given = frozenset(id(x) for x in (*args, *kwargs.values()) if isinstance(x, np.ndarray))
        options = self.transport.options
        packed = dumps(call, options, self.transport, task=self.number, arguments=given)
        if self.copies:  # a previous reduction's
            self.transport.let_go(self.copies, frozenset())
        self.keep, self.copies = packed.keep, packed.copies  # until release()
        if self.copies:
            self.transport.hold(self.copies)
        return packed.payload, packed.buffers

    def release(self, delivered: Delivered | None = None) -> None:
        """Drop the call and its segments, as early as the task is done.

        ``delivered``: its result, if it came back (see :class:`Delivered`).
        """
        self.fn = self.args = self.kwargs = None
        if self.copies:
            self.transport.let_go(self.copies, delivered.released if delivered else frozenset())
        self.keep, self.copies = (), ()
        self._take_back_lent()
        if delivered is not None:
            self.transport.learn(self.function, delivered.sizes)

    def _take_back_lent(self) -> None:
        """Segments lent to this task that its result did not come back in are free."""
        for mapping in self.lent:
            with _lent_lock:
                unused = _lent.pop(mapping.name, None) is not None
            if unused:
                self.transport.give_back(mapping)
        self.lent = ()


def _function_key(fn: Callable[..., Any]) -> tuple[str, str] | None:
    """A function's name, by which its tasks are lent segments for their results."""
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        return None  # a partial, a callable object: no guess
    return module, qualname


# Segments lent to tasks in flight, not yet back in a result, by name,
# e.g. {"sharexec-41-Zm9v": <Mapping>}.
_lent: dict[str, Mapping] = {}
_lent_lock = threading.Lock()
# The transports of this process by number, e.g. {3: <Transport>}: where a result's
# segments go once the result is collected.
_tokens = count(1)
_transports: weakref.WeakValueDictionary[int, Transport] = weakref.WeakValueDictionary()


def _hold(mapping: Mapping, token: int) -> Any:
    """The buffer a result is rebuilt over: its segment goes to the pool of transport
    ``token`` once the result (every view of it) is collected, or is dropped (and so
    unlinked) if that transport is gone."""
    holder = np.frombuffer(mapping, np.uint8)
    weakref.finalize(holder, _give_back, token, mapping)
    return holder


def _give_back(token: int, mapping: Mapping) -> None:
    transport = _transports.get(token)
    if transport is not None:
        transport.give_back(mapping)


def receive(name: str, size: int, token: int) -> Any:
    """In the parent: the buffer a result's segment is rebuilt over.

    A lent segment is mapped here already; a fresh one is adopted; both go to the pool
    of transport ``token`` once the result is collected. A file (spilled) is mapped and
    unlinked at once: never pooled.
    """
    with _lent_lock:
        mapping = _lent.pop(name, None)
    if mapping is not None:
        return _hold(mapping, token)
    if os.path.isabs(name):
        return _tracking.adopt_private(name, size)
    return _hold(_tracking.adopt(name, size), token)


def is_lent(name: str) -> bool:
    """Whether ``name`` is lent to a task in flight (and so returns to a pool)."""
    with _lent_lock:
        return name in _lent
