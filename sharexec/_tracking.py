"""Ownership of segments: who maps what, who frees what, and when.

This module is the only one that unlinks. Its rules:

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
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import weakref
from functools import partial

from . import _segments
from ._segments import Mapping

__all__ = [
    "Segment",
    "adopt_private",
    "attach_private",
    "attach_shared",
    "find_shared",
    "hand_off",
    "new_private",
    "new_shared",
    "owns",
]

logger = logging.getLogger("sharexec")


# ---------------------------------------------------------------------------------------
# Segment handles: the one cleanup path
# ---------------------------------------------------------------------------------------


class Segment:
    """A segment this process must unlink; it is unlinked when this handle is collected."""

    __slots__ = ("__weakref__", "_finalizer", "name", "pid", "size")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.pid = os.getpid()
        self._finalizer = weakref.finalize(self, _unlink, name, self.pid)

    def hand_off(self) -> None:
        """Give up ownership: another process will unlink this segment."""
        self._finalizer.detach()

    @property
    def owned(self) -> bool:
        """Whether this process will unlink the segment (a forked child never does)."""
        return self._finalizer.alive and self.pid == os.getpid()


def _unlink(name: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        _segments.unlink(name)
        logger.debug("unlinked segment %s", name)


def _own(mapping: Mapping) -> Mapping:
    mapping.owner = Segment(mapping.name, len(mapping))
    return mapping


def owns(mapping: Mapping) -> bool:
    """Whether this process is the one to unlink ``mapping``'s segment."""
    owner = mapping.owner
    return isinstance(owner, Segment) and owner.owned


def hand_off(mapping: Mapping) -> None:
    """Hand the ownership of a mapping's segment to the process receiving it."""
    owner = mapping.owner
    if isinstance(owner, Segment) and owner.owned:
        owner.hand_off()


# ---------------------------------------------------------------------------------------
# Shared mappings, by address and by name
# ---------------------------------------------------------------------------------------

_lock = threading.RLock()  # re-entrant: a weakref callback may fire while held
# Start addresses of the live shared mappings, sorted, e.g. [139872512, 139876608], and
# the mapping at each, e.g. {139872512: <weakref to Mapping 'sharexec-41-Zm9v'>}.
_starts: list[int] = []
_by_start: dict[int, weakref.ref[Mapping]] = {}
# The same mappings by segment name, so a segment is mapped once per process.
_by_name: weakref.WeakValueDictionary[str, Mapping] = weakref.WeakValueDictionary()


def _register(mapping: Mapping) -> Mapping:
    start = mapping.address
    with _lock:
        bisect.insort(_starts, start)
        _by_start[start] = weakref.ref(mapping, partial(_forget, start))
        _by_name[mapping.name] = mapping
    return mapping


def _forget(start: int, _: object = None) -> None:
    with _lock:
        _by_start.pop(start, None)
        i = bisect.bisect_left(_starts, start)
        if i < len(_starts) and _starts[i] == start:
            del _starts[i]


def find_shared(low: int, high: int) -> tuple[Mapping, int] | None:
    """The shared mapping holding the bytes ``[low, high)``, and ``low``'s offset in it."""
    if not _starts:
        return None
    with _lock:
        i = bisect.bisect_right(_starts, low) - 1
        if i < 0:
            return None
        mapping = _by_start[_starts[i]]()
    if mapping is None or high > mapping.address + len(mapping):
        return None
    return mapping, low - mapping.address


# ---------------------------------------------------------------------------------------
# Creating and attaching
# ---------------------------------------------------------------------------------------


def new_shared(size: int) -> Mapping:
    """A new segment for a shared array, owned by this process and listed as shared."""
    mapping = _own(_segments.create(size))
    logger.debug("created shared segment %s (%d bytes)", mapping.name, size)
    return _register(mapping)


def new_private(size: int) -> Mapping:
    """A new segment to copy a private buffer into, owned by this process."""
    mapping = _own(_segments.create(size))
    logger.debug("created copy segment %s (%d bytes)", mapping.name, size)
    return mapping


def attach_shared(name: str, size: int, adopt: bool) -> Mapping:
    """Map a shared array's segment, once per process.

    With ``adopt``, the sender handed its ownership over and this process frees it.
    """
    with _lock:
        mapping = _by_name.get(name)
    if mapping is not None:
        if adopt and mapping.owner is None:
            _own(mapping)
        return mapping
    mapping = _segments.attach(name, size, private=False)
    if adopt:
        _own(mapping)
    return _register(mapping)


def attach_private(name: str, size: int) -> Mapping:
    """Map a copy segment copy-on-write: writes stay in this process."""
    return _segments.attach(name, size, private=True)


def adopt_private(name: str, size: int) -> Mapping:
    """Map a segment another process filled for us alone, then unlink it at once.

    The mapping keeps the memory; no other process can reach it any more, so the result
    it holds has private semantics and cannot leak.
    """
    mapping = _segments.attach(name, size, private=False)
    _segments.unlink(name)
    logger.debug("adopted and unlinked segment %s", name)
    return mapping
