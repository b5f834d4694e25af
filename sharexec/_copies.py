"""What the parent's side keeps of the segments in flight, and its counts.

This module owns the ledgers :class:`sharexec._transport.Transport` is a facade over:
:class:`CopyCache` (which copy holds which bytes of an argument, for which tasks, and who
still holds it; it moves copies in and out of the executor's pool), :class:`ResultLoans`
(the warm segments lent to tasks for their results, and the receiver of every result),
and :class:`Counts` (what ``statistics()`` reports). The forward sink
(``_reduction.ForwardSink``) asks the first for a copy to reuse or a warm segment, and
tells it what it copied; the second lends what the backward sink writes into.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from . import _tracking
from ._reduction import _in_parallel, argument_owner
from ._segments import Mapping
from ._warm import SegmentPool

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CopyCache", "Counts", "ResultLoans"]

_FUNCTIONS_REMEMBERED = 256  # functions whose last result sizes are kept


# ---------------------------------------------------------------------------------------
# Copies in flight: which bytes they hold, for which tasks, and who holds them
# ---------------------------------------------------------------------------------------


@dataclass
class _Remembered:
    """A copy of some bytes (its key in ``CopyCache._copies``), valid for tasks numbered
    below ``valid_below``."""

    ref: weakref.ref[Mapping]
    valid_below: int
    owner: Callable[[], object]  # a weak reference to the object whose bytes were taken


@dataclass(slots=True)
class _Held:
    """A copy held by tasks in flight: how many, and whether every worker that was sent
    it so far released it (no view of it left there)."""

    mapping: Mapping
    tasks: int = 0
    released: bool = True


class CopyCache:
    """Copies alive (held by tasks in flight, or pooled), by the bytes they hold.

    A copy still alive is reused for the same bytes, so submitting one array many times
    holds one copy. It is reused as it is by a task submitted before the copy was made
    (the stdlib would pickle that task later still: any moment between submit and
    dispatch is the task's), and after comparing the bytes for any later task: a changed
    array never reuses a stale copy. ``number`` numbers tasks and comparisons alike.
    """

    def __init__(self, number: Callable[[], int], pool: SegmentPool) -> None:
        self._number = number
        self._pool = pool  # the executor's: copies no task holds wait there for reuse
        # Held while a segment moves between this cache and the pool (a copy reused out
        # of the pool, a pooled segment taken for new bytes): taken before this cache's
        # own lock and the pool's, which are taken one after the other.
        self._exchange = threading.RLock()
        self._lock = threading.RLock()  # re-entrant: a weakref callback may fire while held
        # Copies by the source bytes they hold, e.g.
        # {(140213, 8000000): _Remembered(<weakref to Mapping>, valid_below=17, ...)},
        # and the key of each copy, by the copy's id, e.g. {1401: (140213, 8000000)}.
        self._copies: dict[tuple[int, int], _Remembered] = {}
        self._keys: dict[int, tuple[int, int]] = {}
        # Copies held by tasks in flight, by the copy's id,
        # e.g. {1401: _Held(<Mapping>, tasks=2, released=True)}.
        self._held: dict[int, _Held] = {}

    def reuse(self, raw: memoryview, low: int, task: int | None) -> Mapping | None:
        """A live copy of the bytes ``raw`` that is a valid snapshot of them for ``task``,
        taken out of the pool if it was there (see :meth:`reusable`)."""
        with self._exchange:
            mapping = self.reusable(raw, low, task)
            if mapping is not None:
                self._pool.remove(mapping)
            return mapping

    def take_warm(self, size: int) -> Mapping | None:
        """A pooled segment to hold ``size`` new bytes (at most twice as big), if any; it
        no longer holds the bytes it was remembered for."""
        with self._exchange:
            mapping = self._pool.take(size)
            if mapping is not None:
                self.forget(mapping)
            return mapping

    def reusable(self, raw: memoryview, low: int, task: int | None) -> Mapping | None:
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
        owner = argument_owner(raw)
        if not taken_for(task, remembered.valid_below, owner, remembered.owner):
            compared = self._number()
            if not _same_bytes(low, mapping.address, raw.nbytes):
                return None
            with self._lock:
                remembered.valid_below = compared
                remembered.owner = _weak(owner)
        return mapping

    def remember(self, raw: memoryview, low: int, mapping: Mapping, made: int) -> None:
        """``mapping`` holds the bytes ``raw`` at ``low``, copied after task ``made``."""
        key = (low, raw.nbytes)
        copy_id = id(mapping)

        def forget(ref: weakref.ref[Mapping]) -> None:
            with self._lock:
                self._keys.pop(copy_id, None)
                remembered = self._copies.get(key)
                if remembered is not None and remembered.ref is ref:
                    del self._copies[key]

        owner = _weak(argument_owner(raw))
        with self._lock:
            self._copies[key] = _Remembered(weakref.ref(mapping, forget), made, owner)
            self._keys[copy_id] = key

    def forget(self, mapping: Mapping) -> None:
        """``mapping``'s content is about to change: it holds no remembered bytes now."""
        with self._lock:
            key = self._keys.pop(id(mapping), None)
            remembered = self._copies.get(key) if key is not None else None
            if remembered is not None and remembered.ref() is mapping:
                del self._copies[key]  # type: ignore[arg-type]  # not None: found

    def hold(self, copies: Sequence[Mapping]) -> None:
        """A task in flight now refers to these copies."""
        with self._lock:
            for mapping in copies:
                entry = self._held.get(id(mapping))
                if entry is None:
                    entry = self._held[id(mapping)] = _Held(mapping)
                entry.tasks += 1

    def let_go(self, copies: Sequence[Mapping], released: frozenset[str]) -> None:
        """A task is done; ``released``: the copies its worker no longer maps. The copies
        that no task holds and every worker released go to the pool.

        Any other copy no task holds is dropped (and unlinked). A worker that kept a
        view of its argument (in a global, in its result) keeps the copy out of the
        pool: its content must never change under that view. A file on disk (a
        fallback) is never pooled.
        """
        free = []
        with self._lock:
            for mapping in copies:
                entry = self._held.get(id(mapping))
                if entry is None:
                    continue
                entry.tasks -= 1
                entry.released = entry.released and mapping.name in released
                if entry.tasks == 0:
                    del self._held[id(mapping)]
                    if entry.released and not os.path.isabs(mapping.name):
                        free.append(mapping)
        for mapping in free:  # outside this cache's lock: the pool's is taken alone
            self._pool.put(mapping)


def taken_for(
    task: int | None, taken: int, owner: object, taken_from: Callable[[], object]
) -> bool:
    """The one rule, on both carriers, by which a copy of a task's buffer serves it as it
    is, without comparing its bytes (local) or hashing them (cluster): the copy was taken
    after the task's submit (``task < taken``: numbers of one clock) from the very array
    the task was given as an argument (``owner``, see ``_reduction.argument_owner``;
    ``taken_from`` a weak reference to the array the copy was taken from). The standard
    library would pickle the task later still: any moment between its submit and its
    dispatch is its own. A buffer made while pickling is never trusted (``owner`` None).
    """
    return task is not None and task < taken and owner is not None and taken_from() is owner


def _weak(owner: object) -> Callable[[], object]:
    """A weak reference to ``owner``, or one that is always dead if it cannot have one."""
    try:
        return weakref.ref(owner)
    except TypeError:  # bytes, memoryview…: never trusted, always compared
        return _dead


def _dead() -> None:
    return None


# ---------------------------------------------------------------------------------------
# Results coming back
# ---------------------------------------------------------------------------------------


class ResultLoans:
    """Warm segments lent to tasks for their results, and the receiver of every result.

    A task of a function is lent pooled segments sized after that function's last
    results; its worker writes a large result into one (mapped populated, and kept
    there for the next loan) instead of a fresh segment. Either way the parent owns the
    result's segment and no other process writes it while it holds the result, so a
    result is an ordinary private, writable array; once it is collected, its segment
    joins the pool. A result in a file (spilled) is mapped and unlinked at once.
    """

    def __init__(self, pool: SegmentPool) -> None:
        self._pool = pool
        self._lock = threading.RLock()
        # Sizes of the large buffers each function's last result came back in, by
        # function, e.g. {("app", "render"): [67108864]}: what to lend its next tasks.
        self._sizes: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        # Segments lent to tasks in flight, not yet back in a result, by name,
        # e.g. {"sharexec-41-Zm9v": <Mapping>}.
        self._lent: dict[str, Mapping] = {}

    def lend(
        self, function: tuple[str, str] | None, take: Callable[[int], Mapping | None]
    ) -> list[Mapping]:
        """Warm segments, each from ``take(size)``, for a task of ``function``; none if
        its last results are unknown or nothing fits."""
        with self._lock:
            sizes = self._sizes.get(function) if function is not None else None
        if not sizes:
            return []
        lent = [mapping for mapping in map(take, sizes) if mapping is not None]
        with self._lock:
            for mapping in lent:
                self._lent[mapping.name] = mapping
        return lent

    def take_back(self, lent: Sequence[Mapping]) -> None:
        """A task is done or sent again: the segments lent to it that its result did not
        come back in are free again."""
        for mapping in lent:
            with self._lock:
                unused = self._lent.pop(mapping.name, None) is not None
            if unused:
                self._pool.put(mapping)

    def learn(self, function: tuple[str, str] | None, sizes: list[int]) -> None:
        """``function``'s last result came back in buffers of these sizes."""
        if function is None:
            return
        with self._lock:
            self._sizes[function] = sizes
            self._sizes.move_to_end(function)
            if len(self._sizes) > _FUNCTIONS_REMEMBERED:
                self._sizes.popitem(last=False)

    def receive(self, name: str, size: int) -> Buffer:
        """The buffer a result's segment is rebuilt over (``_wire.Receiver``).

        A lent segment is mapped here already; a fresh one is adopted; both go to the
        pool once the result is collected. A file (spilled) is mapped and unlinked at
        once: never pooled.
        """
        with self._lock:
            mapping = self._lent.pop(name, None)
        if mapping is None:
            if os.path.isabs(name):
                return _tracking.adopt_private(name, size)
            mapping = _tracking.adopt(name, size)
        holder = np.frombuffer(mapping, np.uint8)
        weakref.finalize(holder, _put_back, weakref.ref(self._pool), mapping)
        return cast("Buffer", holder)  # an array is a buffer (numpy's stubs say so from 3.12)

    def discard(self, name: str) -> None:
        """A segment of a result that failed to rebuild: unlinked, unless it is lent
        (then it goes back to the pool when its task is released)."""
        with self._lock:
            lent = name in self._lent
        if not lent:
            _tracking.forget(name)


def _put_back(pool: weakref.ref[SegmentPool], mapping: Mapping) -> None:
    """A result is collected: its segment goes to the pool, or is dropped (and so
    unlinked) if the pool's executor is gone."""
    alive = pool()
    if alive is not None:
        alive.put(mapping)


# ---------------------------------------------------------------------------------------
# Counts
# ---------------------------------------------------------------------------------------


class Counts:
    """What went where, for ``statistics()``, e.g. ``{"bytes_copied": 8000000}``.

    ``bytes_copied``: bytes copied into segments for calls (each memcpy, a gappy view's
    compact copy included); ``bytes_reused``: bytes a call sent from a copy that already
    held them instead (an earlier call's, or an earlier view's of the same pass);
    ``bytes_by_reference``: per call, the bytes of each shared view passed (at most its
    segment's size); ``fallbacks``; ``tasks_submitted``, ``tasks_done``.

    Updated from the user's threads (submit), the feeder thread (the pass) and the
    manager thread (a future done): under a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()

    def add(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._values[what] += n

    def __getitem__(self, what: str) -> int:
        with self._lock:
            return self._values[what]


# ---------------------------------------------------------------------------------------
# Comparing large buffers, on several cores
# ---------------------------------------------------------------------------------------

_COMPARE_CHUNK = 8 << 20  # compare in slices this big: no n-byte temporary


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


def _load_memcmp() -> Callable[[int, int, int], int] | None:
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # pragma: no cover - no libc symbols
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_memcmp = _load_memcmp()
