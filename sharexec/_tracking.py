"""Ownership of segments: who maps what, who frees what, and when.

This module is the only one of a process that unlinks (but for the sweeper process,
which frees what dead processes left, and ``doctor --clean``, which removes stale
segments): a handle collected, or a segment handed to this process that it will never
own (:func:`forget`, :func:`adopt_private`). Its rules:

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
* A process that dies runs no finalizer: the *sweeper* (:mod:`sharexec._sweeper`), a
  small process started by the first process of a session to create a segment, learns of
  every segment as it is created, freed or handed over, and unlinks what a dead process
  still owned. A segment a worker hands over (:func:`hand_off`) is in flight to the
  process its result goes to until that process adopts it (:func:`adopt`): freed if
  that process dies first, or if the executor it was sent for reads no more results
  (:func:`receiver_closed`).

This process's state lives in three objects: ``_owned`` (what it must free), ``_registry``
(its shared mappings) and ``_channel`` (its line to the sweeper), each with its own lock.
Lock order: ``_owned``'s is held while ``_channel``'s is taken; no lock is taken while
``_registry``'s is held (but by a finalizer the garbage collector runs meanwhile).

A forked child inherits all three. Each resets itself in the child with one after-fork
hook (``os.register_at_fork``), registered when this module is imported:

* hooks rather than pid checks at each use, because some resets must happen at the fork
  itself: a child still holding the root's pipe would hide the root's death from the
  sweeper, and a lock held by another thread of the parent would stay held in the child;
* at import rather than at first use, because a registration does nothing until a fork,
  and then touches only this module's state (empty until used), as the standard
  library's own hooks do (``threading``, ``random``, ``logging``); registering at first
  use would need a guard on every path that first makes state. ``import sharexec`` does
  not import this module;
* pid checks remain only where the parent's objects and callbacks live on in the child,
  out of any hook's reach: a segment's handle and its finalizer, and a folder's
  ``atexit`` call, carry their creator's pid, so a forked child never frees its parent's
  segments.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import errno
import logging
import os
import select
import socket
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

from . import _segments, _sweeper
from ._segments import Mapping
from ._sweeper import ADOPT, CLOSED, HAND_OFF, REGISTER, UNREGISTER, WORKER
from .errors import SegmentError, SharexecWarning

__all__ = [
    "SweeperAddress",
    "adopt",
    "adopt_private",
    "attach_held",
    "attach_lent",
    "attach_private",
    "attach_shared",
    "attached_shared",
    "call_holders",
    "check_sweeper",
    "find_shared",
    "forget",
    "hand_off",
    "in_worker",
    "join_sweeper",
    "live",
    "new_private",
    "new_shared",
    "owns",
    "receiver_closed",
    "spilled",
    "sweeper_address",
    "sweeper_lost",
    "warn_fallback",
    "watch_parent",
    "workers_started",
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
        _owned.sizes[name] = size

    def hand_off(self) -> None:
        """Give up ownership: another process will unlink this segment."""
        self._finalizer.detach()
        _owned.sizes.pop(self.name, None)

    @property
    def owned(self) -> bool:
        """Whether this process will unlink the segment (a forked child never does)."""
        return self._finalizer.alive and self.pid == os.getpid()


class _Owned:
    """What this process must free: its segments, and its folders of file-backed ones."""

    def __init__(self) -> None:
        # Its segments now, with their sizes, e.g. {"sharexec-41-Zm9v": 8000000}.
        self.sizes: dict[str, int] = {}
        # Its folders for file-backed segments, by parent folder,
        # e.g. {"/tmp": "/tmp/sharexec-41-k2j3"}; each is removed at exit if empty.
        self.folders: dict[str, str] = {}
        self.lock = threading.Lock()  # one folder per parent, whichever thread spills first
        # The workers this process started, each with a pidfd (a descriptor of that very
        # process: its pid cannot be reused while the pidfd is open) or None without
        # pidfds, e.g. {4711: 12}: told to every new sweeper while they live.
        self.workers: dict[int, int | None] = {}

    def add_workers(self, pids: list[int]) -> list[int]:
        """Note these new workers; forget those that exited. Returns the new ones."""
        with self.lock:
            for pid, pidfd in list(self.workers.items()):
                if pidfd is not None and _exited(pidfd):
                    os.close(pidfd)
                    del self.workers[pid]
            for pid in pids:
                try:
                    self.workers[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue  # gone already
                except (AttributeError, OSError):  # pragma: no cover - no pidfds
                    self.workers[pid] = None
        return [pid for pid in pids if pid in self.workers]

    def live_workers(self) -> list[int]:
        """The workers this process started that have not exited (read only: the lock's
        holder, add_workers, is the one to forget them; a copy, for the same reason)."""
        return [p for p, fd in self.workers.copy().items() if fd is None or not _exited(fd)]

    def spill_folder(self, parent: str) -> str:
        """This process's folder for file-backed segments inside ``parent``, made once."""
        with self.lock:
            folder = self.folders.get(parent)
            if folder is None:
                folder = self.folders[parent] = _segments.new_folder(parent)
                _tell(REGISTER, folder)
                atexit.register(_remove_folder, folder, os.getpid())
        return folder

    def after_fork_in_child(self) -> None:
        """A forked child owns nothing yet: what it inherited is its parent's to free."""
        self.sizes = {}
        self.folders = {}
        self.lock = threading.Lock()
        for pidfd in self.workers.values():
            if pidfd is not None:
                os.close(pidfd)  # this process's copies: its parent's stay open
        self.workers = {}


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (its pidfd reads as ready)."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


_owned = _Owned()
os.register_at_fork(after_in_child=_owned.after_fork_in_child)


def live() -> tuple[int, int]:
    """How many segments this process owns now, and their total size in bytes."""
    sizes = list(_owned.sizes.values())
    return len(sizes), sum(sizes)


def _unlink(name: str, owner_pid: int) -> None:
    _owned.sizes.pop(name, None)
    if os.getpid() == owner_pid:  # never in a forked child, even if it runs the finalizer
        _segments.unlink(name)
        if not _segments.anonymous(name):  # the sweeper never hears of those: see _create
            _tell(UNREGISTER, name)
        logger.debug("unlinked segment %s", name)


def _own(mapping: Mapping) -> Mapping:
    mapping.owner = Segment(mapping.name, len(mapping))
    return mapping


def _create(size: int, spill_to: str | None, content: _segments.Content | None = None) -> Mapping:
    """A new segment owned by this process.

    In shared memory; if that fails (full, too small, missing) and ``spill_to`` is given,
    an anonymous segment (Linux, not in a worker), else file-backed in a private folder
    inside ``spill_to`` (a name that is a path). Not when this process is out of file
    descriptors: the others need one as well.

    A worker's segments never are anonymous: it hands them to the parent (results,
    shared arrays it allocated), and an anonymous segment lives only while its creator
    holds its descriptor, which the worker could not know when to close.
    """
    try:
        return _create_named(_segments.new_name(), size, content)
    except SegmentError as exc:
        if spill_to is None or exc.errno in _segments.OUT_OF_DESCRIPTORS:
            raise
        if not _in_worker and _segments.anonymous_supported():
            try:
                return _own(_segments.create_anonymous(size, content))
            except SegmentError as anonymous_exc:
                if anonymous_exc.errno in _segments.OUT_OF_DESCRIPTORS:
                    raise
                logger.info("%s", anonymous_exc)
        logger.info("%s; spilling to a file in %s", exc, spill_to)
        folder = _owned.spill_folder(spill_to)
        return _create_named(os.path.join(folder, _segments.new_name()), size, content)


def _create_named(name: str, size: int, content: _segments.Content | None = None) -> Mapping:
    _tell(REGISTER, name)  # first: a crash while the space is being reserved leaks nothing
    try:
        return _own(_segments.create(size, name, content))
    except BaseException:
        _tell(UNREGISTER, name)
        raise


def _remove_folder(folder: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # a forked child inherits the atexit call too
        try:
            _segments.unlink(folder)
        except OSError:  # still holds files handed to another process: the sweeper's
            return
        _tell(UNREGISTER, folder)


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
    this worker works for, for its receiver ``token`` (see :func:`receiver_closed`).

    Until that process adopts it (:func:`adopt`), the sweeper holds it in flight to it:
    freed if it dies, or closes ``token``, first.
    """
    owner = mapping.owner
    if isinstance(owner, Segment) and owner.owned:
        owner.hand_off()
        _tell(HAND_OFF, mapping.name, _parent_pid or os.getpid(), token)


def receiver_closed(token: int) -> None:
    """This process will adopt nothing more handed to it for ``token`` (an executor that
    reads no more results): the sweeper frees what is in flight for it, now and later."""
    if _channel.address is not None:  # else no sweeper was ever reached: nothing was sent
        _tell(CLOSED, str(token))


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

    def add(self, mapping: Mapping) -> Mapping:
        """List a shared mapping, until it is collected."""
        start = mapping.address
        with self.lock:
            if start not in self.by_start:  # starts stay unique, even if a callback is late
                bisect.insort(self.starts, start)
            ref = weakref.ref(mapping, partial(self._drop, start))
            self.by_start[start] = ref
            self.by_name[mapping.name] = mapping
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
        mapping = _segments.attach(name, size, private=False)
        if adopt:
            _adopted(mapping)
        mapping = _registry.add(mapping)
    seen = getattr(_registry.attaching, "shared", None)
    if seen is not None:
        seen.append(mapping)
    return mapping


@contextlib.contextmanager
def attached_shared(holders: dict[str, Any] | None = None) -> Iterator[list[Mapping]]:
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


def call_holders() -> dict[str, Any] | None:
    """Inside :func:`attached_shared` with holders: the holders of the segments, by name,
    over which this thread rebuilds shared views (``_arrays.rebuild_shared``)."""
    holders: dict[str, Any] | None = getattr(_registry.attaching, "holders", None)
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
    _segments.unlink(name)
    _tell(UNREGISTER, name)


def adopt(name: str, size: int) -> Mapping:
    """Map a segment another process filled for us alone and handed to us: ours to free."""
    return _adopted(_segments.attach(name, size, private=False))


def _adopted(mapping: Mapping) -> Mapping:
    """``mapping``'s segment, handed to this process, is its own to free now: the
    sweeper frees it if this process dies (not when the session ends)."""
    _own(mapping)
    _tell(ADOPT, mapping.name)
    return mapping


def adopt_private(name: str, size: int) -> Mapping:
    """Map a segment another process filled for us alone, then unlink it at once.

    The mapping keeps the memory; no other process can reach it any more, so the result
    it holds has private semantics and cannot leak.
    """
    mapping = _segments.attach(name, size, private=False)
    _segments.unlink(name)
    _tell(UNREGISTER, name)
    logger.debug("adopted and unlinked segment %s", name)
    return mapping


# ---------------------------------------------------------------------------------------
# Telling the sweeper: so that what a dead process owned is freed
# ---------------------------------------------------------------------------------------
#
# The first process of a session to create a segment (the *root*, usually the program
# running the executor) starts the sweeper (sharexec._sweeper, which describes the
# protocol), and tells it through its own end of a socket pair; every other process tells
# it through a Unix socket whose address it receives when it starts and with its tasks
# (join_sweeper).
#
# A sweeper can die (killed, OOM-killed, or by a program's cleanup of its children). The
# root restarts it, whoever notices first: the root, when its line breaks; a worker,
# when its line breaks or it cannot connect: it tells the root with its next result
# (sweeper_lost, check_sweeper). The new sweeper listens at the same address if it can
# (else at a new one, which workers receive with their next task); each process that
# opens a new line announces first everything it still owns, so the crash sweep holds
# again. Meanwhile nothing fails: what is told goes nowhere.

# Send with MSG_NOSIGNAL: a dead sweeper is an EPIPE, never a SIGPIPE (for a program
# that restored SIGPIPE's default action, that would kill it).
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
# A line whose other end is gone: the sweeper died (only then may a line be dropped: a
# live sweeper would take a closed connection for its process's death, and sweep all it
# was told).
_GONE = frozenset({errno.EPIPE, errno.ECONNRESET})
_RESTART_AFTER = 1.0  # a sweeper that dies sooner than this after its start: back off
_BACKOFF_MAX = 30.0  # seconds between restarts, at most


class _Channel:
    """This process's line to the sweeper, and the lines waiting to go through it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: a finalizer may tell while it is held
        # The sweeper's socket address (Linux abstract namespace), e.g.
        # b"\0sharexec-sweeper-9f86d081884c7d659a2feaa0"; None until this process starts
        # a sweeper (the root) or joins one (the others). With it, its generation: in
        # the root, the number of sweepers it started, e.g. 1; in the others, that of
        # the address they were given.
        self.address: bytes | None = None
        self.generation = 0
        # The line: in the root, its end of the sweeper's stdin; in the others, a
        # connected socket; None until the first event, and while the sweeper cannot be
        # reached (a failed connection is not kept: tried again at each event).
        self.line: socket.socket | None = None
        self.outbox: list[bytes] = []  # lines not sent yet, e.g. [b"R sharexec-41-Zm9v\n"]
        self.sending = False  # the thread holding the lock is opening the line or sending
        self.root = False  # this process started the session's sweeper, and restarts it
        self.told = False  # it opened a line once: a new sweeper must hear from it
        self.lost = False  # not the root: its line broke, or it could not connect
        self.sweeper_pid = 0  # in the root, the sweeper's pid, e.g. 4242
        self.started = 0.0  # in the root, when it started the sweeper (time.monotonic())
        self.backoff = 0.0  # in the root, seconds to wait after a start before the next

    def tell(self, op: str, name: str, *before: int) -> None:
        """Tell the sweeper about a segment, starting or joining one first if needed.

        Re-entrant: the garbage collector may run a segment's finalizer (which tells the
        sweeper) in the middle of this very method; that line is queued and sent by the
        outer call, never waited for (a plain lock would deadlock the thread).

        A sweeper that is gone hears nothing, and nothing is raised: what is lost is the
        sweep after a crash, never a task; the root starts a new one.
        """
        with self.lock:
            self.outbox.append(_sweeper.encode(op, name, *before))
            self._flush()

    def reach(self) -> tuple[bytes, int]:
        """The sweeper's address and its generation, after starting it if this process
        is the root (the address is made even if the start failed: tried again later)."""
        address, line = self.address, self.line
        if line is not None and address is not None:  # every task asks: no lock then
            return address, self.generation
        with self.lock:
            self._flush()
            if self.address is None:  # could not start: an address for the next try
                self.address = _new_address()
            return self.address, self.generation

    def join(self, address: bytes | None, generation: int) -> None:
        """In a process that is not the root: tell the sweeper at ``address`` (None: the
        one this process knows already, inherited at a fork). If the root started a new
        one, or this process lost its line, connect now (if it ever told anything): the
        sweeper must learn what it owns before it dies."""
        with self.lock:
            if self.root:
                return  # the root itself (an executor's task run here): its own line
            if address is not None and (address, generation) != (self.address, self.generation):
                # The root started a new sweeper: the line to the old one is dead (or,
                # if this process opened it only since, the new one's).
                if self.line is not None and _dead(self.line):
                    self._drop()
                self.address, self.generation = address, generation
            if self.address is not None and self.line is None and (self.told or self.lost):
                self._flush()

    def check(self) -> None:
        """In the root: a worker could not reach the sweeper; restart it if it is gone."""
        with self.lock:
            if not self.root:
                return
            if self.line is not None and _dead(self.line):
                self._drop()
            self._flush()

    def _flush(self) -> None:
        """Open the line if need be and send what is queued (holding the lock)."""
        if self.sending:
            return  # a finalizer ran inside this thread's own call, which sends its line
        self.sending = True
        reopened = False
        try:
            line = self._open()
            while self.outbox:
                data = b"".join(self.outbox)
                self.outbox.clear()
                if line is None:
                    continue  # out of reach: dropped, as lines sent to a dead sweeper are
                try:
                    line.sendall(data, _NOSIGNAL)
                except OSError as exc:
                    if exc.errno not in _GONE:
                        continue  # a live sweeper missed these lines: keep the line
                    self._drop()  # the sweeper is gone: a new line, a new announcement
                    if not reopened:  # once per call: a new line that breaks too, later
                        reopened = True
                        self.outbox.append(data)  # after it: in order, whatever was lost
                        line = self._open()
                    else:
                        line = None
        finally:
            self.sending = False

    def _open(self) -> socket.socket | None:
        """The line, opened first if need be: in the root by starting the sweeper, in the
        others by connecting to it (None if that fails). A new line starts with what
        this process still owns: a new sweeper must know it."""
        if self.line is not None:
            return self.line
        if self.address is None or self.root:
            self._start()
        else:  # a worker, or a forked child
            self.line = _connect(self.address)
            self.lost = self.line is None
        if self.line is not None:
            self.outbox[:0] = self._announcement()
            self.told = True
        return self.line

    def _start(self) -> None:
        """Start the sweeper (again, if this process started one that died), unless it
        died so soon after its start that it must wait; a failure fails nothing."""
        now = time.monotonic()
        if self.root and now < self.started + self.backoff:
            return  # it died fast: perhaps it cannot run here; try again later
        if self.sweeper_pid:  # it is dead: reap it
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(self.sweeper_pid, os.WNOHANG)
            lived = now - self.started
            self.backoff = (
                0.0 if lived >= _RESTART_AFTER else min(max(0.1, 2 * self.backoff), _BACKOFF_MAX)
            )
            logger.warning("the sweeper (pid %d) is gone; starting a new one", self.sweeper_pid)
        self.root = True
        self.started = now
        try:
            address, self.sweeper_pid, self.line = _start_sweeper(self.address)
        except OSError as exc:  # out of descriptors or processes: no sweep until later
            logger.warning("cannot start the sweeper: %s", exc)
            self.sweeper_pid = 0
            self.backoff = max(self.backoff, _RESTART_AFTER)
            return
        self.address = address
        self.generation += 1

    def _announcement(self) -> list[bytes]:
        """What this process says first on a new line: its live workers, and what it
        still owns (copies of the dicts: a finalizer may change them meanwhile)."""
        lines = [_sweeper.encode(WORKER, str(pid)) for pid in _owned.live_workers()]
        owned = [*_owned.folders.copy().values(), *_owned.sizes.copy()]
        lines.extend(_sweeper.encode(REGISTER, name) for name in owned)
        return lines

    def _drop(self) -> None:
        """Close the line: the sweeper at its other end is gone (never call this while it
        lives: it would sweep all this process owns)."""
        if self.line is not None:
            self.line.close()
            self.line = None

    def after_fork_in_child(self) -> None:
        """A forked child tells the same sweeper on a line of its own, opened when needed.

        It closes its copy of its parent's line at once: a child holding the root's line
        open would hide the root's death from the sweeper, and one holding a worker's
        connection, that worker's. The parent's queued lines are the parent's to send.
        """
        if self.line is not None:
            self.line.close()  # this process's descriptor only: the parent's stays open
        self.line = None
        self.lock = threading.RLock()
        self.outbox = []
        self.sending = False
        self.root = self.told = self.lost = False
        self.sweeper_pid = 0  # the sweeper is the root's child, not this one's


_channel = _Channel()
os.register_at_fork(after_in_child=_channel.after_fork_in_child)


def _tell(op: str, name: str, *before: int) -> None:
    _channel.tell(op, name, *before)


def sweeper_address() -> tuple[bytes, int]:
    """The address workers use to reach this session's sweeper (started if needed), and
    its generation: a new one after a restart."""
    return _channel.reach()


def join_sweeper(address: bytes | None, generation: int = 0) -> None:
    """In a worker: report to the root's sweeper rather than start one of its own (and to
    the new one, once the root started one again)."""
    _channel.join(address, generation)


def workers_started(pids: list[int]) -> None:
    """This process started these workers: the sweeper ends them if they outlive the
    root by its grace period (stopped, stuck: they cannot exit by themselves)."""
    for pid in _owned.add_workers(pids):
        _tell(WORKER, str(pid))


def sweeper_lost() -> bool:
    """Whether this process (not the root) could not reach the sweeper at its last try."""
    return _channel.lost


def check_sweeper() -> None:
    """A worker could not reach the sweeper: in the root, restart it if it is gone."""
    _channel.check()


class SweeperAddress:
    """Stands for the session's sweeper among a worker's start-up arguments.

    Pickled (spawn, forkserver, loky's start method), it carries the sweeper's address as
    it is then, starting the sweeper if need be; inherited (fork), the child's channel
    knows the address already (the executor reached the sweeper before its workers
    start). So whatever the worker's initializer creates is the root's sweeper's to
    sweep, not that of a sweeper of the worker's own.
    """

    def __init__(self, address: bytes | None = None, generation: int = 0) -> None:
        self.address = address
        self.generation = generation

    def __reduce__(self) -> tuple[type[SweeperAddress], tuple[bytes, int]]:
        return SweeperAddress, sweeper_address()

    def join(self) -> None:
        """In a new worker: join the session's sweeper."""
        join_sweeper(self.address, self.generation)


def _dead(line: socket.socket) -> bool:
    """Whether the sweeper at the other end of ``line`` is gone: it never sends anything,
    so a line that reads as ready has reached its end."""
    return _exited(line.fileno())


def _connect(address: bytes) -> socket.socket | None:
    """A connection to the sweeper listening at ``address``; None if there is none."""
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(address)
        except BaseException:
            conn.close()
            raise
    except OSError as exc:  # refused: the sweeper is gone (or no descriptor is left)
        logger.debug("cannot reach the sweeper: %s", exc)
        return None
    return conn


def _new_address() -> bytes:
    return b"\0sharexec-sweeper-" + os.urandom(12).hex().encode()


def _start_sweeper(address: bytes | None) -> tuple[bytes, int, socket.socket]:
    """Start this session's sweeper, listening at ``address`` if it is free, else at a
    new one: its address, its pid, and the root's end of its stdin."""
    # The sweeper imports this package from where it lies, and nothing from site-packages
    # (-S: no site processing, a few ms less of a start that competes with the first
    # workers'; most of the rest is importing _segments, whose errors module loads
    # concurrent.futures.process).
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    # Not from the working directory either, which -c puts first on sys.path: a
    # socket.py there would stand in for the standard library's.
    code = (
        "import sys; sys.path[:] = [p for p in sys.path if p]; "
        "from sharexec._sweeper import sweeper_main; "
        f"sweeper_main({float(_sweeper.WAIT_FOR_MEMBERS)!r}, {os.getpid()})"
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:  # the sweeper's fd 3
        try:
            listener.bind(address or _new_address())
        except OSError:  # taken (say, by a forked child holding the dead one's listener)
            address = _new_address()
            listener.bind(address)
        address = listener.getsockname()
        listener.listen(64)
        line, sweeper_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-S", "-c", code],
                env,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, sweeper_end.fileno(), 0),
                    (os.POSIX_SPAWN_DUP2, listener.fileno(), _sweeper.LISTENER_FD),
                ],
                setsid=True,  # out of the terminal's process group: Ctrl-C is for the root
            )
        except BaseException:
            line.close()
            raise
        finally:
            sweeper_end.close()
    logger.debug("started the sweeper")
    return address, pid, line


# ---------------------------------------------------------------------------------------
# Workers die with their parent
# ---------------------------------------------------------------------------------------


_in_worker = False  # set by watch_parent, in every worker as it starts
_parent_pid = 0  # there, the process it works for: what it hands over goes to it


def in_worker() -> bool:
    """Whether this process is a worker of a sharexec executor (or a child of one)."""
    return _in_worker


def watch_parent(parent_pid: int) -> None:
    """In a worker: exit at once if ``parent_pid`` dies, instead of running its queue."""
    global _in_worker, _parent_pid
    _in_worker = True
    _parent_pid = parent_pid
    if not hasattr(os, "pidfd_open"):  # pragma: no cover - not Linux
        return
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the process has exited
        os._exit(1)

    threading.Thread(target=watch, name="sharexec-watch-parent", daemon=True).start()
