"""sharexec's default start method: forks of a warm server.

Replaces nothing of loky 3.7; it is a multiprocessing start method of its own, built on
multiprocessing's forkserver: a second ``ForkServer`` (:class:`_WarmServer`, preloading
:data:`WARM_PRELOAD`), whose ``Popen`` (:class:`_WarmPopen`) asks that server for each
fork, sends the parent's state of the moment (environment, working directory, umask,
ignored signals, signal mask) to be applied in the child first, and tells the child
nothing of the main module. A server found dead is started again by the next fork
request. Each child waits, on a socket of its own, to be told what worker it becomes
(:class:`_Spare`), so children can be forked ahead: a pool shut down asks for the next
pool's (:meth:`_WarmServer.ahead`). Differs from multiprocessing's forkserver: a server
of its own (a user's ``set_forkserver_preload`` is not touched), NumPy and the parent's
packages preloaded (not its main module), the parent's state of now, children forked
ahead.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import select
import signal
import socket
import sys
import threading
import types
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from multiprocessing import context as mp_context
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import popen_forkserver as mp_popen_forkserver
from multiprocessing import reduction as mp_reduction
from multiprocessing import resource_tracker as mp_resource_tracker
from multiprocessing import spawn as mp_spawn
from multiprocessing import util as mp_util
from multiprocessing.process import BaseProcess
from typing import Any

from .temp_folder import fork_server_folder

logger = logging.getLogger("sharexec")

# What sharexec's server imports once, so that every worker forked from it starts warm:
# the worker's side (loky's worker loop, cloudpickle, our queues) and the backward pass,
# hence NumPy. Names only: this module imports none of them. Then the parent's
# packages, through the module below (see there).
WARM_PRELOAD = ("sharexec._worker", "sharexec._reduction")
_PRELOADER = "sharexec._loky.warm_preload"
PRELOAD_PREFIX = _PRELOADER + "."

# In the server, while it imports a package of the parent's: no executor starts there.
_preloading = False


def preloading(now: bool) -> None:
    """In the warm server: whether it is importing one of the parent's packages."""
    global _preloading
    _preloading = now


def parent_packages() -> dict[str, list[str]]:
    """The top-level packages this process imported, in their order, that its workers
    should find imported, each with its modules imported here (itself first), e.g.
    ``{"scipy": ["scipy", "scipy.stats", ...]}``: not the standard library's, nor the
    main module, nor a private name (``_pytest``: what a public package imports), nor
    a module made at run time (no ``__spec__``), nor sharexec (its parent's side is no
    worker's business: the server imports :data:`WARM_PRELOAD`)."""
    packages: dict[str, list[str]] = {}
    for name, module in list(sys.modules.items()):
        top = name.partition(".")[0]
        if (
            top.startswith("_")
            or top == "sharexec"
            or not top.isidentifier()
            or top in sys.stdlib_module_names
            or top in sys.builtin_module_names
            or getattr(module, "__spec__", None) is None
        ):
            continue
        if top == name:
            packages[top] = [top, *packages.get(top, [])]
        else:
            packages.setdefault(top, []).append(name)
    return {top: modules for top, modules in packages.items() if modules[0] == top}


# The most children forked ahead (_WarmServer.ahead), e.g. the workers of the next pool.
MAX_SPARES = 4


class _Spare:
    """A child of the server, forked ahead or now, until it becomes a worker.

    Forked with one descriptor of its own, a socket to this process: it waits on it
    (:func:`_await_activation`, the first thing it reads from the parent's pipe, written
    at the request) for the descriptors and the preparation data of the worker it
    becomes (:meth:`activate`), and exits quietly if the socket closes first (this
    process exits or lets it go: :meth:`close`).
    """

    __slots__ = ("pid", "server", "sock", "status", "write")

    def __init__(self, server: int, status: int, write: int, sock: socket.socket) -> None:
        self.server = server  # the server that forks it, e.g. 4711
        self.status = status  # the server's pipe: the child's pid, then its exit status
        self.write = write  # the pipe the child reads from (its process object, next)
        self.sock = sock
        self.pid: int | None = None  # None until read from ``status``

    def activate(self, fds: list[int], prepared: bytes) -> None:
        """Make it a worker: it inherits ``fds`` (and this process's resource tracker)
        and unpickles ``prepared`` as its preparation data."""
        tracker = mp_resource_tracker.getfd()  # started if it is not running
        assert tracker is not None
        header = len(prepared).to_bytes(8, "little")
        socket.send_fds(self.sock, [header], [tracker, *fds])
        self.sock.sendall(prepared)
        self.sock.close()

    def close(self) -> None:
        """Let it go (it exits, if it was waiting), or close what is left of it here."""
        self.sock.close()
        for fd in (self.status, self.write):
            with contextlib.suppress(OSError):
                os.close(fd)


# The most descriptors a worker inherits (multiprocessing's forkserver's own bound).
_MAX_FDS = mp_forkserver.MAXFDS_TO_SEND


def _await_activation() -> Any:
    """In a child of the warm server: wait until the parent makes it a worker, then
    return its preparation data (the call its first pickle makes, see :class:`_Spare`).

    Takes the worker's descriptors where multiprocessing's forkserver child finds
    them (its resource tracker's, and the ones ``get_inherited_fds`` returns, which
    the request set to the socket only). SIGINT is ignored meanwhile (a Ctrl-C of the
    parent's terminal is no business of a child that waits), and the parent's
    disposition taken with the rest of its state (``_take_parent_state``, first in
    the preparation data). Exits at once, quietly, if the parent lets it go or is gone.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # What the worker's start would read (see _take_parent_state), read while waiting.
    global _ignored_here
    _ignored_here = _ignored_now()
    inherited = mp_forkserver.get_inherited_fds()
    assert inherited is not None
    with socket.socket(fileno=inherited[0]) as sock:
        _rehearse(sock)
        header, fds, _, _ = socket.recv_fds(sock, 8, _MAX_FDS + 1)
        if len(header) < 8:
            os._exit(0)
        size = int.from_bytes(header, "little")
        data = bytearray()
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            if not chunk:
                os._exit(0)
            data += chunk
    tracker: Any = mp_resource_tracker._resource_tracker
    with contextlib.suppress(OSError, TypeError):
        os.close(tracker._fd)
    child: Any = mp_forkserver._forkserver
    tracker._fd, *child._inherited_fds = fds
    return pickle.loads(data)


# The modules whose functions and classes a worker's start runs (its process object
# unpickled, loky's worker loop, run_initializer, its first call loaded), by name.
_REHEARSED = (
    "multiprocessing.synchronize",
    "multiprocessing.connection",
    "multiprocessing.queues",
    "multiprocessing.process",
    "multiprocessing.util",
    "loky.process_executor",
    "loky.backend.queues",
    "threading",
    "sharexec._loky.queues",
    "sharexec._worker",
    "sharexec._session",
)


def _rehearse(sock: socket.socket) -> None:
    """In a child of the server that waits to become a worker: touch the functions
    (and their code) and classes of :data:`_REHEARSED`, until the parent's word is
    there.

    A fork's first write to each page of the server's objects copies it (2.5 µs a
    page here); a worker's start wrote to some 570 (the reference counts of what it
    runs), 2.5 ms of CPU. Touched while a spare waits, about half of them are copied
    already when it becomes a worker, at the price of as many more copied ahead that
    it may never need (about 1.2 MB more of its own). A child told at once (no spare
    was waiting) skips it."""
    told = select.poll()  # not select(): a descriptor number may be above 1,024
    told.register(sock, select.POLLIN)
    for name in _REHEARSED:
        if told.poll(0):
            return
        module = sys.modules.get(name)
        for value in list(vars(module).values()) if module is not None else ():
            if isinstance(value, type) and value.__module__ == name:
                for member in list(vars(value).values()):
                    if isinstance(member, types.FunctionType):
                        member.__code__  # noqa: B018  (the touch is the point)
            elif isinstance(value, types.FunctionType) and value.__module__ == name:
                value.__code__  # noqa: B018


class _Activation:
    """Pickles as a call of :func:`_await_activation`."""

    def __reduce__(self) -> tuple[Callable[[], Any], tuple[()]]:
        return _await_activation, ()


_AWAIT_ACTIVATION = pickle.dumps(_Activation(), protocol=pickle.HIGHEST_PROTOCOL)


class _WarmServer:
    """sharexec's own fork server: multiprocessing's ``ForkServer``, a second instance.

    Not the module's global one, which belongs to the user (``mp_context="forkserver"``
    and ``set_forkserver_preload`` keep their meaning). Started by the first warm
    process, as multiprocessing starts its own (a fresh interpreter, fork + exec, so a
    parent's threads are no hazard); its only thread is the main one (NumPy's OpenBLAS
    joins its pool at fork), so each worker is a fork of a single-threaded process. It
    exits when the last process holding its "alive" pipe (this one, its workers) has.

    A server that dies (killed, out of memory) is started again, as the sweeper is:
    multiprocessing starts another when it finds its server exited, and a fork request
    that fails on the way (refused, or cut before the child's pid came back: the server
    is dying) stops and reaps it, then asks a new one, once. Requests take turns (the
    server forks one at a time anyway), so one restart serves all who noticed and no
    request sends the pipe of a server another one just let go. Its workers live on:
    none depends on it but for its exit status. The socket file of a server gone is
    removed.
    """

    def __init__(self) -> None:
        self.server = mp_forkserver.ForkServer()
        self.sockets: set[str] = set()  # the socket files of our servers, e.g. {"/tmp/…"}
        self.lock = threading.Lock()  # one request (or start) at a time
        # The parent's packages the next server imports (see parent_packages), and
        # those left out because their import starts a thread, e.g. {"dask"}.
        self.packages: dict[str, list[str]] = {}
        self.left_out: set[str] = set()
        # The file of the running server's orders (in multiprocessing's private folder
        # of this process, beside the server's socket: temp_folder), e.g.
        # "/tmp/pymp-…/sharexec-warm-…": None, a new server next.
        self.orders: str | None = None
        # Children forked ahead, waiting to become workers (see ahead), oldest first.
        self.spares: list[_Spare] = []

    def start(self) -> None:
        """Start the server now if it is not running: it imports while we go on (the
        packages this process has imported now, for a server started from now on: read
        only then, not at each executor, whose start it would slow by 0.3 ms)."""
        if _preloading:
            raise RuntimeError("no executor starts in sharexec's warm server")
        with self.lock:
            if self.orders is None:  # a new server (one restarted keeps its orders)
                packages = parent_packages()
                self.packages = {n: m for n, m in packages.items() if n not in self.left_out}
            self._start()

    def fork(self, fds: list[int], prepared: bytes) -> tuple[int, int, int]:
        """A child of the server that inherits ``fds`` and is told ``prepared`` (the
        pickled preparation data): a spare forked ahead (:meth:`ahead`) if one is
        waiting, else one forked now.

        Returns the child's pid, the read end of the pipe on which the server writes
        its exit status, and the write end of the pipe the child reads its process
        object from (next: ``prepared`` went on the child's socket).
        """
        if _preloading:
            raise RuntimeError("no executor starts in sharexec's warm server")
        with self.lock:
            for _ in range(3):  # a spare that died meanwhile (killed): the next one
                spare = self._take()
                try:
                    spare.activate(fds, prepared)
                except OSError:
                    spare.close()
                    continue
                assert spare.pid is not None
                return spare.pid, spare.status, spare.write
            raise ConnectionError("sharexec's warm server forked no child that took its task")

    def ahead(self, count: int) -> None:
        """Fork children ahead until ``count`` wait (at most :data:`MAX_SPARES`), each
        to become a worker at a later :meth:`fork`, which then waits for no fork. Asks
        only: the server forks them while this process goes on. Nothing if no server
        was started (one that died is started again, as by a fork)."""
        with self.lock:
            if self.orders is None:
                return
            try:
                used = self._start()
                for gone in [s for s in self.spares if s.server != used]:
                    self.spares.remove(gone)  # of a server gone: no status can come
                    gone.close()
                while len(self.spares) < min(count, MAX_SPARES):
                    self.spares.append(self._request(used))
            except (OSError, ChildProcessError):
                return  # the server is gone: the next fork starts another

    def waiting(self) -> list[int]:
        """The pids of the children forked ahead that wait to become workers, oldest
        first (each read from the server when not yet), e.g. ``[4712, 4713]``."""
        with self.lock:
            for spare in list(self.spares):
                if spare.pid is None:
                    try:
                        spare.pid = mp_forkserver.read_signed(spare.status)
                    except (EOFError, OSError):
                        self.spares.remove(spare)
                        spare.close()
            return [spare.pid for spare in self.spares if spare.pid is not None]

    def _take(self) -> _Spare:
        """A spare of the running server whose pid came back, else a child forked now
        (a server started if none runs; see :meth:`fork`)."""
        used = self._start()
        while self.spares:
            spare = self.spares.pop(0)
            if spare.server != used:  # of a server gone: its status could not come
                spare.close()
                continue
            try:
                if spare.pid is None:
                    spare.pid = mp_forkserver.read_signed(spare.status)
            except (EOFError, OSError):
                spare.close()
                self._failed(used)
                used = self._start()
                continue
            return spare
        retries = 1  # a server that failed: a new one, once (more if it left one out)
        while True:
            try:
                return self._forked_now(used)
            except (EOFError, OSError):  # the server failed the request
                if not self._failed(used):
                    if not retries:
                        raise
                    retries -= 1
                used = self._start()

    def _forked_now(self, used: int) -> _Spare:
        """A child the server ``used`` forks now, its pid read."""
        spare = self._request(used)
        try:
            spare.pid = mp_forkserver.read_signed(spare.status)
        except BaseException:
            spare.close()
            raise
        return spare

    def _request(self, used: int) -> _Spare:
        """Ask the server ``used`` for a child (its pid not read yet)."""
        ours, theirs = socket.socketpair()
        try:
            try:
                status, write = self.server.connect_to_new_process([theirs.fileno()])
            finally:
                theirs.close()
        except BaseException:
            ours.close()
            raise
        spare = _Spare(used, status, write, ours)
        try:
            os.write(write, _AWAIT_ACTIVATION)  # the child's first read: wait for the rest
        except OSError:
            spare.close()
            raise
        return spare

    def _failed(self, pid: int) -> bool:
        """The server ``pid`` failed a request: forget it; whether it had left a package
        out (its import starts a thread), so that the next one starts without it."""
        self._forget(pid)
        orders, self.orders = self.orders, None
        if orders is None:
            return False
        try:
            with open(orders + ".left-out") as f:
                package = f.read()
            os.unlink(orders + ".left-out")
        except OSError:
            return False
        if package not in self.packages:
            return False
        self.left_out.add(package)
        del self.packages[package]
        logger.debug(
            "the warm server does not preload %r: its import starts a thread, and the "
            "server forks its workers from a process with no thread but its own",
            package,
        )
        return True

    def _start(self) -> int:
        """The server's pid, started if it is not running."""
        server: Any = self.server
        if self.orders is None:  # a new server: its orders (also if it dies and restarts)
            name = f"sharexec-warm-{os.urandom(6).hex()}"
            self.orders = os.path.join(fork_server_folder(), name)
            with open(self.orders, "w") as f:
                json.dump({"path": sys.path, "packages": list(self.packages.values())}, f)
            order = f"{PRELOAD_PREFIX}orders_{self.orders.encode().hex()}"
            server.set_forkserver_preload([*WARM_PRELOAD, _PRELOADER, order])
        try:
            server.ensure_running()
        except ChildProcessError:  # it exited and someone reaped it (os.wait(), SIGCHLD)
            self._forget(server._forkserver_pid, signal_it=False)
            server.ensure_running()
        address = server._forkserver_address
        if address not in self.sockets:  # a new server: the others are gone
            for gone in self.sockets:
                with contextlib.suppress(OSError):
                    os.unlink(gone)
            self.sockets.clear()
            if not mp_util.is_abstract_socket_namespace(address):
                self.sockets.add(address)
        pid: int = server._forkserver_pid
        return pid

    def _forget(self, pid: int, signal_it: bool = True) -> None:
        """Stop and reap the server ``pid``, so that the next request starts another
        (as multiprocessing does for one that exited); without ``signal_it``, only
        forget it (another wait reaped it: the pid may be another process's now)."""
        server: Any = self.server
        if signal_it:
            try:  # still our child (not reaped by another wait), so the pid is its
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                pass
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # if it is not dead yet: no use any more
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)
        server._forkserver_address = None
        server._forkserver_alive_fd = None
        server._forkserver_pid = None

    def after_fork_in_child(self) -> None:
        # A forked child of this process cannot wait for its parent's server: it starts
        # its own, if it ever needs one. Its copy of the "alive" pipe goes at once; the
        # parent's socket files are the parent's to remove.
        alive: int | None = getattr(self.server, "_forkserver_alive_fd", None)
        self.server = mp_forkserver.ForkServer()
        self.sockets = set()
        self.orders = None
        self.lock = threading.Lock()
        for spare in self.spares:  # the parent's: only this copy of their ends goes
            spare.close()
        self.spares = []
        if alive is not None:
            with contextlib.suppress(OSError):
                os.close(alive)


_warm_server = _WarmServer()
os.register_at_fork(after_in_child=_warm_server.after_fork_in_child)

# Signals every Python interpreter ignores from its start (so that a write to a closed
# pipe raises, a large file is an error): a worker ignores them as one started afresh.
_IGNORED_BY_PYTHON = frozenset(
    getattr(signal, name) for name in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, name)
)


def _status_field(status: str, name: str) -> int:
    """A number of ``/proc/self/status``: the ``Umask`` (octal) or ``SigIgn``
    (hexadecimal) line's."""
    at = status.find(f"\n{name}:")
    if at < 0:
        raise LookupError(f"no {name} in /proc/self/status")
    value = status[at + len(name) + 2 : status.find("\n", at + 1)]
    return int(value, 8 if name == "Umask" else 16)


_VALID_SIGNALS = frozenset(int(number) for number in signal.valid_signals())


def _signals(mask: int) -> set[int]:
    """The signals of a mask of /proc (bit n-1 for signal n) that Python can set."""
    return {n for n in _VALID_SIGNALS if mask >> (n - 1) & 1}


class _ParentState:
    """What a worker of the warm server takes from its parent as it is now, not as it
    was when the server started: the environment, the umask, the ignored signals and
    the starting thread's signal mask (the working directory and ``sys.path`` travel
    in multiprocessing's own preparation data).

    Read in the parent for each fork request (a read of ``/proc/self/status`` and a
    copy of the environment: 0.2 ms on a busy machine, where a worker's start takes
    25 ms or more), and put first in the request's preparation data: it pickles as a
    call of :func:`_take_parent_state`, so the child applies it while it unpickles that
    data, before anything else of the request is loaded and before
    ``multiprocessing.spawn.prepare`` runs.
    """

    def __init__(self) -> None:
        with open("/proc/self/status") as f:
            status = f.read()
        self.environ = dict(os.environb)
        self.umask = _status_field(status, "Umask")
        self.ignored = _signals(_status_field(status, "SigIgn"))
        self.blocked = {int(number) for number in signal.pthread_sigmask(signal.SIG_BLOCK, ())}

    def __reduce__(
        self,
    ) -> tuple[
        Callable[[dict[bytes, bytes], int, set[int], set[int]], None],
        tuple[dict[bytes, bytes], int, set[int], set[int]],
    ]:
        return _take_parent_state, (self.environ, self.umask, self.ignored, self.blocked)


def _ignored_now() -> set[int]:
    """The signals this process ignores now."""
    with open("/proc/self/status") as f:
        return _signals(_status_field(f.read(), "SigIgn"))


# In a child of the warm server, the signals it ignores, read while it waited to become
# a worker (nothing changes them meanwhile: the child runs only its main thread, in
# _await_activation), e.g. {2, 13}: its start reads them no more.
_ignored_here: set[int] | None = None


def _take_parent_state(
    environ: dict[bytes, bytes], umask: int, ignored: set[int], blocked: set[int]
) -> None:
    """In a warm worker: become the parent's environment, umask and signal state.

    A signal the parent ignores is ignored; one it does not ignore but the server did
    (it started with the parent of that time) gets back a new interpreter's
    disposition: Python's ``KeyboardInterrupt`` for ``SIGINT``, ignored for ``SIGPIPE``
    and ``SIGXFSZ``, the default for the rest. These are what a spawned worker gets.
    """
    here = os.environb
    for name in [name for name in here if name not in environ]:
        del here[name]
    for name, value in environ.items():
        if here.get(name) != value:
            here[name] = value
    os.umask(umask)
    ignored_here = _ignored_now() if _ignored_here is None else _ignored_here
    for number in ignored - ignored_here:
        signal.signal(number, signal.SIG_IGN)
    for number in ignored_here - ignored - _IGNORED_BY_PYTHON:
        default = signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
        signal.signal(number, default)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _WarmPopen(mp_popen_forkserver.Popen):
    """multiprocessing's forkserver ``Popen``, asking sharexec's server for the fork.

    The child is told nothing of the parent's main module (as loky's start method):
    its code reaches workers inside pickles, so no script is imported again, and a
    script needs no ``if __name__ == "__main__"`` guard for it. It is told the parent's
    state of now (:class:`_ParentState`), first.

    Its sentinel is a pipe the child holds the write end of (as under ``fork`` and
    ``spawn``), not the server's status pipe: the parent sees a worker end when the
    worker does, and a server that dies takes no worker with it. The exit status still
    comes from the server, which reaps its children; 255 if the server is gone.
    """

    _status: int | None = None  # the server's pipe: the child's pid, then its exit status

    def _launch(self, process_obj: BaseProcess) -> None:
        data = mp_spawn.get_preparation_data(process_obj.name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        data = {"sharexec_parent_state": _ParentState(), **data}
        buffer = io.BytesIO()
        mp_context.set_spawning_popen(self)  # fds the process carries go with the request
        try:
            mp_reduction.dump(data, buffer)
            prepared = buffer.tell()
            mp_reduction.dump(process_obj, buffer)
        finally:
            mp_context.set_spawning_popen(None)
        fds: list[int] = self._fds  # type: ignore[attr-defined]  # duplicate_for_child's
        sentinel, held = os.pipe()
        try:
            self.pid, self._status, write = _warm_server.fork(
                [*fds, held], bytes(buffer.getbuffer()[:prepared])
            )
        except BaseException:
            os.close(sentinel)
            raise
        finally:
            os.close(held)
        self.sentinel = sentinel
        # The child takes the closing of this pipe's write end for its parent's death:
        # one copy stays open for as long as this object lives.
        kept = os.dup(write)
        close_fds = mp_util.close_fds  # type: ignore[attr-defined]
        self.finalizer = mp_util.Finalize(self, close_fds, (kept, sentinel, self._status))
        with open(write, "wb", closefd=True) as pipe:
            pipe.write(buffer.getbuffer()[prepared:])

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        if self.returncode is None:
            timeout = 0 if flag == os.WNOHANG else None
            if not mp_connection.wait([self.sentinel], timeout):
                return None
            # The child is gone: the server writes its status once it has reaped it.
            code = 255
            if self._status is not None and mp_connection.wait([self._status], _REAPED_WITHIN):
                with contextlib.suppress(OSError, EOFError):
                    code = mp_forkserver.read_signed(self._status)
            self.returncode = code
        return self.returncode


# How long a worker's exit status may take to come from a live server after the worker
# is gone (it reaps at once: this bounds a stopped server's delay, then 255).
_REAPED_WITHIN = 5.0


class _WarmProcess(mp_context.ForkServerProcess):
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _WarmPopen:
        return _WarmPopen(process_obj)


class _WarmContext(mp_context.ForkServerContext):
    """A forkserver context whose processes are forks of sharexec's warm server."""

    Process = _WarmProcess

    def start_server(self) -> None:
        """Start the server (if it is not running), so that it warms up meanwhile."""
        _warm_server.start()

    def fork_ahead(self, count: int) -> None:
        """Have ``count`` children of the server forked ahead, for the workers of a
        pool to come (see :meth:`_WarmServer.ahead`)."""
        _warm_server.ahead(count)


_warm = _WarmContext()


def warm_left_out() -> set[str]:
    """The parent's packages that the warm server leaves out, their import starting a
    thread (a copy), e.g. ``{"dask"}``."""
    return set(_warm_server.left_out)


def warm_context() -> mp_context.ForkServerContext:
    """sharexec's default start method: forks of a server that imported
    :data:`WARM_PRELOAD` (a ``forkserver`` context; see :class:`_WarmServer`)."""
    return _warm
