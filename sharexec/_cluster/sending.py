"""What the cluster executor sent: blobs by digest, and when to let go of them.

The client sends each large buffer of a call once (``blobs``): recognised by the
SHA-256 of its bytes (an argument whose bytes were hashed after the call's submit is
served that blob without hashing again), copied for the workers of the client's host
while it is hashed when it is new, scattered to Dask otherwise. A blob is kept while a
call holds it or an object it came from lives (a resubmit finds it again), and released
after.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from functools import partial

import numpy as np

from .._copies import taken_for
from .._reduction import argument_owner, buffer_owner
from ..errors import SegmentError
from .blobs import _digest, _host, _HostBytes, _in_segment, _zeros
from .dask_api import DaskClient, DaskFuture


class _Sent:
    """A blob on the cluster: its Dask future, the calls holding it, and the objects
    whose bytes it holds (while one lives, a resubmit may find it again); ``copy``, the
    client's copy of its bytes for the workers of its host (None: sent as bytes).

    Where every worker shares the client's host, nothing is given to Dask (``future``
    None): each task that uses the blob carries the copy's name itself (``given``).
    """

    __slots__ = ("calls", "copy", "future", "size", "sources")

    def __init__(self, future: DaskFuture | None, copy: _HostBytes | None, size: int) -> None:
        self.future = future
        self.copy = copy  # freed (its segment unlinked) with this record
        self.size = size  # of the bytes, e.g. 200_000_000
        self.calls = 0
        self.sources: list[weakref.ref[object]] = []

    @property
    def given(self) -> DaskFuture | _HostBytes | None:
        """What a task is given for the blob: its Dask future, or the copy's name."""
        return self.copy if self.future is None else self.future

    def release(self) -> None:
        if self.future is not None:
            with contextlib.suppress(Exception):  # (its client closed: nothing to free)
                self.future.release()


class _Read:
    """When an object's bytes were last hashed, and what they were: the call's arguments
    submitted before then may be served that blob without hashing again."""

    __slots__ = ("address", "at", "digest", "nbytes", "source")

    def __init__(self, source: weakref.ref[object], address: int, nbytes: int, at: int) -> None:
        self.source = source
        self.address = address  # e.g. 140213466341392: where the bytes were
        self.nbytes = nbytes
        self.at = at  # the executor's clock when the hash began, e.g. 17
        self.digest = b""


def _address(data: memoryview) -> int:
    address: int = np.frombuffer(data, np.uint8).__array_interface__["data"][0]
    return address


class Sender:
    """What one executor sent to the cluster: each blob by the digest of its bytes, the
    calls holding it and the objects it came from; when the bytes of an argument were
    last hashed (:class:`_Read`); what it cost (``bytes_sent``, ``bytes_reused``,
    ``fallbacks``).

    Its state is guarded by the executor's ``lock`` (a blob is let go of when a call
    finishes, under it too). Once ``shut_down``, a blob no call holds is released even
    if the object it came from lives.
    """

    def __init__(self, client: DaskClient, token: str, lock: threading.RLock) -> None:
        self._client = client
        self._direct = getattr(client, "direct_to_workers", None) is not False
        self._token = token
        self._lock = lock
        self._keys = itertools.count()
        self._clock = itertools.count()  # orders submits and reads of bytes
        self.sent: dict[bytes, _Sent] = {}  # blobs on the cluster by digest
        self.bytes_sent = 0  # the bytes of every blob sent, e.g. 200_000_000
        self.bytes_reused = 0  # of arguments served a blob sent before
        self.fallbacks = 0  # copies for this host's workers that shared memory refused
        # When the bytes of each argument array were last hashed, by id of the array,
        # e.g. {140213: <_Read of 17>}.
        self._read: dict[int, _Read] = {}
        # (when counted, the workers on this host, whether they are all the cluster's)
        self._local: tuple[float, list[str], bool] = -2.0, [], False
        self.shut_down = False

    def now(self) -> int:
        """The clock: a call is stamped at its submit, a hash at its start."""
        return next(self._clock)

    def given(self, blob: bytes | _HostBytes) -> DaskFuture | _HostBytes | None:
        """What a task is given for one of its blobs (under the lock)."""
        return self.sent[blob].given if isinstance(blob, bytes) else blob

    def let_go(self, blobs: list[bytes | _HostBytes]) -> None:
        """A call that held ``blobs`` is done (under the lock)."""
        for blob in blobs:
            if isinstance(blob, bytes) and (sent := self.sent.get(blob)) is not None:
                sent.calls -= 1
                self._maybe_release(blob, sent)

    def release_all(self) -> None:
        """The executor is closing: release every blob."""
        with self._lock:
            sent, self.sent = list(self.sent.values()), {}
            self._read = {}
        for s in sent:
            s.release()

    def send(self, data: memoryview, since: int) -> bytes | _HostBytes:
        """The digest of ``data``'s bytes (a buffer of a call submitted at ``since``), now
        on the cluster (sent unless they were); or, if they are all zeros, a blob that
        says so, to travel in the task."""
        source = buffer_owner(data)
        argument = argument_owner(data)  # ``source``, if the call was given it
        address = _address(data)
        with self._lock:
            read = self._read.get(id(source))
            if (  # the local executor's rule for trusting a copy (_copies.taken_for)
                read is not None
                and (read.address, read.nbytes) == (address, data.nbytes)
                and read.digest in self.sent
                and taken_for(since, read.at, argument, read.source)
            ):
                self.sent[read.digest].calls += 1
                self.bytes_reused += data.nbytes
                return read.digest
            at = next(self._clock)
        if _zeros(data):
            with self._lock:
                self._now_holds(source, None)
            return _HostBytes.of_zeros(data.nbytes)
        digest, copy = self._hash(data)
        with self._lock:
            sent = self.sent.get(digest)
            if sent is None:
                sent = self.sent[digest] = self._scatter(digest, data, copy)
                self.bytes_sent += data.nbytes
            else:
                self.bytes_reused += data.nbytes
            sent.calls += 1
            self._now_holds(source, digest)
            with contextlib.suppress(TypeError):  # not weakly referable: no reuse by source
                if not any(ref() is source for ref in sent.sources):
                    sent.sources.append(weakref.ref(source, partial(self._source_gone, digest)))
                if argument is not None:
                    ref = weakref.ref(source, partial(self._read_gone, id(source)))
                    self._read[id(source)] = read = _Read(ref, address, data.nbytes, at)
                    read.digest = digest
        return digest

    def _now_holds(self, source: object, digest: bytes | None) -> None:
        """``source`` holds the bytes ``digest`` now (None: zeros), so no other blob is kept
        for it any more (under self._lock)."""
        for other, held in list(self.sent.items()):
            if other != digest:
                held.sources = [r for r in held.sources if r() is not source]
                self._maybe_release(other, held)

    def _hash(self, data: memoryview) -> tuple[bytes, tuple[str, object] | None]:
        """The digest of ``data``'s bytes; and the client's copy of them for the workers of
        its host (name and owner of a segment, see _in_segment), written as they are
        hashed, when they are sure to be sent: no blob of their length is on the cluster
        (the digest covers the length), and workers share this host."""
        with self._lock:
            known = any(sent.size == data.nbytes for sent in self.sent.values())
        if known or not self.local_workers():
            return _digest(data), None
        digests: list[bytes] = []
        try:
            copy = _in_segment(data.nbytes, lambda write: digests.append(_digest(data, write)))
        except SegmentError:  # shared memory short: sent as bytes (see _scatter)
            return _digest(data), None
        return digests[0], copy

    def _scatter(self, digest: bytes, data: memoryview, copy: tuple[str, object] | None) -> _Sent:
        """Put ``data``'s bytes on the cluster, as the blob ``digest`` (under self._lock).

        When workers share the client's host, the bytes are copied once into a segment
        of the client's (``copy``, if made already while hashing), and those workers get
        its name (the copy costs one memcpy, not a trip through a socket per worker). If
        they are all the cluster's workers, the name goes in each task that uses the
        blob, and nothing goes to Dask. Otherwise Dask holds the blob: those workers get
        the name, and a worker elsewhere gets the bytes from one of those. Without a
        worker on the client's host, the bytes go to one worker (Dask moves them on).
        """
        key = f"{self._token}-blob-{next(self._keys)}"
        local, everyone = self.local_workers(), self._local[2]
        if local and copy is None:
            try:
                copy = _in_segment(data.nbytes, lambda write: write(0, data))
            except SegmentError:  # shared memory short: as bytes
                self.fallbacks += 1
        if not local or copy is None:  # (a copy made while hashing, for workers gone since,
            blob = _HostBytes(digest, data.nbytes, data)  # is freed)
            blobs = self._client.scatter({key: blob}, hash=False, direct=self._direct)
            return _Sent(blobs[key], None, data.nbytes)
        name, owner = copy
        mine = _HostBytes(digest, data.nbytes, name=name, owner=owner)
        if everyone:
            mine.by_name = True
            return _Sent(None, mine, data.nbytes)
        mine.local = True
        # Broadcast: Dask would move the blob between the workers of this host as bytes.
        blobs = self._client.scatter(
            {key: mine}, hash=False, direct=self._direct, workers=local, broadcast=True
        )
        return _Sent(blobs[key], mine, data.nbytes)

    def local_workers(self) -> list[str]:
        """The addresses of the workers on the client's host (refreshed each second); and,
        in ``self._local``, whether they are all the cluster's."""
        counted, workers, _ = self._local
        now = time.monotonic()
        if now - counted > 1.0:
            here = _host()
            hosts = self._client.run(_host)  # e.g. {"tcp://127.0.0.1:40123": "2f1c…"}
            workers = sorted(address for address, host in hosts.items() if host == here)
            self._local = now, workers, len(workers) == len(hosts)
        return workers

    def _source_gone(self, digest: bytes, ref: weakref.ref[object]) -> None:
        with self._lock:
            sent = self.sent.get(digest)
            if sent is not None:
                sent.sources = [r for r in sent.sources if r is not ref]
                self._maybe_release(digest, sent)

    def _read_gone(self, key: int, ref: weakref.ref[object]) -> None:
        with self._lock:
            read = self._read.get(key)
            if read is not None and read.source is ref:
                del self._read[key]

    def _maybe_release(self, digest: bytes, sent: _Sent) -> None:
        # Under self._lock. Kept while a call holds it or an object it came from lives.
        if sent.calls == 0 and (self.shut_down or all(r() is None for r in sent.sources)):
            del self.sent[digest]
            sent.release()
