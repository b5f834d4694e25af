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
``H name``  the sender handed ``name`` over to the root, which owns it now.

The root writes into the sweeper's stdin (fd 0), a pipe whose write end it alone holds
(a forked child closes its copy). Every other process (workers, forked children) writes
into its own connection to a Unix socket the sweeper listens on as fd 3, bound in Linux's
abstract namespace (no file), e.g. ``b"\\0sharexec-sweeper-<24 hex digits>"``; workers
receive the address with their tasks. Only connections of the sweeper's own user are
heard. Nothing is ever sent back.

When a connection closes (its process exited or died), the sweeper unlinks what that
process still owned. When the root's pipe closes, it unlinks everything the root owned,
waits for the other processes to go (at most :data:`WAIT_FOR_MEMBERS` seconds: workers
exit with the root, ``_tracking.watch_parent``), unlinks what is left and exits. It never
unlinks a name without sharexec's prefix.

The sweeper runs ``python -S`` and loads nothing but this module, the standard library
and :mod:`sharexec._segments`: it must never import :mod:`sharexec._tracking`.
"""

from __future__ import annotations

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
    "encode",
    "sweeper_main",  # named in the command line _tracking starts the sweeper with
]

# ---------------------------------------------------------------------------------------
# The protocol
# ---------------------------------------------------------------------------------------

REGISTER = "R"  # "R name": the sender creates name, and owns it
UNREGISTER = "U"  # "U name": name is gone, nobody owns it
HAND_OFF = "H"  # "H name": the root owns name now
LISTENER_FD = 3  # the sweeper's listening socket; the root's pipe is its stdin, fd 0
WAIT_FOR_MEMBERS = 10.0  # seconds the sweeper waits for the other processes after the root


def encode(op: str, name: str) -> bytes:
    """One event, as a process tells it, e.g. ``b"R sharexec-41-Zm9v\\n"``."""
    return f"{op} {name}\n".encode()


# ---------------------------------------------------------------------------------------
# The sweeper process
# ---------------------------------------------------------------------------------------


def sweeper_main() -> None:
    """The sweeper process: stdin is the root's pipe, fd 3 the others' listening socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the root
    listener = socket.socket(fileno=LISTENER_FD)
    events = selectors.DefaultSelector()
    events.register(0, selectors.EVENT_READ, "root")
    events.register(listener, selectors.EVENT_READ, "listen")
    # What each live process owns, e.g. {"root": {"sharexec-41-Zm9v"}, <socket>: set()}.
    owned: dict[object, set[str]] = {"root": set()}
    # What each process sent of a line not finished yet, e.g. {<socket>: b"R sharexec-4"}.
    pending: dict[object, bytes] = {}
    deadline = None  # set when the root is gone
    while owned:
        ready = events.select(timeout=1.0 if deadline else None)
        if deadline and time.monotonic() > deadline:
            break
        for key, _ in ready:
            if key.data == "listen":
                conn, _ = listener.accept()
                if _peer_uid(conn) != os.getuid():  # anyone may connect; only we are heard
                    conn.close()
                    continue
                events.register(conn, selectors.EVENT_READ, conn)
                owned[conn] = set()
                continue
            source = key.data
            data = os.read(0, 65536) if source == "root" else source.recv(65536)
            if not data:  # that process exited or died: free what it still owned
                events.unregister(key.fileobj)
                for name in _sweep(owned.pop(source)):
                    if "root" in owned:  # a folder still holding the root's files
                        owned["root"].add(name)
                if source == "root":
                    deadline = time.monotonic() + WAIT_FOR_MEMBERS
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
        if deadline and len(owned) == 0:
            break
    _sweep(set().union(*owned.values()))


def _peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (-1 if unknown)."""
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return -1
    return int(struct.unpack("3i", creds)[1])


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
