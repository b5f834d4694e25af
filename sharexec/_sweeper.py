"""The sweeper: the process that frees what a dead process of a session still owned.

A process that dies runs no finalizer. So the first process of a session to create a
segment (the *root*, usually the program running the executor) starts the sweeper
(``_session._start_sweeper``), which outlives it, and every process of the session tells
it what it owns. This module is the sweeper's side; the tellers' side is
:mod:`sharexec._session`.

The protocol, one line per event, ``<op> <name>\\n`` in UTF-8, where a name is a segment's
name, the path of a file-backed segment, or the path of a folder of them (numbers an
event carries go before the name: a path may hold spaces):

``R name``  the sender is about to create ``name`` and owns it (told first: a crash
            while its space is being reserved leaks nothing);
``U name``  ``name`` was unlinked, or will never be used: nobody owns it any more;
``H pid token name``  the sender handed ``name`` over to process ``pid`` (the one its
            result goes to), for that process's receiver ``token`` (an executor's): it
            is *in flight* to ``pid``, owned by no live process yet;
``A name``  the sender received ``name``, which was handed to it: it owns it now;
``C token`` the sender will receive nothing more for ``token`` (an executor that reads
            no more results: shut down, broken or terminated);
``W pid``   the sender started the worker ``pid``, which must not outlive the root
            (see below).

The root writes into the sweeper's stdin (fd 0), one end of a socket pair whose other
end it alone holds (a forked child closes its copy). Every other process (workers,
forked children) writes into its own connection to a Unix socket the sweeper listens on
as fd 3, bound in Linux's abstract namespace (no file), e.g.
``b"\\0sharexec-sweeper-<24 hex digits>"``; workers receive the address when they start
and with their tasks. Only connections of the sweeper's own user are heard. Nothing is
ever sent back. A process announces everything it still owns each time it opens a new
line (``_session``): so a sweeper started again after the first one died (the root
restarts it) learns what the lines of the dead one had told it.

When a connection closes (its process exited or died), the sweeper unlinks what that
process still owned, and what was in flight to it. A segment in flight is unlinked too
once its receiver closed the token it was sent for, or as it comes if it was closed
already: a result its executor will never read (the worker died, the pool was broken or
shut down) is freed at once, not when the program exits. The lines of the sender and
the receiver are read in any order: an ``A`` heard before the sender's ``H`` (or ``R``)
makes the receiver the owner all the same. A process is known by its pid through its
line (the root's is on the sweeper's command line; a connection's, from its peer's
credentials); a receiver with no line yet is watched through a pidfd.

When the root's line closes, the sweeper unlinks everything the root owned and waits for
the other processes to go: workers exit with the root
(``_session.watch_parent``), but a stopped (SIGSTOP) or stuck one cannot, so workers
still there after the grace period (``WAIT_FOR_MEMBERS`` seconds) are killed (SIGKILL,
through a pidfd taken when their ``W`` was heard: never another process that reused the
pid). Then it unlinks what is left, and exits. It never unlinks a name without sharexec's
prefix.

The sweeper runs ``python -S`` and loads nothing but this module, the standard library,
:mod:`sharexec._segments` and :mod:`sharexec.errors`: it must never import
:mod:`sharexec._tracking` or :mod:`sharexec._session`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import struct
import time

from . import _segments

__all__ = [
    "ADOPT",
    "CLOSED",
    "HAND_OFF",
    "LISTENER_FD",
    "REGISTER",
    "UNREGISTER",
    "WAIT_FOR_MEMBERS",
    "WORKER",
    "encode",
    "sweeper_main",  # named in the command line _session starts the sweeper with
]

# ---------------------------------------------------------------------------------------
# The protocol
# ---------------------------------------------------------------------------------------

REGISTER = "R"  # "R name": the sender creates name, and owns it
UNREGISTER = "U"  # "U name": name is gone, nobody owns it
HAND_OFF = "H"  # "H pid token name": name is on its way to process pid, for its token
ADOPT = "A"  # "A name": the sender received name (handed to it): it owns it now
CLOSED = "C"  # "C token": the sender receives nothing more for token
WORKER = "W"  # "W pid": the sender started worker pid, to be ended if it outlives the root
LISTENER_FD = 3  # the sweeper's listening socket; the root's line is its stdin, fd 0
# Seconds the sweeper waits for the other processes after the root: then it kills the
# workers left. Read by the root when it starts a sweeper (passed on its command line).
WAIT_FOR_MEMBERS = 10.0
WAIT_FOR_KILLED = 5.0  # seconds it then waits for the killed workers' lines to close


def encode(op: str, name: str, *before: int) -> bytes:
    """One event, as a process tells it, e.g. ``b"R sharexec-41-Zm9v\\n"``; ``before``:
    numbers that go ahead of the name (a name may hold spaces, a path), e.g.
    ``encode(HAND_OFF, "sharexec-52-Zm9v", 41, 3)``: ``b"H 41 3 sharexec-52-Zm9v\\n"``."""
    return " ".join([op, *map(str, before), name]).encode() + b"\n"


# ---------------------------------------------------------------------------------------
# The sweeper process
# ---------------------------------------------------------------------------------------


def sweeper_main(grace: float = WAIT_FOR_MEMBERS, root_pid: int = 0) -> None:
    """The sweeper process: stdin is the line of the root (``root_pid``), fd 3 the
    others' listening socket; ``grace``: how long the workers may outlive the root."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the root
    _Sweeper(grace, root_pid, socket.socket(fileno=LISTENER_FD)).run()


class _Sweeper:
    """What each process of the session owns, and what is on its way to one.

    A process is known by its line (``"root"``, or its connection) and by its pid (its
    peer's credentials, taken when it connects). A segment handed over (``H``) is owned
    by no line while it travels: it is *in flight* to the receiving process, for one of
    its receivers (an executor's token), until that process says it received it (``A``:
    it owns it now). It is freed when the receiver dies, or once the receiver closed
    that token (``C``: an executor that will read no more results; what comes for it
    later is freed as it comes).
    """

    def __init__(
        self, grace: float, root_pid: int, listener: socket.socket, root_fd: int = 0
    ) -> None:
        self.grace = grace
        self.listener = listener
        self.listener.setblocking(False)  # accept() takes every pending connection
        self.root_fd = root_fd
        self.events = selectors.DefaultSelector()
        self.events.register(root_fd, selectors.EVENT_READ, "root")
        self.events.register(self.listener, selectors.EVENT_READ, "listen")
        # What each live process owns, e.g. {"root": {"sharexec-41-Zm9v"}, <socket>: set()}.
        self.owned: dict[object, set[str]] = {"root": set()}
        # Each line's process id, and back, e.g. {4711: <socket>, 41: "root"}.
        self.lines: dict[int, object] = {root_pid: "root"}
        self.pids: dict[object, int] = {"root": root_pid}
        # Segments in flight, each with its receiver: (pid, token), e.g.
        # {"sharexec-52-Zm9v": (41, 3)}.
        self.in_flight: dict[str, tuple[int, int]] = {}
        # The tokens each live receiver closed, e.g. {41: {1, 2}}.
        self.closed: dict[int, set[int]] = {}
        # Receivers without a line that segments are in flight to, each with a pidfd
        # watched until it exits, e.g. {4712: 11}.
        self.watched: dict[int, int] = {}
        # What each process sent of a line not finished yet, e.g. {<socket>: b"R sharexec-4"}.
        self.pending: dict[object, bytes] = {}
        # The live workers, each with its handle (see _handle), e.g. {4711: 9}.
        self.workers: dict[int, int] = {}

    def run(self) -> None:
        deadline = None  # once the root is gone: until when the others may stay
        killed = False  # the workers left at the deadline were killed
        # Workers without a line of their own may be left at the end, and segments in
        # flight to processes without one.
        while self.owned or self.workers or self.watched:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            for key, _ in self.events.select(timeout):
                source = key.data
                if source == "listen":
                    self.accept()
                elif isinstance(source, tuple):  # ("worker" or "receiver", pid): it exited
                    self.exited(*source)
                elif not self.read(source):  # that process exited or died
                    self.events.unregister(key.fileobj)
                    self.gone(source)
                    if source == "root":
                        deadline = time.monotonic() + self.grace
            if deadline is not None and time.monotonic() >= deadline:
                if killed or not self.workers:
                    break
                for handle in self.workers.values():  # stopped or stuck: they cannot exit
                    _kill(handle)
                killed = True
                deadline = time.monotonic() + WAIT_FOR_KILLED
        _sweep(set().union(*self.owned.values(), self.in_flight))

    def accept(self) -> None:
        """Take every pending connection: anyone may connect; only we are heard."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: its process is heard of no more
                return
            conn.setblocking(True)
            pid, uid = _peer(conn)
            if uid != os.getuid():
                conn.close()
                continue
            self.add_line(conn, pid)

    def add_line(self, conn: socket.socket, pid: int) -> None:
        """Hear the process ``pid`` on ``conn``, from now on."""
        self.events.register(conn, selectors.EVENT_READ, conn)
        self.owned[conn] = set()
        self.pids[conn] = pid
        self.lines[pid] = conn

    def read(self, source: object) -> bool:
        """Act on what ``source`` sent; False once its line is closed."""
        try:
            if source == "root":
                data = os.read(self.root_fd, 65536)
            else:
                assert isinstance(source, socket.socket)
                data = source.recv(65536)
        except OSError:  # reset: as closed
            data = b""
        if not data:
            return False
        lines = (self.pending.pop(source, b"") + data).split(b"\n")
        self.pending[source] = lines.pop()
        for line in lines:
            with contextlib.suppress(ValueError):  # a line not of this protocol: ignored
                self.act(source, *line.decode().partition(" ")[::2])
        return True

    def act(self, source: object, op: str, rest: str) -> None:
        """Act on one line ``op rest`` that ``source`` sent."""
        if op == REGISTER:
            self.owned[source].add(rest)
        elif op == UNREGISTER:
            for names in self.owned.values():
                names.discard(rest)
            self.in_flight.pop(rest, None)
        elif op == HAND_OFF:
            to, token, name = rest.split(" ", 2)
            self.hand_off(source, name, int(to), int(token))
        elif op == ADOPT:
            self.in_flight.pop(rest, None)
            for names in self.owned.values():  # its sender's H may not be read yet
                names.discard(rest)
            self.owned[source].add(rest)
        elif op == CLOSED:
            sender = self.pids[source]
            self.closed.setdefault(sender, set()).add(int(rest))
            self.free_in_flight(sender, int(rest))
        elif op == WORKER and rest.isdigit() and int(rest) not in self.workers:
            handle = _handle(int(rest))
            if handle is not None:
                self.workers[int(rest)] = handle
                if handle >= 0:  # readable once it exits: then forgotten
                    self.events.register(handle, selectors.EVENT_READ, ("worker", int(rest)))

    def hand_off(self, source: object, name: str, pid: int, token: int) -> None:
        """``source`` handed ``name`` over to process ``pid``, for its ``token``."""
        if name not in self.owned[source]:
            return  # not its own to hand over (or told unlinked)
        self.owned[source].discard(name)
        if pid not in self.lines:
            self.accept()  # the receiver connected before the sender heard of it
        line = self.lines.get(pid)
        if line is not None and name in self.owned[line]:
            return  # the receiver said it received it, first
        if token in self.closed.get(pid, ()):
            _sweep({name})  # that receiver reads nothing more
            return
        if line is None and pid not in self.watched:  # a process with no line (yet)
            handle = _handle(pid)
            if handle is None:
                _sweep({name})  # gone already
                return
            if handle >= 0:  # readable once it exits (without pidfds: freed at the end)
                self.watched[pid] = handle
                self.events.register(handle, selectors.EVENT_READ, ("receiver", pid))
        self.in_flight[name] = (pid, token)

    def free_in_flight(self, pid: int, token: int | None = None) -> None:
        """Unlink the segments in flight to process ``pid`` (for ``token`` only, if given)."""
        names = [
            name
            for name, (to, of) in self.in_flight.items()
            if to == pid and (token is None or of == token)
        ]
        for name in names:
            del self.in_flight[name]
        _sweep(set(names))

    def gone(self, source: object) -> None:
        """The process of ``source`` exited or died: free what it still owned, and what
        was on its way to it."""
        for name in _sweep(self.owned.pop(source)):
            if "root" in self.owned:  # a folder still holding the root's files
                self.owned["root"].add(name)
        self.pending.pop(source, None)
        pid = self.pids.pop(source)
        if self.lines.get(pid) is source:
            del self.lines[pid]
        self.closed.pop(pid, None)
        self.free_in_flight(pid)
        if isinstance(source, socket.socket):
            source.close()

    def exited(self, kind: str, pid: int) -> None:
        """A worker, or a receiver without a line, exited (its pidfd reads as ready)."""
        handle = (self.workers if kind == "worker" else self.watched).pop(pid)
        self.events.unregister(handle)
        _forget(handle)
        if kind == "receiver":
            self.free_in_flight(pid)


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The process id and user id of the process at the other end of a Unix socket
    (-1 each if unknown)."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return -1, -1
    pid, uid, _ = struct.unpack("3i", creds)
    return int(pid), int(uid)


def _handle(pid: int) -> int | None:
    """A handle to kill a worker by: a pidfd (a descriptor of that very process, which a
    reused pid can never be taken for), or ``-(pid + 1)`` where there are no pidfds;
    None if it is gone already."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):  # pragma: no cover - no pidfds (Linux < 5.3, macOS)
        return -(pid + 1)


def _kill(handle: int) -> None:
    with contextlib.suppress(OSError):
        if handle >= 0:
            signal.pidfd_send_signal(handle, signal.SIGKILL)
        else:  # pragma: no cover - no pidfds
            os.kill(-handle - 1, signal.SIGKILL)


def _forget(handle: int | None) -> None:
    if handle is not None and handle >= 0:
        os.close(handle)


def _sweep(names: set[str]) -> list[str]:
    """Unlink these segments (files before their folders); return what could not go."""
    left = []
    for name in sorted(names, key=len, reverse=True):
        if not os.path.basename(name).startswith(_segments.PREFIX):
            continue  # never anything but sharexec's own
        try:
            _segments.unlink(name)
        except OSError:
            left.append(name)
    return left
