"""Segments of this process: their handles, its shared mappings, and how it gets them.

This module is the only one of a process that unlinks a segment (but for the sweeper
process, which frees what dead processes left, and ``doctor --clean``, which removes
stale segments): a handle collected, or a segment handed to this process that it will
never own (:func:`forget`, :func:`adopt_private`). Its rules:

* Each segment this process must free has one :class:`Segment` handle. The handle is
  unlinked when it is garbage-collected, so Python's own reference counts decide a
  segment's life: shared arrays keep their mapping alive, a mapping keeps its handle
  alive (``Mapping.owner``), and a task in flight keeps the mappings it refers to alive.
  The handle checks the process id, so a forked child never frees its parent's segments.
* Mappings of shared arrays (``MAP_SHARED``) are listed by address range, so any array
  whose memory lies inside one, however it was sliced, reshaped or transposed, is found
  (:func:`find_shared`) and can travel by reference. Private mappings (copies of
  arguments, results) are deliberately not listed: they have copy semantics.
* Attaching never registers a segment for unlinking by the attacher, unless the sender
  handed its ownership over (a worker returning a shared array it allocated).
* A process that dies runs no finalizer: every segment is told to the session's sweeper
  as it is created, freed or handed over (:mod:`sharexec._session`, this process's line
  to it, which also keeps what this process owns). A segment a worker hands over
  (:func:`hand_off`) is in flight to the process its result goes to until that process
  adopts it (:func:`adopt`): freed if that process dies first, or if the executor it
  was sent for reads no more results (``_session.receiver_closed``).

This process's shared mappings live in ``_registry``, with its own lock: no lock is taken
while it is held (but by a finalizer the garbage collector runs meanwhile). A forked child
keeps them (its mappings are its parent's, inherited) with a new lock, by an after-fork
hook registered at import (see :mod:`sharexec._session` for why hooks, and why then).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING

from . import _passing, _segments
from ._segments import Mapping
from ._session import in_worker, owned, receiver_pid, tell
from ._sweeper import ADOPT, HAND_OFF, REGISTER, UNREGISTER
from .errors import SegmentError, SharexecWarning

if TYPE_CHECKING:  # a worker imports NumPy only when a call holds an array
    import numpy as np

__all__ = [
    "Segment",
    "adopt",
    "adopt_private",
    "attach_held",
    "attach_lent",
    "attach_private",
    "attach_shared",
    "attached_shared",
    "call_holders",
    "find_shared",
    "forget",
    "hand_off",
    "new_private",
    "new_shared",
    "owns",
    "spilled",
    "warn_fallback",
]

logger = logging.getLogger("sharexec")


# ---------------------------------------------------------------------------------------
# Segment handles: the one cleanup path
# ---------------------------------------------------------------------------------------


class Segment:
    """A segment this process must unlink; it is unlinked when this handle is collected."""

    __slots__ = ("__weakref__", "_finalizer", "name", "pid")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.pid = os.getpid()  # a forked child inherits this handle and its finalizer
        self._finalizer = weakref.finalize(self, _unlink, name, self.pid)
        owned.note(name, size)

    def hand_off(self) -> None:
        """Give up ownership: another process will unlink this segment."""
        self._finalizer.detach()
        owned.drop(self.name)

    @property
    def owned(self) -> bool:
        """Whether this process will unlink the segment (a forked child never does)."""
        return self._finalizer.alive and self.pid == os.getpid()


def _unlink(name: str, owner_pid: int) -> None:
    owned.drop(name)
    if os.getpid() == owner_pid:  # never in a forked child, even if it runs the finalizer
        _segments.unlink(name)
        if not _segments.anonymous(name):  # the sweeper never hears of those: see _create
            tell(UNREGISTER, name)
        logger.debug("unlinked segment %s", name)


def _own(mapping: Mapping) -> Mapping:
    mapping.owner = Segment(mapping.name, len(mapping))
    return mapping


def _create(size: int, spill_to: str | None, content: _segments.Content | None = None) -> Mapping:
    """A new segment owned by this process.

    In shared memory; if that fails (full, too small, missing) and ``spill_to`` is given,
    an anonymous segment (Linux), else file-backed in a private folder inside
    ``spill_to`` (a name that is a path). Not when this process is out of file
    descriptors: the others need one as well.

    A worker makes anonymous segments only if it can pass their descriptors to its
    parent (:mod:`sharexec._passing`): it hands its results and the shared arrays it
    returns over, and an anonymous segment lives only while a process holds its
    descriptor.
    """
    try:
        return _create_named(_segments.new_name(), size, content)
    except SegmentError as exc:
        if spill_to is None or exc.errno in _segments.OUT_OF_DESCRIPTORS:
            raise
        if _segments.anonymous_supported() and (
            not in_worker() or _passing.can_send(receiver_pid())
        ):
            try:
                return _own(_segments.create_anonymous(size, content))
            except SegmentError as anonymous_exc:
                if anonymous_exc.errno in _segments.OUT_OF_DESCRIPTORS:
                    raise
                logger.info("%s", anonymous_exc)
        logger.info("%s; spilling to a file in %s", exc, spill_to)
        folder = owned.spill_folder(spill_to)
        return _create_named(os.path.join(folder, _segments.new_name()), size, content)


def _create_named(name: str, size: int, content: _segments.Content | None = None) -> Mapping:
    tell(REGISTER, name)  # first: a crash while the space is being reserved leaks nothing
    try:
        return _own(_segments.create(size, name, content))
    except BaseException:
        tell(UNREGISTER, name)
        raise


# A fallback was reported in this process (or in the process it was forked from: the
# cause is the machine's, the user was told).
_warned = False


def warn_fallback(message: str) -> None:
    """Tell the user, once per process, that shared memory fell short.

    Once per process, not per executor: the cause (the size of the shared-memory folder)
    is the machine's, and so is the remedy.
    """
    global _warned
    logger.info("%s", message)
    if not _warned:
        _warned = True
        warnings.warn(message, SharexecWarning, stacklevel=4)


def spilled(name: str, what: str) -> str:
    """The message for ``what`` spilled to the file-backed segment ``name``, e.g.
    ``spilled(name, "large results come back through")``."""
    folder = os.path.dirname(name)
    return (
        f"shared memory is full or missing ({_segments.SHM_FOLDER}): {what} files in "
        f"{folder} instead"
    )


def owns(mapping: Mapping) -> bool:
    """Whether this process is the one to unlink ``mapping``'s segment."""
    owner = mapping.owner
    return isinstance(owner, Segment) and owner.owned


def hand_off(mapping: Mapping, token: int) -> None:
    """Hand the ownership of a mapping's segment to the process receiving it: the one
    this worker works for, for its receiver ``token`` (see ``_session.receiver_closed``).

    Until that process adopts it (:func:`adopt`), the sweeper holds it in flight to it:
    freed if it dies, or closes ``token``, first. An anonymous segment's descriptor is
    passed to it instead, and closed here at once: in flight, the kernel holds it.
    """
    owner = mapping.owner
    if isinstance(owner, Segment) and owner.owned:
        if _segments.anonymous(mapping.name):
            fd = _segments.pass_on(mapping.name)
            try:
                label = _segments.anonymous_label(mapping.name)
                _passing.send(receiver_pid(), fd, label, token)
            finally:
                os.close(fd)
            owner.hand_off()
            return
        owner.hand_off()
        tell(HAND_OFF, mapping.name, receiver_pid(), token)


# ---------------------------------------------------------------------------------------
# Shared mappings, by address and by name
# ---------------------------------------------------------------------------------------


class _Registry:
    """The shared mappings of this process, by address range and by segment name."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: a weakref callback may fire while held
        # Start addresses of the live shared mappings, sorted, e.g. [139872512, 139876608],
        # and the mapping at each, e.g. {139872512: <weakref to Mapping 'sharexec-41-Zm9v'>}.
        self.starts: list[int] = []
        self.by_start: dict[int, weakref.ref[Mapping]] = {}
        # The same mappings by segment name, so a segment is mapped once per process,
        # e.g. {"sharexec-41-Zm9v": <Mapping 'sharexec-41-Zm9v'>}.
        self.by_name: weakref.WeakValueDictionary[str, Mapping] = weakref.WeakValueDictionary()
        # In a thread inside attached_shared, .shared: the mappings it attached, e.g. [].
        self.attaching = threading.local()

    def add(self, mapping: Mapping, alias: str | None = None) -> Mapping:
        """List a shared mapping, until it is collected; also by ``alias``, the name its
        sender knows it by (an anonymous segment passed on is named anew here)."""
        start = mapping.address
        with self.lock:
            if start not in self.by_start:  # starts stay unique, even if a callback is late
                bisect.insort(self.starts, start)
            ref = weakref.ref(mapping, partial(self._drop, start))
            self.by_start[start] = ref
            self.by_name[mapping.name] = mapping
            if alias is not None:
                self.by_name[alias] = mapping
        return mapping

    def _drop(self, start: int, ref: weakref.ref[Mapping]) -> None:
        # Only the entry this weakref made: a mapping since registered at the same address
        # (a new mmap may reuse the address) keeps its entry.
        with self.lock:
            if self.by_start.get(start) is not ref:
                return
            del self.by_start[start]
            i = bisect.bisect_left(self.starts, start)
            if i < len(self.starts) and self.starts[i] == start:
                del self.starts[i]

    def named(self, name: str) -> Mapping | None:
        """This process's shared mapping of the segment ``name``, if it has one."""
        with self.lock:
            return self.by_name.get(name)

    def find(self, low: int, high: int) -> tuple[Mapping, int] | None:
        """The shared mapping holding the bytes ``[low, high)``, and ``low``'s offset in it."""
        if not self.starts:
            return None
        with self.lock:
            i = bisect.bisect_right(self.starts, low) - 1
            if i < 0:
                return None
            # .get: the garbage collector may run a _drop (re-entrant lock) at any point
            ref = self.by_start.get(self.starts[i])
            mapping = ref() if ref is not None else None
        if mapping is None or high > mapping.address + len(mapping):
            return None
        return mapping, low - mapping.address

    def after_fork_in_child(self) -> None:
        """A forked child keeps its parent's mappings, and this list of them; a new lock."""
        self.lock = threading.RLock()


_registry = _Registry()
os.register_at_fork(after_in_child=_registry.after_fork_in_child)


def find_shared(low: int, high: int) -> tuple[Mapping, int] | None:
    """The shared mapping holding the bytes ``[low, high)``, and ``low``'s offset in it."""
    return _registry.find(low, high)


# ---------------------------------------------------------------------------------------
# Creating and attaching
# ---------------------------------------------------------------------------------------


def new_shared(
    size: int, spill_to: str | None = None, content: _segments.Content | None = None
) -> Mapping:
    """A new segment for a shared array, owned by this process and listed as shared;
    ``content`` writes its first bytes (see :func:`_segments.create`)."""
    mapping = _create(size, spill_to, content)
    logger.debug("created shared segment %s (%d bytes)", mapping.name, size)
    return _registry.add(mapping)


def new_private(
    size: int, spill_to: str | None = None, content: _segments.Content | None = None
) -> Mapping:
    """A new segment to copy a private buffer into, owned by this process; ``content``
    writes its first bytes (see :func:`_segments.create`)."""
    mapping = _create(size, spill_to, content)
    logger.debug("created copy segment %s (%d bytes)", mapping.name, size)
    return mapping


def attach_shared(name: str, size: int, adopt: bool) -> Mapping:
    """Map a shared array's segment, once per process.

    With ``adopt``, the sender handed its ownership over and this process frees it.
    """
    mapping = _registry.named(name)
    if mapping is not None:
        if adopt and mapping.owner is None:
            _adopted(mapping)  # mapped already: a view this process was sent before
    else:
        mapping = _attach(name, size, adopt)
        if adopt:
            _adopted(mapping)
        mapping = _registry.add(mapping, name)
    seen = getattr(_registry.attaching, "shared", None)
    if seen is not None:
        seen.append(mapping)
    return mapping


@contextlib.contextmanager
def attached_shared(holders: dict[str, np.ndarray] | None = None) -> Iterator[list[Mapping]]:
    """The shared segments this thread maps (or finds mapped) within the block.

    With ``holders``, the views rebuilt in the block are built over one holder per
    segment, recorded there by name (see :func:`call_holders`).
    """
    seen: list[Mapping] = []
    _registry.attaching.shared = seen
    _registry.attaching.holders = holders
    try:
        yield seen
    finally:
        _registry.attaching.shared = None
        _registry.attaching.holders = None


def call_holders() -> dict[str, np.ndarray] | None:
    """Inside :func:`attached_shared` with holders: the holders of the segments, by name,
    over which this thread rebuilds shared views (``_arrays.rebuild_shared``)."""
    holders: dict[str, np.ndarray] | None = getattr(_registry.attaching, "holders", None)
    return holders


def attach_private(name: str, size: int) -> Mapping:
    """Map a copy segment copy-on-write: writes stay in this process."""
    return _segments.attach(name, size, private=True)


def attach_held(name: str, size: int) -> Mapping:
    """Map a segment shared, to keep its memory alive, without touching a page of it.

    An untouched mapping costs this process no resident memory, and the memory stays
    reachable through it after the segment's owner unlinks it (a cluster worker sharing
    another's copy on one host, :mod:`sharexec._cluster`). Not listed as shared.
    """
    return _segments.attach(name, size, private=False)


def attach_lent(name: str, size: int) -> Mapping:
    """Map a warm segment the parent lent this worker to write a result into.

    It stays the parent's: this process neither owns nor hands it off.
    """
    return _segments.attach(name, size, private=False, populate=True)


def forget(name: str) -> None:
    """Unlink a segment handed to this process that it will never map (a failed result)."""
    if _segments.anonymous(name):
        with contextlib.suppress(SegmentError):  # never came: nothing to close
            os.close(_passing.take(_segments.anonymous_label(name), _FORGET_WAIT))
        return
    _segments.unlink(name)
    tell(UNREGISTER, name)


_FORGET_WAIT = 1.0  # seconds: how long a failed result waits for a descriptor to close


def _attach(name: str, size: int, handed: bool) -> Mapping:
    """Map the segment ``name`` shared; ``handed``: another process handed it to this
    one (an anonymous segment's descriptor was passed, and is taken here)."""
    if handed and _segments.anonymous(name):
        fd = _passing.take(_segments.anonymous_label(name))
        return _segments.adopt_anonymous(fd, name, size)
    return _segments.attach(name, size, private=False)


def adopt(name: str, size: int) -> Mapping:
    """Map a segment another process filled for us alone and handed to us: ours to free."""
    return _adopted(_attach(name, size, handed=True))


def _adopted(mapping: Mapping) -> Mapping:
    """``mapping``'s segment, handed to this process, is its own to free now: the
    sweeper frees it if this process dies (not when the session ends; an anonymous
    segment, held by its descriptor, is the kernel's to free then)."""
    _own(mapping)
    if not _segments.anonymous(mapping.name):
        tell(ADOPT, mapping.name)
    return mapping


def adopt_private(name: str, size: int) -> Mapping:
    """Map a segment another process filled for us alone, then unlink it at once.

    The mapping keeps the memory; no other process can reach it any more, so the result
    it holds has private semantics and cannot leak.
    """
    mapping = _attach(name, size, handed=True)
    _segments.unlink(mapping.name)
    if not _segments.anonymous(name):
        tell(UNREGISTER, name)
    logger.debug("adopted and unlinked segment %s", name)
    return mapping
