"""This process in its session: its line to the sweeper, what it must tell it, and the
watch of a worker's parent.

The first process of a session to create a segment (the *root*, usually the program
running the executor) starts the sweeper (:mod:`sharexec._sweeper`, which describes the
protocol): a small process that every process of the session tells what it owns, and
that unlinks what a dead one still owned. This module owns

* the line (:class:`_Channel`): started or joined at the first event, restarted when
  the sweeper died (:func:`sweeper_address`, :func:`join_sweeper`,
  :class:`SweeperAddress` among a worker's start-up arguments, :func:`check_sweeper`);
* what this process owns and must announce on every new line (:class:`_Owned`: the
  sizes of its segments, its folders of file-backed ones, the workers it started),
  which :mod:`sharexec._tracking`'s handles keep up to date;
* a worker's watch of its parent (:func:`watch_parent`): it exits when the parent dies,
  and hands what it makes over to that parent.

:mod:`sharexec._tracking` (handles, the registry of shared mappings) tells the sweeper
through :func:`tell`; nothing here creates, maps or unlinks a segment but a folder of
file-backed ones (made once, removed at exit if empty).

Lock order: ``owned``'s lock is held while ``_channel``'s is taken, never the reverse.

A forked child inherits both. Each resets itself in the child with one after-fork hook
(``os.register_at_fork``), registered when this module is imported:

* hooks rather than pid checks at each use, because some resets must happen at the fork
  itself: a child still holding the root's pipe would hide the root's death from the
  sweeper, and a lock held by another thread of the parent would stay held in the child;
* at import rather than at first use, because a registration does nothing until a fork,
  and then touches only this module's state (empty until used), as the standard
  library's own hooks do (``threading``, ``random``, ``logging``); registering at first
  use would need a guard on every path that first makes state. ``import sharexec`` does
  not import this module;
* pid checks remain only where the parent's objects and callbacks live on in the child,
  out of any hook's reach: a segment's handle and its finalizer
  (:class:`sharexec._tracking.Segment`), and a folder's ``atexit`` call, carry their
  creator's pid, so a forked child never frees its parent's segments.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import errno
import logging
import os
import select
import socket
import sys
import threading
import time

from . import _passing, _segments, _sweeper
from ._sweeper import CLOSED, REGISTER, UNREGISTER, WORKER

__all__ = [
    "SweeperAddress",
    "check_sweeper",
    "in_worker",
    "join_sweeper",
    "live",
    "owned",
    "receiver_closed",
    "receiver_pid",
    "sweeper_address",
    "sweeper_lost",
    "tell",
    "watch_parent",
    "workers_started",
]

logger = logging.getLogger("sharexec")


# ---------------------------------------------------------------------------------------
# What this process owns: what a new sweeper must hear of
# ---------------------------------------------------------------------------------------


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

    def note(self, name: str, size: int) -> None:
        """This process owns the segment ``name`` now (a handle was made for it)."""
        self.sizes[name] = size

    def drop(self, name: str) -> None:
        """This process no longer owns the segment ``name`` (unlinked, or handed over)."""
        self.sizes.pop(name, None)

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
                tell(REGISTER, folder)
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


owned = _Owned()
os.register_at_fork(after_in_child=owned.after_fork_in_child)


def live() -> tuple[int, int]:
    """How many segments this process owns now, and their total size in bytes."""
    sizes = list(owned.sizes.values())
    return len(sizes), sum(sizes)


def _remove_folder(folder: str, owner_pid: int) -> None:
    """At exit: remove this process's (empty) folder of file-backed segments."""
    if os.getpid() == owner_pid:  # a forked child inherits the atexit call too
        try:
            _segments.unlink(folder)
        except OSError:  # still holds files handed to another process: the sweeper's
            return
        tell(UNREGISTER, folder)


def receiver_closed(token: int) -> None:
    """This process will adopt nothing more handed to it for ``token`` (an executor that
    reads no more results): the sweeper frees what is in flight for it, now and later,
    and the descriptors passed for it are closed."""
    _passing.drop(token)
    if _channel.address is not None:  # else no sweeper was ever reached: nothing was sent
        tell(CLOSED, str(token))


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
        lines = [_sweeper.encode(WORKER, str(pid)) for pid in owned.live_workers()]
        names = [*owned.folders.copy().values(), *owned.sizes.copy()]
        lines.extend(_sweeper.encode(REGISTER, name) for name in names)
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


def tell(op: str, name: str, *before: int) -> None:
    """Tell the sweeper about a segment (see :meth:`_Channel.tell`)."""
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
    for pid in owned.add_workers(pids):
        tell(WORKER, str(pid))


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


def receiver_pid() -> int:
    """The process that what this one hands over goes to: in a worker, its parent; else
    this process itself."""
    return _parent_pid or os.getpid()


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

    # A bare thread, not a threading.Thread: its start does not wait for it to run
    # (threading's waits until the new thread is scheduled, 0.3 ms and more of a
    # worker's start on a busy machine), and the tasks' code does not see it: a new
    # worker shows only its main thread, as a standard library worker does.
    _thread.start_new_thread(watch, ())
