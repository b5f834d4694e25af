"""The parent's side of an executor's transport: calls on their way out, results back in.

A submitted call becomes a :class:`Task`. Loky pickles it when it leaves the call queue
(as the stdlib does), and only then does :meth:`Task.__reduce__` encode it: by the
standard pickler if every argument is a plain value (``Transport.plain_call``), else by
the pass of :mod:`sharexec._reduction` with a ``ForwardSink``. The task holds the
segments its payload refers to until its future is done (:meth:`Task.release`).

:class:`Transport` is the executor's facade over the parts that each own their state (all
but the first in :mod:`sharexec._copies`):

* :class:`Functions`: functions pickled once per executor;
* ``CopyCache``: which copy holds which bytes, for which tasks it is a valid
  snapshot, and which tasks in flight hold each copy;
* a :class:`~sharexec._warm.SegmentPool`: warm segments (pages already faulted in) no
  task holds, reused for the next copies and lent for results, bounded in bytes, in
  count and in age;
* ``ResultLoans``: warm segments lent to tasks for their results, sized after the
  function's last results, and the receiver (``_wire.Receiver``) of every result: a
  result's segment goes to the pool once the result is collected;
* ``Counts``: what went where, for ``statistics()``.

The forward pass puts a call's large buffers where ``_reduction.ForwardSink`` says
(reused, or copied into the pool's warm segments), which reaches this facade through
``_reduction.Outbound``; a function's pickle and buffers go where :class:`_FunctionSink`
says (fresh segments of their own).

Locks: ``CopyCache._exchange`` serializes what moves a segment between the copy cache and
the pool (a copy reused out of the pool, a pooled segment taken for new bytes); it is
taken before either's own lock, and no part calls back into the facade. The locks that
a weakref callback takes (a collected result giving its segment back, a collected copy
leaving the cache) are re-entrant, since the callback may fire while one is held: the
pool's, ``CopyCache``'s, ``Functions``' (a collected function leaving the table).
``ResultLoans``' is too; ``Counts``' is taken by no callback.
"""

from __future__ import annotations

import pickle
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from itertools import count
from typing import TypeAlias

import cloudpickle
import numpy as np

from . import _passing, _segments, _session, _wire
from ._arrays import recycling
from ._config import Options
from ._copies import CopyCache, Counts, ResultLoans
from ._loky import AlreadyDone
from ._reduction import ForwardSink, Reduced, Sink, dumps
from ._segments import Mapping
from ._warm import SegmentPool, pool_limit, pooled_everywhere
from ._wire import BufferRef, Delivered, is_plain, load_function
from ._worker import CallContext, load_batch, load_call

__all__ = ["FunctionKey", "PlainEntry", "Task", "Transport", "pooled_everywhere"]

# What a function's run times are kept under (``_batching``): its module, qualified name
# and first line, e.g. ("app", "inc", 47); a partial's nests its function's.
FunctionKey: TypeAlias = tuple[object, ...]
# A call of plain arguments in a batch's one pickle (``Transport.reduce_batch``): its
# function's place in the batch's functions, its arguments and keywords (None: none).
PlainEntry: TypeAlias = tuple[int, tuple[object, ...], dict[str, object] | None]


# ---------------------------------------------------------------------------------------
# A call on its way out
# ---------------------------------------------------------------------------------------


class Task:
    """A call on its way to a worker.

    Loky pickles it when the call leaves its queue (as the stdlib does): only then are
    its large arguments copied, so memory is bounded by the tasks in flight.
    """

    # Slots, and tuples for empty lists: every object a task allocates is one more for
    # the garbage collector to walk while thousands of tiny tasks are pending.
    __slots__ = (
        "again",
        "args",
        "copies",
        "fn",
        "function",
        "keep",
        "key",
        "kwargs",
        "lent",
        "number",
        "sent",
        "transport",
    )

    def __init__(
        self,
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object] | None,
        transport: Transport,
    ) -> None:
        # The call, until the task is done; None for no keywords (one dict less per task).
        self.fn: Callable[..., object] | None = fn
        self.args: tuple[object, ...] | None = args
        self.kwargs: dict[str, object] | None = kwargs or None
        self.transport = transport
        self.number = transport.number()  # its place in submission order
        self.sent = False
        self.again = False  # handed back unstarted: its next send is the same transfer
        self.keep: Sequence[Mapping] = ()  # the mappings its payload refers to
        self.copies: Sequence[Mapping] = ()  # those of them that are argument copies
        self.function: tuple[str, str] | None = None  # whose last results size what is lent
        self.lent: Sequence[Mapping] = ()  # warm segments lent for the result
        self.key: FunctionKey | None = None  # whose run times it counts in (_batching)

    def __reduce__(self) -> Reduced:
        fn, args, kwargs = self.fn, self.args, self.kwargs or {}
        if fn is None or args is None:
            raise AlreadyDone("this task was already completed")
        transport = self.transport
        again, self.again = self.again, False
        if self.sent and not again:  # sent again (an initializer, for a new worker):
            self.number = transport.number()  # as if submitted now
        self.sent = True
        payload = transport.plain_call(fn, args, kwargs)
        buffers: list[BufferRef] = []
        keep: Sequence[Mapping] | None = None  # the pass's, if the call took it
        copies: Sequence[Mapping] = ()
        if payload is None:
            # Handed back by a worker that did not start it (see _batching): its copies
            # are still valid snapshots for it, and sending them again is not counted.
            given = frozenset(
                id(x) for x in (*args, *kwargs.values()) if isinstance(x, np.ndarray)
            )
            sink = ForwardSink(transport, self.number, counted=not again)
            packed = dumps((fn, args, kwargs), sink, given)
            payload, buffers, keep, copies = (
                packed.payload,
                packed.buffers,
                packed.keep,
                packed.copies,
            )
            if keep:  # its shared arrays serve no allocation again before release()
                recycling.sent(keep)
            if copies:
                transport.copies.hold(copies)
        function = _function_key(fn)
        lent: Sequence[Mapping] = transport.lend(function)
        names = [(m.name, len(m)) for m in lent]
        if keep is None and not lent and not self.lent:  # nothing made, nothing to give back
            self.function = function
            return load_call, (payload, buffers, names, transport.context())
        # The task may be done meanwhile (a dead worker broke the pool while this thread
        # pickled it): then what was made for it now goes at once, not with the task.
        with transport.handover:
            done = self.fn is None
            if not done:
                self.function = function
                lent, self.lent = self.lent, lent  # the previous send's loans
                if keep is not None:
                    keep, self.keep = self.keep, keep  # the previous send's
                    copies, self.copies = self.copies, copies
        _let_go(transport, keep or (), copies, lent)
        if done:
            raise AlreadyDone("this task was completed while it was being sent")
        return load_call, (payload, buffers, names, transport.context())

    def release(self, delivered: Delivered | None = None) -> None:
        """Drop the call and its segments, as early as the task is done.

        ``delivered``: its result, if it came back (see :class:`~sharexec._wire.Delivered`).
        """
        self.fn = self.args = self.kwargs = None  # first: a send under way sees it
        transport = self.transport
        if self.sent:  # else nothing is stored, nor will be (a send began with `sent`)
            with transport.handover:
                keep, copies, lent = self.keep, self.copies, self.lent
                self.keep, self.copies, self.lent = (), (), ()
            released = delivered.released if delivered else frozenset()
            _let_go(transport, keep, copies, lent, released)
        if delivered is not None:
            transport.loans.learn(self.function, delivered.sizes)


def _let_go(
    transport: Transport,
    keep: Sequence[Mapping],
    copies: Sequence[Mapping],
    lent: Sequence[Mapping],
    released: frozenset[str] = frozenset(),
) -> None:
    """A task let go of these: the shared arrays among them may serve again once
    collected, the copies may be pooled (``released``: those its worker no longer maps),
    the loans its result did not come back in are free again."""
    if keep:
        recycling.done(keep, released)
    if copies:
        transport.copies.let_go(copies, released)
    transport.loans.take_back(lent)


def _function_key(fn: Callable[..., object]) -> tuple[str, str] | None:
    """A function's name, by which its tasks are lent segments for their results."""
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        return None  # a partial, a callable object: no guess
    return module, qualname


# ---------------------------------------------------------------------------------------
# The facade
# ---------------------------------------------------------------------------------------

# Numbers the transports of this process: results find their receiver by it.
_tokens = count(1)


class Transport:
    """One executor's transport: its options, and the parts that own its state."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.counts = Counts()
        # Numbers tasks in the order they are submitted, and copies in the order they are
        # made: a copy made after a task was submitted is a valid snapshot for it.
        self._numbers = count()
        # Hands a task's segments between the thread sending it and the one releasing it.
        self.handover = threading.Lock()
        self.functions = Functions(self)
        self.pool = SegmentPool(pool_limit())
        self.copies = CopyCache(self.number, self.pool)
        self.loans = ResultLoans(self.pool)
        self.token = next(_tokens)  # by which results find self.loans (_wire.load_result)
        _wire.register(self.token, self.loans)
        if _segments.anonymous_supported():  # before any worker starts: its initializer
            _passing.listen()  # may make anonymous segments, passed back with its results
        self._context: bytes | None = None  # see context()
        self._context_sweeper: tuple[bytes, int] | None = None  # the sweeper it names

    def number(self) -> int:
        """The next number: every task numbered below it was submitted before now."""
        return next(self._numbers)

    def context(self) -> bytes:
        """What every call tells its worker about this executor, pickled once (and again
        when the root started a new sweeper): the options, the address of the session's
        sweeper (started if need be) and its generation, and the token by which results
        find this transport (see ``_worker.load_call``)."""
        sweeper = _session.sweeper_address()
        if self._context is None or sweeper != self._context_sweeper:
            about = CallContext(self.options, sweeper, self.token)
            self._context = pickle.dumps(about, protocol=pickle.HIGHEST_PROTOCOL)
            self._context_sweeper = sweeper
        return self._context

    def plain_call(
        self, fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> bytes | None:
        """The pickle of a call that cannot hold a buffer, made by the standard pickler;
        None if the call must take the pass.

        Every argument is plain (``_wire.is_plain``: atoms, short tuples and lists of
        them) and the function is pickled by name, or by the pickle cached for it: the
        pass would write the very same call, at a third of the cost (it runs Python code
        for every object). Many tiny tasks take this road.
        """
        if type(fn) is not types.FunctionType or not all(map(is_plain, args)):
            return None
        if kwargs and not all(map(is_plain, kwargs.values())):
            return None
        ref = self.functions.plain_ref(fn)
        if ref is None:
            return None
        return pickle.dumps((ref, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)

    def reduce_batch(self, ids: list[int], tasks: list[Task]) -> Reduced:
        """How several calls travel in one message (``_loky.CallBatch``): a call of plain
        arguments as ``(function index, args, kwargs)`` in the batch's one pickle, its
        function once per batch (as ``plain_call`` would pickle it); any other call as
        its :class:`Task`, reduced as when it goes alone (copies, loans, the pass)."""
        functions: list[types.FunctionType | _FunctionRef] = []
        index: dict[int, int] = {}  # by id(fn): its place in functions, or -1: not plain
        entries: list[PlainEntry | Task] = []
        for task in tasks:
            fn, args, kwargs = task.fn, task.args, task.kwargs
            if fn is None or args is None:
                raise AlreadyDone("this task was already completed")
            at = index.get(id(fn))
            if at is None:
                ref = self.functions.plain_ref(fn) if type(fn) is types.FunctionType else None
                at = index[id(fn)] = -1 if ref is None else len(functions)
                if ref is not None:
                    functions.append(ref)
            plain = (
                at >= 0
                and (is_plain(args) or all(map(is_plain, args)))  # atoms: one look
                and (not kwargs or all(map(is_plain, kwargs.values())))
            )
            entries.append((at, args, kwargs) if plain else task)
        blob = pickle.dumps(functions, protocol=pickle.HIGHEST_PROTOCOL)
        return load_batch, (ids, self.context(), blob, entries)

    def lend(self, function: tuple[str, str] | None) -> list[Mapping]:
        """Warm segments for a task of ``function`` to write its large results into."""
        return self.loans.lend(function, self.copies.take_warm)

    def pooled(self) -> list[str]:
        """Names of the segments in the pool."""
        return self.pool.names()

    def close(self) -> None:
        """The executor is shut down: drop the pool; segments coming back are dropped."""
        self.pool.close()

    def done(self) -> None:
        """The executor is shut down and no call is pending: drop its functions' segments."""
        self.functions.clear()


# ---------------------------------------------------------------------------------------
# Functions pickled once
# ---------------------------------------------------------------------------------------


class _FunctionRef:
    """A function sent by value, by the pickle cached for it (see :class:`Functions`):
    the pickle itself, or where it lies in segments of the executor's, made once.

    ``payload``: the pickle (bytes), or ``(pickle, *buffers)`` as ``BufferRef`` s: the
    pickle in a segment of its own, then the out-of-band buffers it refers to (the large
    arrays among its globals), each copied once. ``keep``: those segments' mappings,
    which keep them linked while the function is cached.
    """

    __slots__ = ("keep", "payload")

    def __init__(
        self, payload: bytes | tuple[BufferRef, ...], keep: Sequence[Mapping] = ()
    ) -> None:
        self.payload = payload
        self.keep = keep

    def __reduce__(self) -> Reduced:
        return load_function, (self.payload,)


# A function whose pickle is this long or longer goes by the segments it was copied
# into, once, rather than as bytes in every call: 110 KB of a script's globals sent with
# each call cost 0.9 ms a call (on 2 busy cores), against 0.2 ms at 10 KB.
_FUNCTION_SEGMENT_BYTES = 32 << 10


class Functions:
    """The functions an executor sent, and how each travels.

    cloudpickle pickles a function of ``__main__`` or a notebook by value, at a cost
    that dominates small tasks (and loky pays it per task): such a function is pickled
    once per executor, with the globals it had when first sent; a worker rebuilds it
    once, in its one namespace of the function's module, adding only the globals that
    namespace lacks (``_wire.share_globals``), as the standard library's workers keep
    the module state of their own import. A short pickle travels with each call (the
    worker knows it by its bytes); a long one (large globals: a list of a million
    floats, an array) is copied once into segments the executor keeps while the
    function lives (:class:`_FunctionRef`), and each call names them: a worker maps
    them and rebuilds the function at its first call only. A closure is not cached (its
    cells may change between calls), nor a function whose globals hold shared arrays or
    tensors (they travel by reference, with each call). Whether a function goes by name
    is cloudpickle's own decision, asked once per function: its pickle is the standard
    pickler's reference.
    """

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        # Re-entrant: the collector may free a function (and run its weak reference's
        # callback, which takes this lock) in a thread holding it, at any allocation.
        self._lock = threading.RLock()
        # Whether each function pickles by name, by the function's id, with a weak
        # reference to it, e.g. {140213: (<weakref to total>, True)}: looked up per call,
        # with no weak reference made for the look-up (as a WeakKeyDictionary would).
        # Valid while cloudpickle's by-value registry is _registry.
        self._by_name: dict[int, tuple[weakref.ref[types.FunctionType], bool]] = {}
        self._registry: set[str] = set()
        # How each function sent by value travels, e.g. {<function square>:
        # <_FunctionRef b"\x80\x05…">}; None: not cacheable (shared arrays in its globals).
        self._payloads: weakref.WeakKeyDictionary[types.FunctionType, _FunctionRef | None] = (
            weakref.WeakKeyDictionary()
        )

    def plain_ref(self, fn: types.FunctionType) -> types.FunctionType | _FunctionRef | None:
        """What stands for ``fn`` in a plain pickle: ``fn`` itself (by name), its cached
        pickle, or None if it must go through the pass."""
        if self.by_name(fn):
            return fn
        return self.payload(fn)

    def by_name(self, fn: types.FunctionType) -> bool:
        """Whether cloudpickle pickles ``fn`` by reference to its module and name."""
        registry = cloudpickle.list_registry_pickle_by_value()  # a copy, of a few names
        if registry != self._registry:  # a module was (un)registered: ask again
            with self._lock:
                self._by_name.clear()
                self._registry = registry
        known = self._by_name.get(id(fn))
        if known is not None and known[0]() is fn:
            return known[1]
        by_name = fn.__module__ != "__main__"  # always by value, cloudpickle documents
        if by_name:
            try:
                reference = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # not reachable by its name: by value
                by_name = False
            else:
                by_name = cloudpickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL) == reference
        key = id(fn)

        def forget(ref: weakref.ref[types.FunctionType]) -> None:
            with self._lock:
                if self._by_name.get(key, (None,))[0] is ref:
                    del self._by_name[key]

        with self._lock:
            self._by_name[key] = (weakref.ref(fn, forget), by_name)
        return by_name

    def payload(self, fn: types.FunctionType) -> _FunctionRef | None:
        """How ``fn`` travels by value, decided once while ``fn`` lives; None if it goes
        by name or must not be cached."""
        if fn.__closure__ is not None or self.by_name(fn):
            return None
        with self._lock:
            if fn in self._payloads:
                return self._payloads[fn]
        ref = self._pickle(fn)
        with self._lock:
            if fn in self._payloads:  # another thread was first: its segments may be in use
                return self._payloads[fn]
            self._payloads[fn] = ref
        return ref

    def _pickle(self, fn: types.FunctionType) -> _FunctionRef | None:
        """Pickle ``fn`` by value, its large buffers and a long pickle copied into
        segments of their own (not the copy cache's: no call may reuse or pool them)."""
        sink = _FunctionSink(self._transport)
        packed = dumps(fn, sink)
        if len(packed.keep) != len(packed.copies):  # a shared array, a tensor: by reference
            return None
        if not packed.buffers and len(packed.payload) < _FUNCTION_SEGMENT_BYTES:
            return _FunctionRef(packed.payload)
        data = memoryview(packed.payload)
        mapping = sink.place(data, 0)
        if mapping is None:  # no segment to be had: the pickle travels with each call
            return None if packed.buffers else _FunctionRef(packed.payload)
        pickled: BufferRef = (mapping.name, len(mapping), 0, len(data))
        return _FunctionRef((pickled, *packed.buffers), (mapping, *packed.keep))

    def clear(self) -> None:
        """Forget every function (and drop the segments of those sent by them): the
        executor is shut down and no call is pending."""
        with self._lock:
            dropped = list(self._payloads.values())
            self._payloads.clear()
        del dropped  # their segments are unlinked now, outside the lock


class _FunctionSink(ForwardSink):
    """Where a function's pickle and its large buffers go (:meth:`Functions.payload`):
    fresh copies, counted, that no call reuses and that never join the pool (the
    function's entry holds them, and workers that start later map them)."""

    def __init__(self, transport: Transport) -> None:
        super().__init__(transport, cache_functions=False)

    def place(self, raw: memoryview, low: int) -> Mapping | None:
        return Sink.place(self, raw, low)
