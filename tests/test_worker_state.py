"""What a worker takes from its parent, and a warm server that dies.

A worker of an executor sees the parent's environment, working directory, umask,
ignored signals and signal mask as they are when it starts, as the standard library's
``spawn`` and ``fork`` give them (``forkserver``'s are its server's, there as in the
standard library). Under the default start method, a warm server killed is started
again: live executors, their running workers and the next executor go on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import startup_workers as sw
import state_workers
from conftest import wait_exit

import sharexec
from sharexec import _loky

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def parent_state() -> Iterator[None]:
    """Whatever the block changes of this process's state is put back after it."""
    environ = dict(os.environ)
    cwd = os.getcwd()
    mask = os.umask(0o022)
    os.umask(mask)
    handlers = {n: signal.getsignal(n) for n in (signal.SIGUSR1, signal.SIGUSR2)}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for number, handler in handlers.items():
            signal.signal(number, handler)
        os.umask(mask)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)


def change_state(folder: Path) -> None:
    """A new variable and one gone, another directory, umask, ignored signal and
    blocked signal; SIGUSR2 no longer ignored."""
    os.environ["SHAREXEC_TEST_NEW"] = "new"
    os.environ.pop("SHAREXEC_TEST_GONE", None)
    folder.mkdir(exist_ok=True)
    os.chdir(folder)
    os.umask(0o027)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])


def old_state() -> None:
    """What change_state undoes: a variable it removes, SIGUSR2 ignored, a umask."""
    os.environ["SHAREXEC_TEST_GONE"] = "old"
    os.umask(0o077)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def warm_server() -> tuple[int, str]:
    """The pid and socket file of sharexec's warm server, started if it is not."""
    _loky.warm_server._warm_server.start()
    server = _loky.warm_server._warm_server.server
    return server._forkserver_pid, server._forkserver_address


def kill_warm_server(wait: bool) -> tuple[int, str]:
    """SIGKILL the warm server; with ``wait``, until it has exited (not reaped).

    The children it forked ahead are let go first: a spare of a server whose death is
    not noticed yet still becomes a worker (it needs no fork), so the next worker would
    not need the server whose restart these tests are about."""
    server = _loky.warm_server._warm_server
    with server.lock:
        for spare in server.spares:
            spare.close()
        server.spares.clear()
    pid, address = warm_server()
    os.kill(pid, signal.SIGKILL)
    if wait:
        assert not wait_exit([pid], 30.0)
    return pid, address


# ---------------------------------------------------------------------------------------
# The parent's state of now
# ---------------------------------------------------------------------------------------


def test_a_later_executors_workers_see_the_parents_state_of_now(
    start_method, no_leaks, tmp_path: Path
):
    with parent_state():
        old_state()
        with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
            before = ex.submit(state_workers.state).result()
        change_state(tmp_path / "later")
        with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
            seen = ex.submit(state_workers.state).result()
        if start_method == "forkserver":
            # The standard library's forkserver: its server's state, but the directory.
            context = multiprocessing.get_context("forkserver")
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as stdlib:
                expected = stdlib.submit(state_workers.state).result()
            assert expected["cwd"] == str(tmp_path / "later")
        else:  # what the standard library's spawn and fork give: the parent's own
            expected = state_workers.state()
            assert expected["SHAREXEC_TEST_NEW"] == "new"
            assert expected["umask"] == 0o027
            assert expected["SIGUSR1 ignored"] and expected["SIGTERM blocked"]
    assert seen == expected
    assert seen != before


def test_a_warm_worker_drops_the_state_its_server_started_with(no_leaks, tmp_path: Path):
    with parent_state():
        old_state()
        kill_warm_server(wait=True)  # the next executor starts a server with this state
        with sharexec.SharedProcessPoolExecutor(1) as ex:
            before = ex.submit(state_workers.state).result()
        assert before["SHAREXEC_TEST_GONE"] == "old" and before["SIGUSR2 ignored"]
        change_state(tmp_path / "later")
        with sharexec.SharedProcessPoolExecutor(1) as ex:
            seen = ex.submit(state_workers.state).result()
        assert seen == state_workers.state()
    assert seen["SHAREXEC_TEST_GONE"] is None
    assert not seen["SIGUSR2 ignored"]


# ---------------------------------------------------------------------------------------
# A killed warm server is started again
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("wait", [True, False], ids=["exited", "dying"])
def test_a_killed_warm_server_is_started_again_for_a_live_executor(
    wait: bool, no_leaks, tmp_path: Path
):
    folder = tmp_path / "up"
    folder.mkdir()
    ex = sharexec.SharedProcessPoolExecutor(2)
    try:
        first = ex.submit(sw.pid).result()  # one worker, forked by the server
        old, address = kill_warm_server(wait)
        # The running worker goes on; the second one comes from a new server.
        futures = [ex.submit(sw.rendezvous, str(folder), 2) for _ in range(2)]
        pids = {f.result() for f in futures}
        assert first in pids and len(pids) == 2
        assert warm_server()[0] != old
        assert ex._flags.broken is None
    finally:
        ex.shutdown(wait=True)
    assert not os.path.exists(address)  # the dead server's socket file is removed


def test_a_killed_warm_server_is_started_again_for_the_next_executor(no_leaks):
    for _ in range(3):  # killed as the next executor starts: refused, or cut mid-request
        with sharexec.SharedProcessPoolExecutor(1) as ex:
            ex.submit(sw.pid).result()
        old, address = kill_warm_server(wait=False)
        with sharexec.SharedProcessPoolExecutor(1) as ex:
            assert ex.submit(sw.pid).result() != os.getpid()
        assert warm_server()[0] != old
        assert not os.path.exists(address)


def test_a_warm_server_reaped_by_someone_else_is_started_again(no_leaks):
    with sharexec.SharedProcessPoolExecutor(1) as ex:
        ex.submit(sw.pid).result()
    old, _ = kill_warm_server(wait=True)
    os.waitpid(old, 0)  # as a program's own os.wait() or SIGCHLD handler would
    with sharexec.SharedProcessPoolExecutor(1) as ex:
        assert ex.submit(sw.pid).result() != os.getpid()
    assert warm_server()[0] != old
