"""The mappings a worker keeps between tasks (:class:`KeptMappings`, one per process:
:data:`kept`), so that a later task of the same segment finds it mapped: the argument
copies the tasks received (copy-on-write), the segments lent for results, and shared
arrays; dropped when idle, when their segment is freed, or when too many are kept.

Used by the local workers (:mod:`sharexec._worker`) and by the cluster executor's Dask
workers (:mod:`sharexec._cluster.worker`). Nothing here imports NumPy at import time.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import threading
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING

from . import _segments, _tracking
from ._config import KEPT_MAPPINGS, WARM_BYTES, WARM_IDLE_SECONDS
from ._segments import Mapping
from .errors import SegmentError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["KeptMappings", "kept"]


class _Kept:
    """A kept mapping, the holders tasks had of it, and whether it was found unwritten
    since the last of them died."""

    __slots__ = ("clean", "holders", "mapping")

    def __init__(self, mapping: Mapping) -> None:
        self.mapping = mapping
        self.holders: list[weakref.ref[np.ndarray]] = []
        self.clean = False


class KeptMappings:
    """The mappings a worker keeps between tasks, so a later task of the same segment
    finds it mapped (one object per process: :data:`kept`).

    Mapping a segment afresh costs page faults and an munmap: summing 128 MiB takes
    22 ms through a fresh mapping, 15 ms through a kept one; a fresh shared mapping of
    128 MiB costs a task 7 ms of faults. Three kinds are kept:

    * copy-on-write mappings of the argument copies the tasks received
      (:meth:`hold_copy`). Each task gets its own *holder* of a copy's bytes (an array
      over the mapping): the task's arrays are views of it, and the copy is *released*
      (the parent may pool it, and rewrite it with other bytes) when the holder dies,
      whether the mapping is kept or not. A kept mapping is reused only if no holder of
      an earlier task is alive (a view kept in a global must never see another task's
      writes) and if this worker never wrote into it (no page of it is its own copy,
      ``_segments.written``). Its other pages are the segment's own: they show what the
      parent wrote there last, never a stale snapshot. A shared mapping is never reused
      for a copy.
    * shared mappings of the shared arrays the tasks received (:meth:`keep_shared`):
      every process sees the same pages, no check needed; not those this worker owns
      (handed to it): their views decide when they go.
    * shared mappings of the warm segments the parent lent for results
      (:meth:`attach_lent`), written only when lent again.

    Bounded: at most ``max_bytes`` and ``max_mappings``, least recently used dropped
    first; a mapping written into is dropped once its task is done (the pages it wrote
    are memory of this worker's own); a segment the parent unlinked is dropped at the
    next call (its memory lives as long as a mapping does), or as soon as it is removed
    between tasks; everything is dropped after ``idle_seconds`` without a task. The
    dropping thread (a daemon, started with the first kept mapping) does the latter two.

    Shared arrays are the one kind whose segment the parent may free while this worker
    is idle (copies and lent segments stay in the parent's pool until it has been idle
    as long as the mappings here). While one is kept, the dropping thread watches
    removals from the shared-memory folder (one inotify instance, of which a user may
    have only 128 on some systems), so the memory of a freed array goes at once, not at
    the next task; the watch is given back once nothing is kept. Without a watch, or
    while an anonymous segment is kept (its freeing removes no name from the folder),
    it looks every ``_UNLINKED_SECONDS``.
    """

    _UNLINKED_SECONDS = 0.05  # how often to look for removals without a watch

    def __init__(
        self,
        max_bytes: int = WARM_BYTES,
        max_mappings: int = KEPT_MAPPINGS,
        idle_seconds: float = WARM_IDLE_SECONDS,
        dropping_thread: bool = True,
    ) -> None:
        self.max_bytes = max_bytes
        self.max_mappings = max_mappings
        self.idle_seconds = idle_seconds
        self._dropping_thread = dropping_thread
        self._watch: int | None = None
        self.reset()

    def reset(self) -> None:
        """Keep nothing, as a new process: the after-fork hook of the process's object
        (the mappings, the watch and the dropping thread are the parent's)."""
        if self._watch is not None:
            with contextlib.suppress(OSError):  # this process's copy of the parent's
                os.close(self._watch)
        self._lock = threading.Lock()  # the dropping thread drops mappings too
        # Kept mappings by segment name, least recently used first, e.g.
        # {"sharexec-41-Zm9vYmFy": <_Kept of a Mapping of 134217728 bytes>}.
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self.last_task = 0.0  # time.monotonic() when a task last began or ended
        self._thread_started = not self._dropping_thread
        self._watch = None  # the inotify descriptor, while a shared mapping is kept
        self.polling = False  # a shared mapping is kept but no watch could be had
        self._new_watch = threading.Event()  # wakes the dropping thread for a new watch

    @property
    def watch(self) -> int | None:
        """The descriptor watching removals from the shared-memory folder, if any."""
        return self._watch

    def names(self) -> list[str]:
        """The segments kept, least recently used first."""
        with self._lock:
            return list(self._kept)

    def mapping(self, name: str) -> Mapping | None:
        """The kept mapping of segment ``name``, if any."""
        with self._lock:
            entry = self._kept.get(name)
        return None if entry is None else entry.mapping

    # -- what tasks call -----------------------------------------------------------------

    def hold_copy(self, name: str, size: int, watch: bool = False) -> np.ndarray:
        """A new holder of the bytes of the copy segment ``name`` for one task: a byte
        array over a kept mapping of it if one may be reused, else over a fresh one, kept.

        With ``watch``, removals are watched while it is kept, as for shared arrays: its
        owner may free it while this process is idle (a cluster worker's copy of the
        client's, freed when the client lets go of it), and its memory goes at once.
        """
        import numpy as np  # a call with a buffer: NumPy is needed for it (or loaded already)

        with self._lock:
            self.last_task = time.monotonic()  # first: the dropping thread may start below
            if watch:
                self._watch_removals(True)
            entry = self._reusable(name, max(size, 1))
        if entry is None:
            entry = _Kept(_tracking.attach_private(name, size))
            with self._lock:
                self._keep(name, entry)
        holder = np.frombuffer(entry.mapping, np.uint8)
        with self._lock:
            entry.holders.append(weakref.ref(holder))
            entry.clean = False
        return holder

    def keep_shared(self, mappings: list[Mapping]) -> None:
        """Keep the mappings of the shared segments a call used, for later tasks to find
        mapped (``_tracking.attach_shared``), except those this worker owns."""
        with self._lock:
            for mapping in mappings:
                if mapping.owner is None:
                    entry = self._kept.pop(mapping.name, None)
                    if entry is None or entry.mapping is not mapping:
                        entry = _Kept(mapping)
                    self._keep(mapping.name, entry)
            self.last_task = time.monotonic()
            self._watch_removals(True)

    def attach_lent(self, name: str, size: int) -> Mapping:
        """A shared mapping of the warm segment ``name`` that the parent lent a task to
        write its result into: the one kept from an earlier task it was lent to, else a
        fresh one (every page mapped up front, 2 ms per 64 MiB), kept.

        Kept, it is written only when lent again: the parent lends a segment to one task
        at a time, and it stays the parent's in between (pooled, or a result's).
        """
        with self._lock:
            entry = self._kept.pop(name, None)
        if entry is None or entry.mapping.private or len(entry.mapping) != max(size, 1):
            entry = _Kept(_tracking.attach_lent(name, size))
        elif not _segments.existing([name]):  # freed since
            raise SegmentError(errno.ENOENT, f"lent segment {name!r} is gone")
        with self._lock:
            self._keep(name, entry)
        return entry.mapping

    def after_task(self, released: list[str]) -> None:
        """A task is done: its copies no view holds any more are checked for pages this
        worker wrote (and dropped if so: they are its own memory), else marked clean."""
        with self._lock:
            for name in released:
                entry = self._kept.get(name)
                if entry is None or any(ref() is not None for ref in entry.holders):
                    continue
                entry.clean = not _segments.written(entry.mapping)
                if not entry.clean:
                    del self._kept[name]
            self.last_task = time.monotonic()

    # -- dropping ------------------------------------------------------------------------

    def drop_unlinked(self) -> None:
        """Drop the kept mappings of segments that no longer exist: the parent freed them,
        and only a mapping still holds their memory."""
        with self._lock:
            if not self._kept:
                return
            names = list(self._kept)
            alive = _segments.existing(names)
            for name in names:
                if name not in alive:
                    del self._kept[name]

    def drop_idle(self, now: float) -> float:
        """Drop every kept mapping if no task began or ended for ``idle_seconds`` before
        ``now``, else those of segments freed meanwhile; return the time left until the
        mappings are idle long enough."""
        with self._lock:
            # A deadline, not ``now - last_task``: idle_seconds after the last task is
            # idle long enough, whatever the rounding of a large clock value.
            deadline = self.last_task + self.idle_seconds
            if now >= deadline:
                self._kept.clear()
                self._watch_removals(False)
                return self.idle_seconds
        self.drop_unlinked()
        return deadline - now

    def _reusable(self, name: str, size: int) -> _Kept | None:
        """The kept mapping of ``name`` if it may serve a new task; else None (dropped)."""
        entry = self._kept.pop(name, None)
        if entry is None:
            return None
        if not entry.mapping.private or len(entry.mapping) != size:
            return None  # kept shared (lent before, say): a copy needs a copy-on-write mapping
        if any(ref() is not None for ref in entry.holders):
            return None  # a view of an earlier task lives on it: this task maps its own
        if not entry.clean and _segments.written(entry.mapping):
            return None
        entry.holders = []
        self._kept[name] = entry  # most recently used
        return entry

    def _keep(self, name: str, entry: _Kept) -> None:
        """Keep a fresh mapping, within the bounds (the oldest go first)."""
        if os.path.isabs(name) or len(entry.mapping) > self.max_bytes:
            return  # a file on disk (a fallback, not pooled), or too big to keep
        kept = self._kept
        kept[name] = entry
        total = sum(len(e.mapping) for e in kept.values())
        while total > self.max_bytes or len(kept) > self.max_mappings:
            _, oldest = kept.popitem(last=False)
            total -= len(oldest.mapping)
        if not self._thread_started:
            self._thread_started = True
            thread = threading.Thread(target=self._drop_when_idle, name="sharexec-kept")
            thread.daemon = True
            thread.start()

    def _watch_removals(self, needed: bool) -> None:
        """Take a watch of removals (call with the lock held), or give it back."""
        if needed and self._watch is None:
            self._watch = _segments.removals()
            self.polling = self._watch is None
            self._new_watch.set()
        elif not needed:
            if self._watch is not None:
                os.close(self._watch)
            self._watch, self.polling = None, False

    def _drop_when_idle(self) -> None:
        """The dropping thread: drops kept mappings once idle, and those of freed segments."""
        while True:
            wait = self.drop_idle(time.monotonic())
            with self._lock:
                watch, polling, woken = self._watch, self.polling, self._new_watch
                if any(_segments.anonymous(name) for name in self._kept):
                    wait = min(wait, self._UNLINKED_SECONDS)
            if watch is None:
                woken.wait(min(wait, self._UNLINKED_SECONDS) if polling else wait)
                woken.clear()
                continue
            try:
                readable, _, _ = select.select([watch], [], [], wait)
                if readable:
                    while os.read(watch, 1 << 16):
                        pass
            except (BlockingIOError, OSError, ValueError):
                pass  # read empty, or given back meanwhile: look again


# This process's kept mappings; a forked child starts with none.
kept = KeptMappings()
os.register_at_fork(after_in_child=kept.reset)
