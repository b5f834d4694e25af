"""Blobs: bytes sent to the cluster once, one copy per host.

A large buffer of a call travels as a blob (:class:`_HostBytes`), recognised by the
SHA-256 of its bytes (:func:`_digest`, copied while hashed where it is new); on each host,
the first worker to receive it keeps it in a sharexec segment, and the others of that
host map that segment by name (:func:`_arrive`); a buffer of zeros travels as its length.
Used by both sides: the client makes blobs, a Dask worker rebuilds them.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import (
    ThreadPoolExecutor,
)
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np

from .. import _kept, _segments, _tracking
from ..errors import SegmentError

if TYPE_CHECKING:
    pass


# Hashed on several threads above this size (SHA-256 runs at about 1.4 GB/s a core).
_HASH_PIECE = 32 << 20

# Copied and hashed a step at a time (see _digest): a step stays in the cache between.
_STEP = 1 << 20


def _host() -> str:
    """What tells hosts apart: the boot, and the shared-memory folder's file system (two
    workers in private /dev/shm mounts are two hosts)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    st = os.stat(_segments.SHM_FOLDER)
    return f"{boot}:{st.st_dev}:{st.st_ino}"


# Bytes as they arrive or are held: a buffer received (out of band), or a mapping.
_Bytes = bytes | bytearray | memoryview | pickle.PickleBuffer | _segments.Mapping


class _HostBytes:
    """The bytes of one large buffer, as the cluster holds them.

    In the client, either the bytes were copied into a sharexec segment ``name`` the
    client owns (``owner``), for the workers of the client's own host, which map it by
    name (only the name travels: ``local``); or ``data`` is the user's buffer, read when
    Dask pickles it (at scatter), for a cluster with no worker on the client's host.
    In a worker, the bytes live in the sharexec segment ``name`` on this host: created and
    owned by this process (``owner``, the handle that unlinks it), or another process's,
    kept alive by ``held``, a mapping never touched. When neither is possible (shared
    memory full), ``data`` holds the bytes in this process.
    """

    __slots__ = (
        "__weakref__",
        "by_name",
        "data",
        "digest",
        "held",
        "local",
        "name",
        "owner",
        "size",
        "zeros",
    )

    def __init__(
        self,
        digest: bytes,
        size: int,
        data: bytes | memoryview | None = None,
        name: str | None = None,
        owner: object = None,
        held: _segments.Mapping | None = None,
    ) -> None:
        self.digest = digest  # e.g. b"\x9f\x86…" (SHA-256 of the bytes and their length)
        self.size = size
        self.data = data
        self.name = name
        self.owner = owner
        self.held = held
        self.local = False  # the client's copy, for its host's workers: the name alone
        self.zeros = False  # the bytes are all zeros: only their length travels
        # The client's copy, in the tasks themselves where every worker is on the client's
        # host: only the name travels, wherever it goes (the scheduler unpickles a task
        # and pickles it again for a worker), and a task maps it by name.
        self.by_name = False

    @classmethod
    def of_zeros(cls, size: int) -> _HostBytes:
        """``size`` zero bytes (a fresh output, say): no copy anywhere, sent in the task."""
        blob = cls(b"", size)
        blob.zeros = True
        return blob

    @classmethod
    def named(cls, digest: bytes, size: int, name: str) -> _HostBytes:
        """The client's copy ``name`` of ``size`` bytes, mapped only by the task using it."""
        blob = cls(digest, size, name=name)
        blob.by_name = True
        return blob

    def __reduce_ex__(
        self, protocol: SupportsIndex
    ) -> tuple[Callable[..., _HostBytes], tuple[object, ...]]:
        if self.zeros:
            return _HostBytes.of_zeros, (self.size,)
        if self.by_name:
            return _HostBytes.named, (self.digest, self.size, self.name)
        if self.local:
            return _arrive, (self.digest, self.size, _host(), self.name, None)
        source = self.data if self.name is None else self._mapped()
        assert source is not None  # the user's buffer, or a segment of this host
        buffer = pickle.PickleBuffer(source) if int(protocol) >= 5 else bytes(source)
        return _arrive, (self.digest, self.size, _host(), self.name, buffer)

    def _mapped(self) -> _segments.Mapping | None:
        """The bytes, for a worker sending them: the segment mapped for this once (the
        frames keep it alive until sent), so that the held mapping stays untouched (no
        resident memory); the held one if the segment's owner on this host let it go."""
        try:
            return _tracking.attach_held(self.name, self.size)  # type: ignore[arg-type]
        except SegmentError:
            return self.held

    def private(self) -> np.ndarray | bytearray:
        """A writable buffer of the bytes whose writes stay this caller's: of bytes in a
        segment, a copy-on-write mapping, kept for this process's next task while no task
        wrote into it (the local workers' KeptMappings; dropped once the segment goes)."""
        if self.zeros:  # pages of zeros, each made when first written
            return np.zeros(self.size, np.uint8)
        if self.name is None:
            assert self.data is not None  # bytes neither in a segment nor zeros
            return bytearray(self.data)
        try:
            return self._hold_copy(self.name)
        except SegmentError as exc:
            if self.by_name:
                raise SegmentError(
                    f"the client's copy of a {self.size}-byte argument, {self.name}, cannot "
                    f"be mapped here: {exc}"
                ) from exc
        with _here_lock:  # its owner on this host let it go: make this one the owner
            if self.owner is None:
                self._rehome()
        if self.name is None:  # shared memory short: the bytes are in this process
            assert self.data is not None
            return bytearray(self.data)
        return self._hold_copy(self.name)

    def _hold_copy(self, name: str) -> np.ndarray:
        holder: np.ndarray = _kept.kept.hold_copy(name, self.size, watch=True)
        return holder

    def _rehome(self) -> None:
        """Copy the bytes held into a segment of this process's (under _here_lock)."""
        assert self.held is not None  # not the owner: it holds the owner's segment
        mine = _copy_in(self.digest, self.size, self.held)
        self.name, self.owner, self.held = mine.name, mine.owner, mine.held
        if self.name is None:  # shared memory short: the bytes stay in this process
            self.data = mine.data


# This process's blobs by digest, e.g. {b"\x9f\x86…": <_HostBytes>}: a blob received
# again (under another key) is not copied again.
_here: weakref.WeakValueDictionary[bytes, _HostBytes] = weakref.WeakValueDictionary()
_here_lock = threading.Lock()


def _arrive(
    digest: bytes, size: int, host: str, name: str | None, buffer: _Bytes | None
) -> _HostBytes:
    """Unpickled in a worker: the blob over this host's one copy of ``buffer``'s bytes
    (``buffer`` None: the client of this host sent the name of its copy alone)."""
    _register_sizeof()
    with _here_lock:
        known = _here.get(digest)
    if known is not None:
        return known
    blob = None
    if name is not None and host == _host():  # a process of this host sent its copy
        try:
            blob = _HostBytes(digest, size, name=name, held=_tracking.attach_held(name, size))
        except SegmentError as exc:
            if buffer is None:
                raise SegmentError(
                    f"the client's copy of a {size}-byte argument, {name}, is gone: {exc}"
                ) from exc
    if blob is None:
        if buffer is None:
            raise SegmentError(f"{name}, the client's copy of an argument, is on another host")
        blob = _copy_in(digest, size, buffer)
    with _here_lock:
        return _here.setdefault(digest, blob)


def _copy_in(digest: bytes, size: int, buffer: _Bytes) -> _HostBytes:
    """A worker's blob of ``buffer``'s bytes: in a segment of its own, held."""
    data = memoryview(buffer).cast("B")
    try:
        name, owner = _in_segment(size, lambda write: write(0, data))
    except SegmentError:  # shared memory short: the bytes stay in this process
        return _HostBytes(digest, size, data=bytes(data))
    return _HostBytes(digest, size, name=name, owner=owner, held=_tracking.attach_held(name, size))


def _in_segment(size: int, content: _segments.Content) -> tuple[str, object]:
    """A new segment this process owns, holding what ``content`` writes: its name and its
    owner. The bytes are written into the segment's file (each page allocated and filled
    at once, about twice as fast as a copy through a fresh mapping) and never mapped here,
    so they stay in no process's resident set. SegmentError when shared memory is short.
    """
    mapping = _tracking.new_private(size, content=content)
    name, owner = mapping.name, mapping.owner
    mapping.close()
    return name, owner


def _sizeof(blob: _HostBytes) -> int:
    """What Dask counts for a blob in a worker: its handle, not the host's one copy."""
    return 200


_sizeof_registered = False


def _register_sizeof() -> None:
    """Tell Dask's ``sizeof`` about blobs, once per process (client and workers)."""
    global _sizeof_registered
    if not _sizeof_registered:
        from dask.sizeof import sizeof

        register: Any = sizeof.register  # untyped
        register(_HostBytes)(_sizeof)
        _sizeof_registered = True


def _zeros(data: memoryview) -> bool:
    """Whether the bytes are all zeros, read a step at a time: other bytes are most often
    found in the first step."""
    values = np.frombuffer(data, np.uint8)
    return not any(values[at : at + _STEP].any() for at in range(0, values.size, _STEP))


def _digest(data: memoryview, write: Callable[[int, memoryview], None] | None = None) -> bytes:
    """SHA-256 of the bytes (of pieces hashed on several threads, for large ones).

    With ``write``, the bytes are also copied (``write(offset, step)``) a step at a time,
    each step hashed after it is written, while it is still in the cache: one read of
    the bytes from memory for both.
    """
    n = data.nbytes

    def piece(start: int) -> bytes:
        end = min(start + _HASH_PIECE, n)
        h = hashlib.sha256()
        for at in range(start, end, _STEP):
            step = data[at : min(at + _STEP, end)]
            if write is not None:
                write(at, step)
            h.update(step)
        return h.digest()

    starts = range(0, max(n, 1), _HASH_PIECE)
    threads = min(len(starts), os.cpu_count() or 1)
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="sharexec-digest") as pool:
            parts = list(pool.map(piece, starts))
    else:
        parts = [piece(start) for start in starts]
    return hashlib.sha256(b"".join(parts) + n.to_bytes(8, "little")).digest()
