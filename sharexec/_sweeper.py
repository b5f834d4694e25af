"""The sweeper: the process that frees what a dead process of a session still owned.

A process that dies runs no finalizer. So the first process of a session to create a
segment (the *root*, usually the program running the executor) starts the sweeper
(``_tracking._start_sweeper``), which outlives it, and every process of the session tells
it what it owns. This module is the sweeper's side; the tellers' side is
:mod:`sharexec._tracking`.

The protocol, one line per event, ``<op> <name>\\n`` in UTF-8, where a name is a segment's
name, the path of a file-backed segment, or the path of a folder of them:

``R name``  the sender is about to create ``name`` and owns it (told first: a crash
            while its space is being reserved leaks nothing);
``U name``  ``name`` was unlinked, or will never be used: nobody owns it any more;
``H name``  the sender handed ``name`` over to the root, which owns it now;
``W pid``   the sender started the worker ``pid``, which must not outlive the root
            (see below).

The root writes into the sweeper's stdin (fd 0), one end of a socket pair whose other
end it alone holds (a forked child closes its copy). Every other process (workers,
forked children) writes into its own connection to a Unix socket the sweeper listens on
as fd 3, bound in Linux's abstract namespace (no file), e.g.
``b"\\0sharexec-sweeper-<24 hex digits>"``; workers receive the address when they start
and with their tasks. Only connections of the sweeper's own user are heard. Nothing is
ever sent back. A process announces everything it still owns each time it opens a new
line (``_tracking``): so a sweeper started again after the first one died (the root
restarts it) learns what the lines of the dead one had told it.

When a connection closes (its process exited or died), the sweeper unlinks what that
process still owned. When the root's line closes, it unlinks everything the root owned
and waits for the other processes to go: workers exit with the root
(``_tracking.watch_parent``), but a stopped (SIGSTOP) or stuck one cannot, so workers
still there after the grace period (``WAIT_FOR_MEMBERS`` seconds) are killed (SIGKILL,
through a pidfd taken when their ``W`` was heard: never another process that reused the
pid). Then it unlinks what is left, and exits. It never unlinks a name without sharexec's
prefix.

The sweeper runs ``python -S`` and loads nothing but this module, the standard library,
:mod:`sharexec._segments` and :mod:`sharexec.errors`: it must never import
:mod:`sharexec._tracking`.
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
    "HAND_OFF",
    "LISTENER_FD",
    "REGISTER",
    "UNREGISTER",
    "WAIT_FOR_MEMBERS",
    "WORKER",
    "encode",
    "sweeper_main",  # named in the command line _tracking starts the sweeper with
]

# ---------------------------------------------------------------------------------------
# The protocol
# ---------------------------------------------------------------------------------------

REGISTER = "R"  # "R name": the sender creates name, and owns it
UNREGISTER = "U"  # "U name": name is gone, nobody owns it
HAND_OFF = "H"  # "H name": the root owns name now
WORKER = "W"  # "W pid": the sender started worker pid, to be ended if it outlives the root
LISTENER_FD = 3  # the sweeper's listening socket; the root's line is its stdin, fd 0
# Seconds the sweeper waits for the other processes after the root: then it kills the
# workers left. Read by the root when it starts a sweeper (passed on its command line).
WAIT_FOR_MEMBERS = 10.0
WAIT_FOR_KILLED = 5.0  # seconds it then waits for the killed workers' lines to close


def encode(op: str, name: str) -> bytes:
    """One event, as a process tells it, e.g. ``b"R sharexec-41-Zm9v\\n"``."""
    return f"{op} {name}\n".encode()


# ---------------------------------------------------------------------------------------
# The sweeper process
# ---------------------------------------------------------------------------------------


def sweeper_main(grace: float = WAIT_FOR_MEMBERS) -> None:
    """The sweeper process: stdin is the root's line, fd 3 the others' listening socket;
    ``grace``: how long the workers may outlive the root."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the root
    listener = socket.socket(fileno=LISTENER_FD)
    events = selectors.DefaultSelector()
    events.register(0, selectors.EVENT_READ, "root")
    events.register(listener, selectors.EVENT_READ, "listen")
    # What each live process owns, e.g. {"root": {"sharexec-41-Zm9v"}, <socket>: set()}.
    owned: dict[object, set[str]] = {"root": set()}
    # What each process sent of a line not finished yet, e.g. {<socket>: b"R sharexec-4"}.
    pending: dict[object, bytes] = {}
    # The live workers, each with its handle (see _handle), e.g. {4711: 9}.
    workers: dict[int, int] = {}
    deadline = None  # once the root is gone: until when the others may stay
    killed = False  # the workers left at the deadline were killed
    while owned or workers:  # workers without a line of their own may be left at the end
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        for key, _ in events.select(timeout):
            if key.data == "listen":
                conn, _ = listener.accept()
                if _peer_uid(conn) != os.getuid():  # anyone may connect; only we are heard
                    conn.close()
                    continue
                events.register(conn, selectors.EVENT_READ, conn)
                owned[conn] = set()
                continue
            if isinstance(key.data, tuple):  # ("worker", pid): that worker exited
                events.unregister(key.fileobj)
                _forget(workers.pop(key.data[1], None))
                continue
            source = key.data
            try:
                data = os.read(0, 65536) if source == "root" else source.recv(65536)
            except OSError:  # reset: as closed
                data = b""
            if not data:  # that process exited or died: free what it still owned
                events.unregister(key.fileobj)
                for name in _sweep(owned.pop(source)):
                    if "root" in owned:  # a folder still holding the root's files
                        owned["root"].add(name)
                if source == "root":
                    deadline = time.monotonic() + grace
                else:
                    source.close()
                continue
            lines = (pending.pop(source, b"") + data).split(b"\n")
            pending[source] = lines.pop()
            for line in lines:
                op, _, name = line.decode().partition(" ")
                if op == REGISTER:
                    owned[source].add(name)
                elif op == UNREGISTER:
                    for names in owned.values():
                        names.discard(name)
                elif op == HAND_OFF:
                    owned[source].discard(name)
                    if "root" in owned:
                        owned["root"].add(name)
                    else:
                        _sweep({name})
                elif op == WORKER and name.isdigit() and int(name) not in workers:
                    handle = _handle(int(name))
                    if handle is not None:
                        workers[int(name)] = handle
                        if handle >= 0:  # readable once it exits: then forgotten
                            events.register(handle, selectors.EVENT_READ, ("worker", int(name)))
        if deadline is not None and time.monotonic() >= deadline:
            if killed or not workers:
                break
            for handle in workers.values():  # stopped or stuck: they cannot exit themselves
                _kill(handle)
            killed = True
            deadline = time.monotonic() + WAIT_FOR_KILLED
    _sweep(set().union(*owned.values()))


def _peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (-1 if unknown)."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return -1
    return int(struct.unpack("3i", creds)[1])


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
