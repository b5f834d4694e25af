"""Fixtures shared by the whole suite: start methods, executors, and leak checks."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import multiprocessing
import os
import select
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path

import faults_plugin
import pytest

import sharexec
from sharexec import _segments

# None: sharexec's default (forks of its warm server), test id "default".
START_METHODS: list[str | None] = ["spawn", "fork", "forkserver", "loky", None]

# See session_site/sharexec_test_members.py: every Python process this session starts
# records itself there as it starts, so that a segment whose creator is dead can be told
# to be this session's (a killed worker's) or another program's on the machine.
SESSION_SITE = Path(__file__).parent / "session_site"


def _members_module() -> types.ModuleType:
    """The recorder: the one this process's sitecustomize loaded, if it did (a session run
    inside another), else loaded from its file (it is not on sys.path here)."""
    loaded = sys.modules.get("sharexec_test_members")
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(
        "sharexec_test_members", SESSION_SITE / "sharexec_test_members.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["sharexec_test_members"] = module
    return module


members_module = _members_module()
_members_file: str | None = None  # this session's, e.g. "/tmp/pytest-sharexec-x1/members"


def pytest_configure(config: pytest.Config) -> None:
    faults_plugin.register(config)  # only with SHAREXEC_FAULTS_REPORT set (nox -s faults)
    _start_recording_members()


def pytest_unconfigure(config: pytest.Config) -> None:
    global _members_file
    if _members_file is not None:
        shutil.rmtree(os.path.dirname(_members_file), ignore_errors=True)
        _members_file = None
        for name, value in _environ_before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# The variables _start_recording_members changed, as they were before, e.g.
# {"PYTHONPATH": None, "PYTEST_SHAREXEC_MEMBERS": None}.
_environ_before: dict[str, str | None] = {}


def _start_recording_members() -> None:
    """Name this session's members file in the environment its processes inherit, with
    the recording sitecustomize first on their PYTHONPATH; record this process."""
    global _members_file
    if _members_file is not None:
        return
    folder = tempfile.mkdtemp(prefix="pytest-sharexec-members-")
    _members_file = os.path.join(folder, "members")
    env = members_module.ENV
    for name in (env, "PYTHONPATH"):
        _environ_before[name] = os.environ.get(name)
    os.environ[env] = os.pathsep.join(filter(None, [os.environ.get(env), _members_file]))
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SESSION_SITE), path]))
    members_module.install()


def session_members() -> dict[int, set[int | None]]:
    """The processes this session started so far (live or not): {pid: {start times}}."""
    return members_module.members(_members_file) if _members_file else {}


# Helper processes that outlive a pool by design (one of each per test session).
_HELPERS = ("resource_tracker", "forkserver import main", "sweeper_main")


def descendants(pid: int | None = None) -> dict[int, str]:
    """Every live descendant of ``pid`` (default: this process), with its command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: dict[int, str] = {}
    todo = [os.getpid() if pid is None else pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    found[child] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            todo.append(child)
    return found


def wait_exit(pids: list[int], timeout: float) -> list[int]:
    """Wait until every pid has exited (or the timeout); return those still alive."""
    fds = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds[pid] = os.pidfd_open(pid)
    try:
        alive = dict(fds)
        deadline = timeout
        while alive and deadline > 0:
            ready, _, _ = select.select(list(alive.values()), [], [], deadline)
            if not ready:
                break
            alive = {p: fd for p, fd in alive.items() if fd not in ready}
        return list(alive)
    finally:
        for fd in fds.values():
            os.close(fd)


def workers_left() -> dict[int, str]:
    """Descendants that are not the long-lived helpers (resource trackers, fork servers)."""
    return {p: cmd for p, cmd in descendants().items() if not any(h in cmd for h in _HELPERS)}


def creator(name: str) -> int | None:
    """The pid in a segment's name (``sharexec-<pid>-<random>``), None if there is none."""
    pid = name.split("-")[1] if name.count("-") >= 2 else ""
    return int(pid) if pid.isdigit() else None


class Segments(set[str]):
    """What :func:`segments_now` found: the names, and which of the session's processes
    were no longer running then (each pid with the start times recorded for it).

    ``after - before`` is the segments made in between. A segment whose creator is a
    dead member of the session counts, unless that member was already gone at
    ``before`` and the session recorded no new process with its pid since: then another
    program made it, with a pid the session once had (pids wrap at 32768 here, and two
    suites on one machine reuse each other's within minutes).
    """

    members: dict[int, set[int | None]]  # session_members() then
    gone: dict[int, set[int | None]]  # e.g. {4711: {123456}}
    by_gone: dict[str, int]  # the names counted for a dead member: {name: pid}

    def __sub__(self, other: AbstractSet[object]) -> set[str]:
        gone_then: dict[int, set[int | None]] = getattr(other, "gone", {})
        return {n for n in set(self).difference(other) if not self._reused(n, gone_then)}

    def _reused(self, name: str, gone_then: dict[int, set[int | None]]) -> bool:
        """Whether ``name``'s creator, a dead member, was gone already at ``gone_then``
        with no process of the session started since under its pid."""
        pid = self.by_gone.get(name)
        return pid is not None and pid in gone_then and self.members[pid] <= gone_then[pid]


def segments_now() -> Segments:
    """The sharexec segments that exist now and that this test session made.

    A segment's name carries its creator's pid. The creator is this session's if it is
    this process or a live descendant, or if it was recorded as one of the session's
    processes when it started (see ``session_members``): then it may be dead (a killed
    worker, a worker whose results this process adopted), and if alive it must be the
    same process (its start time), not another one that got its pid since. Segments of
    other programs on the machine (another checkout's tests, a user's job), dead or
    alive, are never counted, nor in a difference (:class:`Segments`) those of a pid the
    session once had.
    """
    ours = {os.getpid(), *descendants()}
    members = session_members()
    running = {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}
    names = Segments()
    names.members, names.gone, names.by_gone = members, {}, {}
    for member, starts in members.items():
        if member not in running or members_module.start_time(member) not in starts:
            names.gone[member] = set(starts)
    for name in _segments.listdir():
        pid = creator(name)
        if pid is None:
            continue
        if pid in ours:
            names.add(name)
        elif pid in members:
            started = members_module.start_time(pid)
            if started is None or started in members[pid]:
                names.add(name)
                if started is None:
                    names.by_gone[name] = pid
    return names


def method_id(method: str | None) -> str:
    """A start method as a test id or a script's argument: ``default`` for None."""
    return "default" if method is None else method


@pytest.fixture(params=START_METHODS, ids=method_id)
def start_method(request: pytest.FixtureRequest) -> str | None:
    """Every behaviour is tested under each start method, and sharexec's default (None:
    the ``mp_context`` a user who passes none gets)."""
    method: str | None = request.param
    return method


@pytest.fixture
def mp_context(start_method: str | None) -> multiprocessing.context.BaseContext:
    """A multiprocessing context for the start method (loky's own for "loky")."""
    if start_method == "loky":
        from loky.backend.context import get_context

        return get_context("loky")
    if start_method is None:
        from sharexec._loky import warm_context

        context: multiprocessing.context.BaseContext = warm_context()
        return context
    return multiprocessing.get_context(start_method)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fails the test if it leaves a child process or a sharexec segment behind."""
    before = segments_now()
    yield
    drop_warm_arrays()
    assert_none_left(segments_now() - before)
    if workers_left():
        faults_plugin.crashed("processes left behind")
    assert not workers_left(), f"processes left behind: {workers_left()}"


def drop_warm_arrays() -> None:
    """Collect garbage, and drop the process's warm segments of collected shared arrays:
    served again to the next allocation, they are held by design (bounded, dropped after
    WARM_IDLE_SECONDS). After this, every segment a test made must be gone."""
    gc.collect()
    from sharexec._arrays import recycling

    recycling.clear()


def assert_none_left(left: set[str]) -> None:
    """Fails if segments were left; the fault report (nox -s faults) counts them."""
    faults_plugin.leaked(left)
    assert not left, f"segments left behind: {sorted(left)}"


@pytest.fixture
def executor(
    start_method: str | None, no_leaks: None
) -> Iterator[sharexec.SharedProcessPoolExecutor]:
    """A 2-worker executor, shut down (waiting) on teardown; nothing may be left after."""
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
    try:
        yield ex
    finally:
        ex.shutdown(wait=True)
        if ex._flags.broken is not None:
            faults_plugin.crashed("the pool was broken")
        assert ex._flags.broken is None, "the pool was broken"
