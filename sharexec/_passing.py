"""Descriptors of anonymous segments, passed from a worker to the process it works for.

An anonymous segment (``memfd_create``, see :mod:`sharexec._segments`) lives while some
process holds its descriptor. A worker that hands one over (a large result, a shared
array it allocated and returns) cannot know when the parent will have opened it, so it
does not keep it: it *passes* the descriptor (``SCM_RIGHTS``) over a Unix socket the
parent listens on, then closes its own at once. While the message travels the kernel
holds the descriptor; the parent holds it once received; nothing is left to sweep
whoever dies (a socket closed with descriptors unread drops them).

* The parent's side, :class:`_Inbox`: a ``SOCK_SEQPACKET`` socket listening at an
  abstract address named after its pid and PID namespace (:func:`address`: no file, so
  a read-only root and no ``/tmp`` do not matter), made with its first executor, before
  any worker starts (:func:`listen`). It has no thread: whoever needs a descriptor
  (loky's manager thread rebuilding a result, :func:`take`) reads what the workers sent,
  by the segment's label, waiting :data:`WAIT_SECONDS` at most (a worker sends the
  descriptor before the result, so it is there already but for a connection not yet
  accepted). A connection from another user is refused (``SO_PEERCRED``). Descriptors
  received for an executor that reads no more results are closed (:func:`drop`).
* A worker's side, :class:`_Outbox`: one connection to its parent, made when it first
  needs one (:func:`can_send`, asked before an anonymous segment is made there: a worker
  that cannot reach its parent makes none) and checked to be that very process
  (``SO_PEERCRED``'s pid). :func:`send`: the descriptor, with the executor's token and
  the segment's label.

A message is ``b"<token> <label>"`` with one descriptor. Both sides reset in a forked
child (an after-fork hook registered at import): a child neither receives its parent's
descriptors nor writes on its parent's connection.

The inbox's lock is held while it reads; nothing else is taken inside it. The outbox's
lock likewise.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time

from . import _segments
from .errors import SegmentError

__all__ = ["WAIT_SECONDS", "address", "can_send", "drop", "listen", "send", "take"]

logger = logging.getLogger("sharexec")

# How long a result's rebuild waits for a descriptor that has not arrived.
WAIT_SECONDS = 10.0
_SEND_SECONDS = 10.0  # how long a worker waits to send one (a parent that reads nothing)
_MESSAGE = 256  # bytes: a token and a label


def address(pid: int) -> bytes:
    """The abstract address at which the process ``pid`` (of this PID namespace)
    receives descriptors."""
    return f"\0sharexec-fds-{pid}-{_segments.pid_namespace() or 0}".encode()


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of ``conn``."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


class _Inbox:
    """The descriptors workers pass to this process, by label, until taken."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.connections: list[socket.socket] = []
        # Received and not taken yet, by label, with the token they came for,
        # e.g. {"sharexec-4711-4026531836.Zm9vYmFy": (12, 3)}.
        self.received: dict[str, tuple[int, int]] = {}
        # Tokens whose executor reads no more results: what comes for them is closed.
        self.closed: set[int] = set()

    def listen(self) -> bool:
        """Listen, if not yet; False if this process cannot (its address is taken)."""
        with self.lock:
            if self.listener is None:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    listener.bind(address(os.getpid()))
                    listener.listen(64)
                except OSError as exc:
                    listener.close()
                    logger.info("cannot receive descriptors from workers: %s", exc)
                    return False
                listener.setblocking(False)
                self.listener = listener
            return True

    def take(self, label: str, wait: float) -> int:
        """The descriptor sent for ``label``, now this process's; reads what arrived,
        waiting ``wait`` seconds at most (:class:`SegmentError` then)."""
        deadline = time.monotonic() + wait
        with self.lock:
            while True:
                found = self.received.pop(label, None)
                if found is not None:
                    return found[0]
                left = deadline - time.monotonic()
                if self.listener is None or left <= 0:
                    raise SegmentError(
                        errno.ETIMEDOUT,
                        f"the worker's descriptor of segment {label!r} did not arrive "
                        f"within {wait:g} s",
                    )
                self._read(left)

    def _read(self, wait: float) -> None:
        """Accept and read whatever is ready, waiting ``wait`` seconds at most for it."""
        assert self.listener is not None
        # poll, not select(): descriptors above 1,024 are ordinary once the limit is
        # raised for anonymous segments (_segments._raise_open_files_limit).
        with selectors.PollSelector() as poller:
            for sock in (self.listener, *self.connections):
                poller.register(sock, selectors.EVENT_READ, sock)
            ready: list[socket.socket] = [key.data for key, _ in poller.select(wait)]
        for sock in ready:
            if sock is self.listener:
                self._accept()
            else:
                self._receive(sock)

    def _accept(self) -> None:
        assert self.listener is not None
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                conn, _ = self.listener.accept()
                if _peer(conn)[1] != os.geteuid():
                    conn.close()  # another user's process: nothing of ours
                    continue
                conn.setblocking(False)
                self.connections.append(conn)
                self._receive(conn)  # what it sent before it was accepted

    def _receive(self, conn: socket.socket) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(conn, _MESSAGE, 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                message, fds = b"", []
            if not message:  # the worker is gone
                self.connections.remove(conn)
                conn.close()
                return
            token, _, label = message.decode(errors="replace").partition(" ")
            if not fds:  # the descriptor was dropped (this process out of descriptors)
                logger.info("a worker's descriptor of %s was lost", label)
                continue
            if not token.isdigit() or int(token) in self.closed or label in self.received:
                os.close(fds[0])
                continue
            self.received[label] = (fds[0], int(token))

    def drop(self, token: int) -> None:
        """Close what was received for ``token``, and what comes for it later."""
        with self.lock:
            self.closed.add(token)
            if self.listener is not None:
                self._read(0)
            for label, (fd, sent_for) in list(self.received.items()):
                if sent_for == token:
                    del self.received[label]
                    os.close(fd)

    def after_fork_in_child(self) -> None:
        """A forked child receives nothing of its parent's."""
        for fd, _ in self.received.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        for sock in [self.listener, *self.connections]:
            if sock is not None:
                sock.close()
        self.__init__()  # type: ignore[misc]


class _Outbox:
    """A worker's connection to the process it works for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn: socket.socket | None = None
        self.failed = False  # tried and could not: not tried again

    def connect(self, pid: int) -> socket.socket | None:
        """The connection to ``pid``, made once; None if it cannot be made."""
        if self.conn is None and not self.failed:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(address(pid))
                if _peer(conn) != (pid, os.geteuid()):
                    raise ConnectionRefusedError(errno.EPERM, f"not process {pid}")
            except OSError as exc:
                conn.close()
                self.failed = True
                logger.info("cannot pass descriptors to process %d: %s", pid, exc)
                return None
            conn.settimeout(_SEND_SECONDS)
            self.conn = conn
        return self.conn

    def after_fork_in_child(self) -> None:
        """A forked child writes nothing on its parent's connection."""
        if self.conn is not None:
            self.conn.close()
        self.__init__()  # type: ignore[misc]


_inbox = _Inbox()
_outbox = _Outbox()
os.register_at_fork(after_in_child=_inbox.after_fork_in_child)
os.register_at_fork(after_in_child=_outbox.after_fork_in_child)


def listen() -> bool:
    """Receive descriptors from this process's workers, from now on (once per process)."""
    return _inbox.listen()


def take(label: str, wait: float | None = None) -> int:
    """The descriptor a worker passed for the segment labelled ``label``: this
    process's now, to close. :class:`SegmentError` if it does not arrive within ``wait``
    seconds (:data:`WAIT_SECONDS` by default)."""
    return _inbox.take(label, WAIT_SECONDS if wait is None else wait)


def drop(token: int) -> None:
    """The executor of ``token`` reads no more results: close the descriptors sent for
    it, now and as they come."""
    _inbox.drop(token)


def can_send(pid: int) -> bool:
    """Whether this process can pass descriptors to the process ``pid``."""
    with _outbox.lock:
        return _outbox.connect(pid) is not None


def send(pid: int, fd: int, label: str, token: int) -> None:
    """Pass the descriptor ``fd`` of the segment labelled ``label`` to the process
    ``pid``, for its executor of ``token``; this process may close its own at once."""
    with _outbox.lock:
        conn = _outbox.connect(pid)
        if conn is None:
            raise SegmentError(errno.ENOTCONN, f"cannot pass descriptors to process {pid}")
        try:
            socket.send_fds(conn, [f"{token} {label}".encode()], [fd])
        except OSError as exc:
            raise SegmentError(
                exc.errno or errno.EIO, f"cannot pass segment {label!r} to process {pid}: {exc}"
            ) from exc
