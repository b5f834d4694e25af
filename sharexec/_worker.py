"""What runs in a worker: its start, and each task's way through it.

* Start: :func:`run_initializer`: the worker dies with its parent, then the user's
  initializer runs.
* A task: loky unpickles ``run`` and a :class:`~sharexec._reduction.Task`, which
  rebuilds as :func:`load_call` (the call's copies mapped copy-on-write, the mappings
  kept for later tasks of the same copies; its shared arrays shared; functions cached by
  :func:`load_function`); :func:`run` calls it and packs the result in a :class:`Reply`
  (a plain value goes back as it is), which loky pickles back.
* The parent's side of a reply, :func:`load_result`, lives here too: a ``Reply``
  pickles as a reference to it, and pickle must import what it refers to in the worker.

Kept apart from the transport (:mod:`sharexec._reduction`, the pickling pass) so that a
worker imports nothing heavy: no NumPy until a task carries or returns an array. A call
that holds an array imports :mod:`sharexec._arrays` (and so NumPy) when it is unpickled;
a result goes through the full backward pass only if it may hold an array or a large
out-of-band buffer (see :func:`run`). Nothing here imports NumPy, :mod:`sharexec._arrays`
or :mod:`sharexec._reduction` at import time.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import select
import sys
import threading
import time
import traceback
import weakref
from collections import ChainMap, OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import cloudpickle

from . import _loky, _segments, _tracking
from ._config import Options
from ._segments import Mapping
from .errors import ResultError, SegmentError

__all__ = [
    "Delivered",
    "RebuildFailure",
    "Reply",
    "attach_lent",
    "is_plain",
    "load_call",
    "load_function",
    "load_result",
    "run",
    "run_initializer",
]

# An out-of-band buffer: (segment name, segment size, offset, length),
# e.g. ("sharexec-41-Zm9vYmFy", 8000000, 0, 8000000).
BufferRef = tuple[str, int, int, int]


def run_initializer(parent_pid: int, call: Any) -> None:
    """Set up a new worker: it dies with its parent; then the user's initializer, if any.

    ``call`` is None, the initializer's ``_reduction.Task`` itself (fork: inherited, not
    pickled), or what that task's reduction rebuilt: ``[(fn, args, kwargs), options, ...]``.
    """
    _tracking.watch_parent(parent_pid)
    _loky.count_private_memory_only()
    if call is None:
        return
    if isinstance(call, list):
        (fn, args, kwargs), *_ = call
    else:
        fn, args, kwargs = call.fn, call.args, call.kwargs or {}
    fn(*args, **kwargs)


def _loads(
    payload: bytes,
    buffers: list[BufferRef],
    attach: Callable[[str, int], Any],
    mapped: dict[str, Any] | None = None,
) -> Any:
    """Unpickle ``payload`` over its out-of-band buffers; ``mapped`` gets what holds each
    segment's bytes, by name.

    ``attach(name, size)`` gives what holds a segment's bytes: a buffer that slices
    without copying (a memoryview, an array).
    """
    mappings: dict[str, Any] = {} if mapped is None else mapped
    views = []
    for name, size, offset, length in buffers:
        mapping = mappings.get(name)
        if mapping is None:
            mapping = mappings[name] = attach(name, size)
        views.append(mapping[offset : offset + length])
    return pickle.loads(payload, buffers=views)


# ---------------------------------------------------------------------------------------
# A call, in the worker
# ---------------------------------------------------------------------------------------


def load_call(
    payload: bytes,
    buffers: list[BufferRef],
    lent: list[tuple[str, int]],
    context: bytes,
) -> Any:
    """Rebuild a call in the worker: copies mapped copy-on-write, shared arrays shared.

    ``lent``: the warm segments the parent lent for the result, (name, size);
    ``context``: what the executor tells each call, pickled once (see :func:`_context`).
    """
    options, sweeper, token = _context(context)
    _tracking.join_sweeper(sweeper)  # segments this worker creates are the root's to sweep
    holders: dict[str, Any] = {}
    if _kept:
        _drop_unlinked()
    with _tracking.attached_shared() as shared:
        call = _loads(payload, buffers, _hold_copy, holders)
    if shared:
        _keep_shared(shared)
    # A list, so that run() can empty it: loky's call item holds it during the call.
    return [call, options, [(n, weakref.ref(h)) for n, h in holders.items()], (token, lent)]


# The contexts of the calls this worker received, by their pickle (one per executor).
_contexts: dict[bytes, tuple[Options, bytes, int]] = {}


def _context(blob: bytes) -> tuple[Options, bytes, int]:
    """The executor's options, its sweeper's address and its transport's token."""
    found = _contexts.get(blob)
    if found is None:
        if len(_contexts) >= 8:
            _contexts.clear()
        found = _contexts[blob] = pickle.loads(blob)
    return found


# ---------------------------------------------------------------------------------------
# Argument mappings kept between tasks
# ---------------------------------------------------------------------------------------
#
# A worker keeps the private (copy-on-write) mappings of the argument copies its tasks
# received, and a later task that names the same segment reuses one instead of mapping it
# afresh, which costs page faults and an munmap (summing 128 MiB: 22 ms through a fresh
# mapping, 15 ms through a kept one). It keeps the mappings of the shared arrays its tasks
# received too (_keep_shared), under the same bounds: those need no check, every process
# sees the same pages.
#
# * Each task gets its own holder of a copy's bytes (an array over the mapping, see
#   _hold_copy): the task's arrays are views of it, and the copy is *released* (the
#   parent may pool it, and rewrite it with other bytes) when the holder dies, whether the
#   mapping is kept or not.
# * A kept mapping is reused only if no holder of an earlier task is alive (a view kept
#   in a global must never see another task's writes) and if this worker never wrote into
#   it (no page of it is its own copy, _segments.written). Its other pages are the
#   segment's own: they show what the parent wrote there last, never a stale snapshot.
# * Bounded: at most _KEPT_BYTES and _KEPT_MAPPINGS, least recently used dropped first;
#   a mapping written into is dropped once its task is done (its private pages are memory
#   of this worker's own); a segment the parent unlinked is dropped at the next call (its
#   memory lives as long as a mapping does), or as soon as it is removed between tasks;
#   everything is dropped after _KEPT_IDLE_SECONDS without a task (one daemon thread,
#   started with the first).

_KEPT_BYTES = 1 << 30  # the parent's pool holds at most this much too (_reduction)
_KEPT_MAPPINGS = 128  # W2's 64 chunks fit; each is one VMA and one name to look up per call
_KEPT_IDLE_SECONDS = 10.0  # as long as the parent keeps an idle pool


class _Kept:
    """A kept mapping, the holders tasks had of it, and whether it was found unwritten
    since the last of them died."""

    __slots__ = ("clean", "holders", "mapping")

    def __init__(self, mapping: Mapping) -> None:
        self.mapping = mapping
        self.holders: list[weakref.ref[Any]] = []
        self.clean = False


# Kept mappings by segment name, least recently used first, e.g.
# {"sharexec-41-Zm9vYmFy": <_Kept of a Mapping of 134217728 bytes>}; valid in _kept_pid only.
_kept: OrderedDict[str, _Kept] = OrderedDict()
_kept_pid = 0
_kept_lock = threading.Lock()  # the dropping thread clears _kept
_last_task = 0.0  # time.monotonic() when a task last began or ended
_dropper_pid = 0  # the process whose dropping thread runs


def _kept_here() -> OrderedDict[str, _Kept]:
    """The kept mappings (call with _kept_lock held); none inherited through a fork."""
    global _kept_pid
    if _kept_pid != os.getpid():
        _kept.clear()
        _kept_pid = os.getpid()
    return _kept


def _hold_copy(name: str, size: int) -> Any:
    """A new holder of the bytes of the copy segment ``name`` for one task: a byte array
    over a kept mapping of it if one may be reused, else over a fresh one, kept."""
    import numpy as np  # a call with a buffer: NumPy is needed for it (or loaded already)

    global _last_task
    with _kept_lock:
        _last_task = time.monotonic()  # first: the dropping thread may start below
        entry = _reusable(_kept_here(), name, max(size, 1))
    if entry is None:
        entry = _Kept(_tracking.attach_private(name, size))
        with _kept_lock:
            _keep(_kept_here(), name, entry)
    holder = np.frombuffer(entry.mapping, np.uint8)
    with _kept_lock:
        entry.holders.append(weakref.ref(holder))
        entry.clean = False
    return holder


def _reusable(kept: OrderedDict[str, _Kept], name: str, size: int) -> _Kept | None:
    """The kept mapping of ``name`` if it may serve a new task; else None (dropped)."""
    entry = kept.pop(name, None)
    if entry is None:
        return None
    if not entry.mapping.private or len(entry.mapping) != size:
        return None  # kept shared (lent before, say): a copy needs its own private mapping
    if any(ref() is not None for ref in entry.holders):
        return None  # a view of an earlier task lives on it: this task maps its own
    if not entry.clean and _segments.written(entry.mapping):
        return None
    entry.holders = []
    kept[name] = entry  # most recently used
    return entry


def _keep(kept: OrderedDict[str, _Kept], name: str, entry: _Kept) -> None:
    """Keep a fresh mapping, within the bounds (the oldest go first)."""
    global _dropper_pid
    if os.path.isabs(name) or len(entry.mapping) > _KEPT_BYTES:
        return  # a file on disk (a fallback, not pooled), or too big to keep
    kept[name] = entry
    total = sum(len(e.mapping) for e in kept.values())
    while total > _KEPT_BYTES or len(kept) > _KEPT_MAPPINGS:
        _, oldest = kept.popitem(last=False)
        total -= len(oldest.mapping)
    if _dropper_pid != os.getpid():
        _dropper_pid = os.getpid()
        threading.Thread(target=_drop_when_idle, name="sharexec-kept-copies", daemon=True).start()


def _keep_shared(mappings: list[Mapping]) -> None:
    """Keep the mappings of the shared segments a call used, for later tasks to find
    mapped (``_tracking.attach_shared``): mapping 128 MiB afresh costs a task 7 ms of page
    faults. Not those this worker owns (handed to it): their views decide when they go."""
    global _last_task
    with _kept_lock:
        kept = _kept_here()
        for mapping in mappings:
            if mapping.owner is None:
                entry = kept.pop(mapping.name, None)
                if entry is None or entry.mapping is not mapping:
                    entry = _Kept(mapping)
                _keep(kept, mapping.name, entry)
        _last_task = time.monotonic()
        _watch_removals()


def attach_lent(name: str, size: int) -> Mapping:
    """A shared mapping of the warm segment ``name`` that the parent lent a task to write
    its result into: the one kept from an earlier task it was lent to, else a fresh one
    (every page mapped up front), kept. Mapping 64 MiB populated costs 2 ms a task.

    Kept, it is written only when lent again: the parent lends a segment to one task at
    a time, and holds it as a private result in between.
    """
    with _kept_lock:
        entry = _kept_here().pop(name, None)
    if entry is None or entry.mapping.private or len(entry.mapping) != max(size, 1):
        entry = _Kept(_tracking.attach_lent(name, size))
    elif not _segments.existing([name]):  # freed since
        raise SegmentError(errno.ENOENT, f"lent segment {name!r} is gone")
    with _kept_lock:
        _keep(_kept_here(), name, entry)
    return entry.mapping


def _after_task(released: list[str]) -> None:
    """A task is done: its copies no view holds any more are checked for pages this worker
    wrote (and dropped if so: they are its own memory), else marked clean for reuse."""
    global _last_task
    with _kept_lock:
        kept = _kept_here()
        for name in released:
            entry = kept.get(name)
            if entry is None or any(ref() is not None for ref in entry.holders):
                continue
            entry.clean = not _segments.written(entry.mapping)
            if not entry.clean:
                del kept[name]
        _last_task = time.monotonic()


def _drop_unlinked() -> None:
    """Drop the kept mappings of segments that no longer exist: the parent freed them, and
    only a mapping still holds their memory."""
    with _kept_lock:
        kept = _kept_here()
        if not kept:
            return
        names = list(kept)
        alive = _segments.existing(names)
        for name in names:
            if name not in alive:
                del kept[name]


def _drop_idle(now: float) -> float:
    """Drop every kept mapping if no task began or ended for _KEPT_IDLE_SECONDS before
    ``now``, else those of segments freed meanwhile; return the time left until the
    mappings are idle long enough."""
    with _kept_lock:
        idle = now - _last_task
        if idle >= _KEPT_IDLE_SECONDS:
            _kept_here().clear()
            _watch_removals(False)
            return _KEPT_IDLE_SECONDS
    _drop_unlinked()
    return _KEPT_IDLE_SECONDS - idle


# Shared arrays are the one kind of kept mapping whose segment the parent may free while
# this worker is idle (copies and lent segments stay in the parent's pool until it has
# been idle as long as the kept mappings here). While this worker keeps one, the dropping
# thread watches removals from the shared-memory folder, so the memory of a freed array
# goes at once, not at this worker's next task. The watch (an inotify instance, of which
# a user may have only 128 on some systems) is given back once nothing is kept.
_removals: int | None = None  # the watch, in _removals_pid
_removals_pid = 0
_polling = False  # a shared mapping is kept but no watch could be had: look every so often
_UNLINKED_SECONDS = 0.05  # how often, then (one listdir each time)
_new_watch = threading.Event()  # wakes the dropping thread to take up a new watch


def _watch_removals(needed: bool = True) -> None:
    """Take a watch of removals (call with _kept_lock held), or give it back."""
    global _removals, _removals_pid, _polling
    if _removals_pid != os.getpid():  # none inherited through a fork
        _removals, _removals_pid, _polling = None, os.getpid(), False
    if needed and _removals is None:
        _removals = _segments.removals()
        _polling = _removals is None
        _new_watch.set()
    elif not needed:
        if _removals is not None:
            os.close(_removals)
        _removals, _polling = None, False


def _drop_when_idle() -> None:
    """The dropping thread: drops kept mappings once idle, and those of freed segments."""
    while True:
        wait = _drop_idle(time.monotonic())
        with _kept_lock:
            removals = _removals if _removals_pid == os.getpid() else None
            polling = _polling
        if removals is None:
            _new_watch.wait(min(wait, _UNLINKED_SECONDS) if polling else wait)
            _new_watch.clear()
            continue
        try:
            readable, _, _ = select.select([removals], [], [], wait)
            if readable:
                while os.read(removals, 1 << 16):
                    pass
        except (BlockingIOError, OSError, ValueError):
            pass  # read empty, or given back meanwhile: look again


# In a worker: functions already unpickled, by their pickle (most recent last).
_functions: OrderedDict[bytes, Any] = OrderedDict()
_FUNCTIONS_KEPT = 256


def load_function(payload: bytes) -> Any:
    """Unpickle a cached function once per worker."""
    fn = _functions.get(payload)
    if fn is None:
        fn = _functions[payload] = pickle.loads(payload)
        if len(_functions) > _FUNCTIONS_KEPT:
            _functions.popitem(last=False)
    else:
        _functions.move_to_end(payload)
    return fn


def run(call: Any) -> Any:
    """Run a call in the worker and pack its result for the way back.

    The result takes the cheapest road that is still exact:

    * a plain value (``None``, a number, a string, bytes; or a short tuple or list of
      them) holds no buffer: it is returned as it is for loky to pickle, if the call
      had no argument copies to report released (many tiny tasks), else in a
      :class:`Reply` pickled by plain pickle;
    * while NumPy is not loaded in this worker, no array can exist: cloudpickle with
      every buffer in band, unless one is large enough to share;
    * anything else: the backward pass of :mod:`sharexec._reduction` (which imports
      NumPy), where large buffers go to segments handed to the parent.
    """
    (fn, args, kwargs), options, mapped, (token, lent) = call
    call.clear()
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:
        _raise_picklable(exc)
        raise
    del fn, args, kwargs  # copy-on-write pages of the arguments go as early as possible
    # The argument copies no view of this task holds any more: the parent may reuse them
    # (kept mappings show whatever the parent writes there, see _reusable).
    released = [name for name, ref in mapped if ref() is None]
    if mapped:
        _after_task(released)
    if is_plain(result):
        if not mapped:  # nothing to tell the parent but the value
            return result
        return Reply(pickle.dumps(result, protocol=5), [], released, token)
    if "numpy" not in sys.modules:
        payload = _dumps_in_band(result, options)
        if payload is not None:
            return Reply(payload, [], released, token)
    from . import _reduction  # the backward pass: NumPy is needed (or loaded already)

    packed = _reduction.dumps(result, options, lent=lent)
    return Reply(packed.payload, packed.buffers, released, token, packed.keep)


# Values that hold no buffer, whatever the pickler: plain pickle writes them as either
# pass would (the C pickler saves these types itself, complex by copyreg). Results and
# arguments made only of them skip the passes (see run, Transport.plain_call).
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_ITEMS = 16  # a longer tuple or list takes the general road: no scan of its items


def is_plain(value: Any) -> bool:
    """Whether ``value`` is an atom, or a short tuple or list of atoms: it holds no buffer."""
    kind = type(value)
    if kind in _ATOMS:
        return True
    if (kind is tuple or kind is list) and len(value) <= _PLAIN_ITEMS:
        return all(type(item) in _ATOMS for item in value)
    return False


class _InBandPickler(cloudpickle.Pickler):  # type: ignore[misc]
    # The dispatch table of _reduction._Pickler (loky's reducers, then cloudpickle's and
    # copyreg's): an object pickles here exactly as it would in the backward pass.
    dispatch_table: ClassVar[ChainMap[Any, Any]] = ChainMap(
        _loky.DISPATCH_TABLE, cloudpickle.Pickler.dispatch_table
    )


def _dumps_in_band(result: Any, options: Options) -> bytes | None:
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
    pickler = _InBandPickler(out, protocol=5, buffer_callback=in_band)
    try:
        pickler.dump(result)
    finally:
        pickler.clear_memo()  # it holds the result, in a cycle only the GC would break
    if large or "numpy" in sys.modules:
        return None
    return out.getvalue()


def _raise_picklable(exc: Exception) -> None:
    """Replace a task's exception that cannot be pickled: loky's worker would die of it."""
    try:
        cloudpickle.dumps(exc)
    except Exception as why:
        remote = "".join(traceback.format_exception(exc))
        raise RuntimeError(
            f"the task raised {type(exc).__qualname__}({exc}), which cannot be sent back "
            f"to the parent: {why}\n\nIts traceback in the worker:\n{remote}"
        ) from None


# ---------------------------------------------------------------------------------------
# A result, on its way back to the parent
# ---------------------------------------------------------------------------------------


class Reply:
    """A result on its way back: a small payload and the segments handed to the parent."""

    def __init__(
        self,
        payload: bytes,
        buffers: list[BufferRef],
        released: list[str],
        token: int,
        keep: list[Mapping] | None = None,
    ) -> None:
        self.payload = payload
        self.buffers = buffers
        self.released = released
        self.token = token  # the transport that sent the call
        # The mappings the payload refers to, held until it is sent.
        self.keep = keep

    def __reduce__(self) -> Any:
        return load_result, (self.payload, self.buffers, self.released, self.token)


def load_result(payload: bytes, buffers: list[BufferRef], released: list[str], token: int) -> Any:
    """Rebuild a result in the parent over its segments, which become the parent's.

    Each goes to the pool of transport ``token`` once the result is collected (see
    ``_reduction.receive``).

    This runs in loky's manager thread, where an exception would break the whole pool
    (as the standard library's does): a failure is returned instead, for the executor's
    future to raise (see ``_executor._Future``), and the pool goes on.
    """
    spilled = [name for name, *_ in buffers if os.path.isabs(name)]
    if spilled:
        _tracking.warn_fallback(
            f"shared memory is full or missing ({_segments.SHM_FOLDER}): large results "
            f"come back through files in {os.path.dirname(spilled[0])} instead"
        )
    from . import _reduction  # in the parent, where it is loaded already

    received: list[str] = []

    def receive(name: str, size: int) -> Any:
        buffer = _reduction.receive(name, size, token)
        received.append(name)
        return memoryview(buffer)

    try:
        value = _loads(payload, buffers, receive)
    except Exception as exc:
        for name, *_ in buffers:  # whatever was not received yet goes too
            if name not in received and not _reduction.is_lent(name):  # (lent: pooled)
                _tracking.forget(name)
        return RebuildFailure(exc)
    sizes: dict[str, int] = {}
    for name, _, offset, length in buffers:
        sizes[name] = max(sizes.get(name, 0), offset + length)
    return Delivered(value, released, list(sizes.values()))


class Delivered:
    """A rebuilt result, with what its task's release needs: the argument copies its
    worker let go of, and the sizes of the large buffers it came in (what to lend the
    function's next tasks)."""

    def __init__(self, value: Any, released: list[str], sizes: list[int]) -> None:
        self.value = value
        self.released = frozenset(released)
        self.sizes = sizes


class RebuildFailure:
    """A result that could not be rebuilt in the parent: its future raises ``error``."""

    def __init__(self, cause: Exception) -> None:
        self.error = ResultError(f"the task's result could not be rebuilt here: {cause!r}")
        self.error.__cause__ = cause
