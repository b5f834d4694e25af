"""Pools of warm segments: shared memory whose pages are faulted in already.

A memcpy or a memset into a warm segment runs at memory speed (about 10 GB/s); into fresh
shared pages, at the speed of the kernel's page faults (about 1.6 GB/s). Each executor
keeps a :class:`SegmentPool` of the segments its copies and results no longer need, and
the shared arrays of a process have one of their own (see :mod:`sharexec._arrays`), each
under the same bounds (:func:`pool_limit`, ``WARM_SEGMENTS``, ``WARM_IDLE_SECONDS``).
NumPy-free: only segments and their sizes.

The idle rule, exactly: a segment is freed once it has been in the pool, unused, for
``WARM_IDLE_SECONDS``, at most ``TRIM_SLACK`` later (and however late a timer thread of a
busy machine wakes). A pool that holds segments has one timer, set for the moment its
oldest segment turns idle long enough (the others came in after it, so none is due
before); when it fires it frees every segment due by then and is set again for the next
oldest, at least ``TRIM_SLACK`` ahead (segments put back within ``TRIM_SLACK`` of each
other go together: one wake-up, not one per segment). An empty pool has no timer.
"""

from __future__ import annotations

import shutil
import threading
import time
import weakref

from . import _segments, _session
from ._config import WARM_BYTES, WARM_IDLE_SECONDS, WARM_SEGMENTS
from ._segments import Mapping

__all__ = ["SegmentPool", "pool_limit", "pooled_everywhere"]

# How much later than its due time an idle segment may be freed (see the module's
# docstring): the least time between two wake-ups of a pool's timer.
TRIM_SLACK = 0.05


def pool_limit() -> int:
    """Bytes of warm segments a pool keeps (each executor's, the shared arrays'): a
    quarter of shared memory, at most ``WARM_BYTES``. Shared memory is the shared-memory
    folder, or the process's memory limit where its segments may be anonymous (see
    :func:`_tracking._create`): they do not fill the folder."""
    try:
        total = shutil.disk_usage(_segments.SHM_FOLDER).total
    except OSError:
        total = 0
    if not _session.in_worker() and _segments.anonymous_supported():
        total = max(total, _segments.memory_limit())
    return min(WARM_BYTES, total // 4)


class SegmentPool:
    """Segments no task holds and no other process sees any more, whose pages are
    already faulted in: a memcpy into them runs ~10x faster than into fresh shared pages.

    Bounded in bytes (``limit``), in count (``count``: each pooled segment is a name in
    the shared-memory folder and a mapping here) and in age (``idle_seconds``: a timer
    frees each segment once it has been unused that long, see the module's docstring),
    so an idle executor does not keep its warm segments. A segment dropped from the
    pool is unlinked (its handle is collected). Once closed (the executor shut down or
    collected), nothing comes in any more.
    """

    def __init__(
        self, limit: int, count: int = WARM_SEGMENTS, idle_seconds: float = WARM_IDLE_SECONDS
    ) -> None:
        self._limit = limit
        self._count = count
        self._idle_seconds = idle_seconds
        self._lock = threading.RLock()  # re-entrant: a weakref callback may fire while held
        _pools.add(self)
        # Oldest first, with the time each came in, e.g. [(<Mapping>, 5012.5)], and
        # their total size in bytes, e.g. 8000000.
        self._pool: list[tuple[Mapping, float]] = []
        self._bytes = 0
        self._closed = False
        # Frees the oldest segment when it has been idle long enough (see _trim).
        self._trimmer: threading.Timer | None = None

    def put(self, mapping: Mapping) -> None:
        """A segment is free again (unless the pool is closed: then it is dropped)."""
        with self._lock:
            if not self._closed:
                self._pool.append((mapping, time.monotonic()))
                self._bytes += len(mapping)
                self._trim()

    def take(self, size: int) -> Mapping | None:
        """The smallest pooled segment to hold ``size`` bytes (at most twice as big)."""
        with self._lock:
            self._trim()
            fits = [entry for entry in self._pool if size <= len(entry[0]) <= 2 * size]
            if not fits:
                return None
            entry = min(fits, key=lambda e: len(e[0]))
            self._pool.remove(entry)
            self._bytes -= len(entry[0])
        return entry[0]

    def remove(self, mapping: Mapping) -> None:
        """Take ``mapping`` out of the pool, if it is there."""
        with self._lock:
            self._pool = [e for e in self._pool if e[0] is not mapping]
            self._bytes = sum(len(m) for m, _ in self._pool)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pool)

    def names(self) -> list[str]:
        """Names of the segments in the pool."""
        with self._lock:
            return [m.name for m, _ in self._pool]

    def totals(self) -> tuple[int, int]:
        """How many segments the pool holds now, and their total size in bytes."""
        with self._lock:
            return len(self._pool), sum(len(m) for m, _ in self._pool)

    def clear(self) -> None:
        """Drop every pooled segment; the pool stays open."""
        with self._lock:
            self._pool = []
            self._bytes = 0

    def close(self) -> None:
        """Drop every pooled segment; none comes in any more."""
        with self._lock:
            self._closed = True
            self._pool = []
            self._bytes = 0
            if self._trimmer is not None:
                self._trimmer.cancel()
                self._trimmer = None

    def _trim(self) -> None:
        """Drop pooled segments idle too long, or beyond the limits, and set the timer
        for the next one due (lock held)."""
        now = time.monotonic()
        old = now - self._idle_seconds
        if self._pool and self._pool[0][1] <= old:  # oldest first: any to drop is in front
            self._pool = [(m, t) for m, t in self._pool if t > old]
            self._bytes = sum(len(m) for m, _ in self._pool)
        while self._pool and (self._bytes > self._limit or len(self._pool) > self._count):
            self._bytes -= len(self._pool.pop(0)[0])
        # A timer already set fires no later than the oldest segment is due: the segments
        # that came in since are due after it, and one taken out only makes it early.
        if self._pool and self._trimmer is None and not self._closed:
            due = self._pool[0][1] + self._idle_seconds - now
            self._trimmer = threading.Timer(max(due, TRIM_SLACK), self._trim_later)
            self._trimmer.daemon = True
            self._trimmer.start()

    def _trim_later(self) -> None:
        with self._lock:
            self._trimmer = None
            self._trim()


# Every pool in this process (each executor's, the shared arrays'): the segments this
# process owns less these are the ones that hold live data (statistics()).
_pools: weakref.WeakSet[SegmentPool] = weakref.WeakSet()


def pooled_everywhere() -> tuple[int, int]:
    """Segments in every pool of this process, and their total size."""
    totals = [pool.totals() for pool in list(_pools)]
    return sum(n for n, _ in totals), sum(size for _, size in totals)
