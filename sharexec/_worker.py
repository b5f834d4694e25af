"""What runs in a worker: its start, and each task's way through it.

* Start: :func:`run_initializer`: the worker dies with its parent, then the user's
  initializer runs (in the namespace the calls' functions share, even when forked).
* A task: loky unpickles :func:`run` and a ``_transport.Task``, which rebuilds as
  :func:`load_call`: the call's copies mapped copy-on-write and its shared arrays shared,
  both through this worker's kept mappings (:data:`sharexec._kept.kept`, reused by
  later tasks of the same segments). :func:`run` calls the function and packs the
  result: a plain value as it is, anything else in a ``_wire.Reply``, through the
  backward pass
  (:mod:`sharexec._reduction` with its ``BackwardSink``) when it may hold an array.
* A batch (several queued calls in one message, see :mod:`sharexec._batching`): it
  rebuilds as :func:`load_batch`, and :func:`run_batch` runs its calls in order, each
  with its own outcome and run time; a thread of the worker (:class:`_Streamer`) hands
  back the calls not started once the batch has kept them too long.
* ``map(chunksize=n)``: :func:`run_chunk` runs a chunk's calls in order.

A worker imports nothing heavy: no NumPy until a task carries or returns an array. A call
that holds an array imports :mod:`sharexec._arrays` (and so NumPy) when it is unpickled;
a result goes through the backward pass only if it may hold an array or a large
out-of-band buffer (see :func:`run`). Nothing here imports NumPy, :mod:`sharexec._arrays`
or :mod:`sharexec._reduction` at import time.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import sys
import threading
import time
import typing
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeVar, cast

from . import _kept, _loky, _session, _tracking
from ._config import Options
from ._wire import BufferRef, Pickler, Raised, Reply, is_plain, loads

if TYPE_CHECKING:
    import numpy as np

T = TypeVar("T")

__all__ = [
    "Call",
    "CallContext",
    "LoadedBatch",
    "LoadedCall",
    "PlainCall",
    "load_batch",
    "load_call",
    "run",
    "run_batch",
    "run_chunk",
    "run_initializer",
]


# ---------------------------------------------------------------------------------------
# What a call is made of, in the worker
# ---------------------------------------------------------------------------------------

# A call as the parent pickles it, by the pass or by the standard pickler (the function,
# its arguments, its keywords), e.g. (<function square>, (3,), {}).
Call = tuple[Callable[..., object], tuple[object, ...], dict[str, object]]

# A call of plain arguments in a batch (``Transport.reduce_batch``): its function's index
# in the batch's functions, its arguments, its keywords or None, e.g. (0, (3,), None). A
# plain tuple on the wire, not a named one: a list of NamedTuples pickles 8 to 15 times
# slower (1 to 64 entries), where a batch's calls take a few µs each.
PlainCall = tuple[int, tuple[object, ...], dict[str, object] | None]

# A call's holders of the segments it maps (see _kept.KeptMappings), by segment name, held
# weakly: once a holder is collected, no view of the call lies on that segment any more.
Holders = list[tuple[str, "weakref.ref[np.ndarray]"]]


class CallContext(NamedTuple):
    """What an executor tells each of its calls, pickled once (``Transport.context``)."""

    options: Options
    sweeper: tuple[bytes, int]  # the session's sweeper: its address, its generation
    token: int  # by which the call's result finds the executor (``_wire.register``)


@dataclass(slots=True)
class LoadedCall:
    """A call rebuilt in the worker (:func:`load_call`), until :func:`run` has run it.

    loky's call item holds it while the call runs: :meth:`take` drops the function and
    its arguments from it, so that their copy-on-write pages go as early as possible.
    """

    call: Call | None
    context: CallContext
    copies: Holders  # the holders of its argument copies
    lent: list[tuple[str, int]]  # the warm segments the parent lent for the result
    shared: Holders  # the holders of its shared arrays' segments

    def take(self) -> Call:
        """The function, its arguments and keywords, given once."""
        call, self.call = self.call, None
        assert call is not None
        return call


@dataclass(slots=True)
class LoadedBatch:
    """A batch rebuilt in the worker (:func:`load_batch`): its calls, each a
    :data:`PlainCall` or a :class:`LoadedCall`, in the order of their work ids."""

    ids: list[int]
    context: CallContext
    functions: list[Callable[..., object]] | BaseException  # what PlainCall indexes
    entries: list[PlainCall | LoadedCall | _Unloadable | None]  # None: ran


class _InitTask(Protocol):
    """The initializer's ``_transport.Task``, as a forked worker inherits it."""

    @property
    def fn(self) -> Callable[..., object] | None: ...
    @property
    def args(self) -> tuple[object, ...] | None: ...
    @property
    def kwargs(self) -> dict[str, object] | None: ...


def run_initializer(
    parent_pid: int,
    call: _InitTask | LoadedCall | _Unloadable | None,
    sweeper: _session.SweeperAddress,
    forked: list[bytes],
) -> None:
    """Set up a new worker: it dies with its parent, and what it creates is the session's
    sweeper's to sweep; then the user's initializer, if any.

    ``call`` is None, the initializer's ``_transport.Task`` itself (fork: inherited, not
    pickled), or what that task's reduction rebuilt: a :class:`LoadedCall`, or an
    :class:`_Unloadable` whose error is raised here (loky's worker logs it).
    ``forked``: under fork, the initializer's function as the parent pickled it before the
    first worker forked, if it could (``_wire.dumps_sharing_globals``). Inherited as it
    is, it would run in the worker's copy of its module, and the calls' functions in
    the namespace they share; unpickled, it runs there too.
    """
    _session.watch_parent(parent_pid)
    sweeper.join()
    _loky.count_private_memory_only()
    # What this worker starts with (a fork's copy of its server's or its parent's heap,
    # or what a spawned worker imported) stays for its life: out of the collector's
    # walks. loky's worker collects after its first task (and, without psutil, every
    # second): over the inherited heap that took 40 ms with NumPy alone and wrote to
    # every page holding an object, copying it. As the gc module's documentation
    # advises for a fork without exec; O(1), it moves lists, touches no object.
    gc.freeze()
    if call is None:
        return
    if isinstance(call, _Unloadable):
        _raise_unloadable(call)
    if isinstance(call, LoadedCall):
        fn, args, kwargs = call.take()
    else:
        inherited, args_or_none, kwargs = call.fn, call.args, call.kwargs or {}
        assert inherited is not None and args_or_none is not None
        fn = pickle.loads(forked[0]) if forked else inherited
        args = args_or_none
    fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# A call, in the worker
# ---------------------------------------------------------------------------------------


def load_call(
    payload: bytes,
    buffers: list[BufferRef],
    lent: list[tuple[str, int]],
    context: bytes,
) -> LoadedCall | _Unloadable:
    """Rebuild a call in the worker: copies mapped copy-on-write, shared arrays shared.

    ``lent``: the warm segments the parent lent for the result, (name, size);
    ``context``: what the executor tells each call, pickled once (a :class:`CallContext`).
    """
    about = _context(context)
    # Segments this worker creates are the root's sweeper's to sweep: a new one if the
    # root started one again.
    _session.join_sweeper(*about.sweeper)
    holders: dict[str, np.ndarray] = {}
    shared_holders: dict[str, np.ndarray] = {}  # the holders of this call's shared views
    _kept.kept.drop_unlinked()
    try:
        with _tracking.attached_shared(shared_holders) as shared:
            call = cast(Call, loads(payload, buffers, _kept.kept.hold_copy, holders))
    except Exception as exc:
        # This runs while loky unpickles the call item, where an exception breaks the
        # whole pool (as the standard library's does: its worker dies). The call item
        # unpickles instead, and run() sends the error back: only this call's future
        # fails, with the worker's traceback of the failure.
        return _Unloadable(exc)
    if shared:
        _kept.kept.keep_shared(shared)
    # Its shared arrays are reported released too, once no view of this call holds
    # them: the parent may then serve their segments again (_arrays.Recycling).
    return LoadedCall(
        call,
        about,
        [(n, weakref.ref(h)) for n, h in holders.items()],
        lent,
        [(n, weakref.ref(h)) for n, h in shared_holders.items()],
    )


class _Unloadable:
    """A call whose arguments failed to rebuild here (an array subclass whose
    ``__array_finalize__`` raises, a class missing in the worker): :func:`run` raises
    ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error: Exception | None = error


def _raise_unloadable(call: _Unloadable) -> typing.NoReturn:
    """Raise the error of a call that failed to rebuild, once."""
    error, call.error = call.error, None  # loky's call item holds the call meanwhile
    assert error is not None
    raise error  # with its traceback from load_call


# The contexts of the calls this worker received, by their pickle (one per executor, and
# per sweeper it started).
_contexts: dict[bytes, CallContext] = {}


def _context(blob: bytes) -> CallContext:
    """An executor's context, from its pickle."""
    found = _contexts.get(blob)
    if found is None:
        if len(_contexts) >= 8:
            _contexts.clear()
        found = _contexts[blob] = pickle.loads(blob)
    return found


def run(call: LoadedCall | _Unloadable) -> object:
    """Run a call in the worker and pack its result for the way back (:func:`_pack`).

    Whatever the call raises, here or while its result is packed, is sent back as its
    result, a ``_wire.Raised``, which the parent rebuilds on its own and its future
    raises: an exception that cannot be pickled or rebuilt fails that future only,
    never the worker, the pool or the other calls of a batch. How long the function ran
    is noted for the parent (``_loky.note_run_seconds``), which batches calls of
    functions measured short (``_batching``).
    """
    try:
        return _run(call)
    except BaseException as exc:  # as loky's worker sends any: SystemExit too
        return Raised(exc)


def _run(call: LoadedCall | _Unloadable) -> object:
    if type(call) is _Unloadable:
        _raise_unloadable(call)
    assert type(call) is LoadedCall
    fn, args, kwargs = call.take()
    start = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    finally:
        _loky.note_run_seconds(time.perf_counter() - start)
    del fn, args, kwargs  # copy-on-write pages of the arguments go as early as possible
    return _pack(result, call.context, call.copies, call.lent, call.shared)


def _pack(
    result: object,
    context: CallContext,
    mapped: Holders,
    lent: list[tuple[str, int]],
    shared: Holders,
) -> object:
    """A call's result, for the way back; the cheapest road that is still exact:

    * a plain value (``None``, a number, a string, bytes; or a short tuple or list of
      them) holds no buffer: it is returned as it is for loky to pickle, if the call
      had no argument copies to report released (many tiny tasks), else in a
      :class:`~sharexec._wire.Reply` pickled by plain pickle;
    * while NumPy is not loaded in this worker, no array can exist: cloudpickle with
      every buffer in band, unless one is large enough to share;
    * anything else: the backward pass of :mod:`sharexec._reduction` (which imports
      NumPy), where large buffers go to segments handed to the parent.
    """
    # The argument copies no view of this task holds any more: the parent may reuse them
    # (kept mappings show whatever the parent writes there, see _kept.KeptMappings).
    released = [name for name, ref in mapped if ref() is None]
    if mapped:
        _kept.kept.after_task(released)
    if shared:
        released += [name for name, ref in shared if ref() is None]
    options, _, token = context
    lost = _session.sweeper_lost()  # the root restarts the sweeper if it is gone
    if is_plain(result):
        if not mapped and not shared and not lost:  # nothing to tell but the value
            return result
        return Reply(pickle.dumps(result, protocol=5), [], released, token, lost=lost)
    if "numpy" not in sys.modules:
        payload = _dumps_in_band(result, options)
        if payload is not None:
            return Reply(payload, [], released, token, lost=_session.sweeper_lost())
    from ._reduction import BackwardSink, dumps  # NumPy is needed (or loaded already)

    packed = dumps(result, BackwardSink(options, lent, _kept.kept.attach_lent, token))
    lost = _session.sweeper_lost()  # the pass may have created segments
    return Reply(packed.payload, packed.buffers, released, token, packed.keep, lost)


# ---------------------------------------------------------------------------------------
# Several calls in one message
# ---------------------------------------------------------------------------------------


def load_batch(
    ids: list[int],
    context: bytes,
    functions: bytes,
    entries: list[PlainCall | LoadedCall | _Unloadable | None],
) -> LoadedBatch:
    """Rebuild a batch of calls in the worker (``Transport.reduce_batch``): ``entries``
    are a :data:`PlainCall` for each call of plain arguments, whose functions are pickled
    once in ``functions``, and what :func:`load_call` rebuilt for the others.
    """
    about = _context(context)
    _session.join_sweeper(*about.sweeper)
    loaded: list[Callable[..., object]] | BaseException
    try:
        loaded = pickle.loads(functions)
    except Exception as exc:  # each call of these functions fails with it, alone
        loaded = exc
    return LoadedBatch(ids, about, loaded, entries)


def run_batch(batch: LoadedBatch) -> _loky.BatchOutcome:
    """Run a batch's calls in order, each with its own outcome and run time: a call that
    raises fails alone, and the next one runs.

    A batch keeps its calls for :attr:`_Streamer.HAND_BACK_SECONDS` at most: past that, the
    calls not started yet are handed back to the parent, which queues them again, and
    the outcomes ended so far are sent with them (:class:`_Streamer`). What this returns
    is the rest.
    """
    ids, entries = batch.ids, batch.entries
    running = _streamer.start(ids, entries)
    try:
        _run_batch(batch, running, time.perf_counter)
    finally:
        rest = _streamer.stop()
    return rest


def _run_batch(batch: LoadedBatch, running: _Running, clock: Callable[[], float]) -> None:
    entries, functions = batch.entries, batch.functions
    for at, work_id in enumerate(batch.ids):
        entry, entries[at] = entries[at], None  # dropped as soon as it ran
        start = clock()
        try:
            if not isinstance(entry, tuple):  # a call that went alone (see load_call)
                assert entry is not None
                value = run(entry)
            else:
                index, args, kwargs = entry
                del entry
                if isinstance(functions, BaseException):
                    raise functions.with_traceback(functions.__traceback__)
                result = functions[index](*args, **(kwargs or {}))
                del args, kwargs
                value = _pack(result, batch.context, [], [], [])
                del result
        except BaseException as exc:  # sent back as its result, as run() sends it
            value = Raised(exc)
        end = running.add(work_id, value, clock() - start)
        del value
        if end <= at + 1:
            return  # the calls after this one were handed back


class _Running:
    """The running batch, shared with the streamer's thread: its outcomes not sent yet,
    and where it ends (the calls from ``end`` on were handed back)."""

    def __init__(
        self,
        lock: threading.Lock,
        ids: list[int],
        entries: list[PlainCall | LoadedCall | _Unloadable | None],
    ) -> None:
        self.lock = lock
        self.ids = ids
        self.entries = entries
        self.unsent = _loky.BatchOutcome()
        self.ran = 0  # calls ended
        self.end = len(ids)  # calls it may start: those before this index
        self.started = time.monotonic()
        self.handed_back = False  # whether it handed its calls back: nothing more to do

    def add(self, work_id: int, value: object, seconds: float) -> int:
        """A call ended with ``value``; returns ``end``."""
        with self.lock:
            self.unsent.add(work_id, value, seconds)
            self.ran += 1
            return self.end

    def hand_back(self) -> _loky.BatchOutcome:
        """Stop after the call running now: the outcomes not sent yet, with the ids of
        the calls not started (``returned``), which will not run here."""
        with self.lock:
            self.handed_back = True
            self.end = end = min(self.end, self.ran + 1)
            taken, self.unsent = self.unsent, _loky.BatchOutcome()
            if end < len(self.ids):
                taken.returned = self.ids[end:]
                del self.entries[end:]  # their arguments' mappings go now
            return taken

    def take(self) -> _loky.BatchOutcome:
        with self.lock:
            taken, self.unsent = self.unsent, _loky.BatchOutcome()
            return taken

    def put_back(self, outcome: _loky.BatchOutcome) -> None:
        """``outcome`` could not be sent: the batch's end sends it (what it holds first)."""
        with self.lock:
            outcome.extend(self.unsent)
            self.unsent = outcome


class _Streamer:
    """Hands a batch's calls back when the batch keeps them too long.

    A batch is sized to end within a few ms, and its outcomes then go back together, as
    the batch's result. If it runs longer than ``HAND_BACK_SECONDS`` (a call runs long, or
    waits for a call after it), a thread of this worker (a daemon, started with the
    first batch) cuts the batch short: the calls not started yet are handed back to the
    parent, which queues them again for any worker, and the outcomes ended so far go
    with them. The call running now ends the batch; its outcome is the batch's result.
    """

    HAND_BACK_SECONDS = 0.005

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """As a new process (after fork): no batch, no thread."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(threading.Lock())
        self._running: _Running | None = None
        self._thread: threading.Thread | None = None

    def start(
        self, ids: list[int], entries: list[PlainCall | LoadedCall | _Unloadable | None]
    ) -> _Running:
        running = _Running(self._lock, ids, entries)
        with self._wake:
            self._running = running
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, daemon=True)
                self._thread.name = "sharexec-stream"
                self._thread.start()
            self._wake.notify()
        return running

    def stop(self) -> _loky.BatchOutcome:
        """The batch ended: what is left to send, as its result."""
        with self._wake:
            running, self._running = self._running, None
        assert running is not None
        return running.take()

    def _watch(self) -> None:
        while True:
            with self._wake:
                running = self._running
                if running is None or running.handed_back:
                    self._wake.wait()  # until the next batch starts
                    continue
                wait = running.started + self.HAND_BACK_SECONDS - time.monotonic()
                if wait > 0:
                    self._wake.wait(wait)
                    continue
            late = running.hand_back()
            if not late and not late.returned:
                continue
            try:
                _loky.send_outcome(late)
            except BaseException:
                running.put_back(late)  # the batch's end sends it, if it has not yet
            del late, running


_streamer = _Streamer()
os.register_at_fork(after_in_child=_streamer.reset)


def run_chunk(fn: Callable[..., T], chunk: list[tuple[object, ...]]) -> list[T]:
    """Run ``fn`` over a chunk of ``map``'s calls, in order (``map(chunksize=...)``)."""
    return [fn(*args) for args in chunk]


def _dumps_in_band(result: object, options: Options) -> bytes | None:
    """Pickle ``result`` as the backward pass would, in a worker that has no NumPy.

    Without NumPy there is no array to share: every out-of-band buffer stays in band,
    which is right for any object. None if a buffer is large enough to share, or if
    pickling imported NumPy after all: then the backward pass must take over.
    """
    large = False

    def in_band(buffer: pickle.PickleBuffer) -> bool:
        nonlocal large
        large = large or buffer.raw().nbytes >= options.min_share_bytes
        return True

    out = io.BytesIO()
    pickler = Pickler(out, protocol=5, buffer_callback=in_band)
    try:
        pickler.dump(result)
    finally:
        pickler.clear_memo()  # it holds the result, in a cycle only the GC would break
    if large or "numpy" in sys.modules:
        return None
    return out.getvalue()
