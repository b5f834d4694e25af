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
import time
import types
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path

import faults_plugin
import pytest

import sharexec
from sharexec import _segments

# What a test is about decides the start methods it runs under (docs/design.md,
# "How the tests are organised"). Process semantics (start-up, fork/spawn differences,
# initializer, crashes, signals, recycling, the warm server) differ by start method: every
# one. Transport semantics (what is shared, copied, pickled, written back; statistics;
# batching; tensors; protocol-5 objects) happen after a worker has started, the same
# way whatever started it: sharexec's default and spawn (the one that shares nothing
# with the parent), on a pool reused across the tests of a module; mark such a test
# (or module) ``transport``. None: sharexec's default (forks of its warm server), test
# id "default".
START_METHODS: list[str | None] = ["spawn", "fork", "forkserver", "loky", None]
TRANSPORT_METHODS: list[str | None] = [None, "spawn"]

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
    """The processes this session started so far (live or not): {pid: {start times}}.

    The members file only grows: each call reads what was appended since the last one.
    """
    global _members_read
    if _members_file is None:
        return {}
    try:
        with open(_members_file, "rb") as f:
            f.seek(_members_read)
            appended = f.read()
    except FileNotFoundError:
        return {}
    complete = appended[: appended.rfind(b"\n") + 1]  # a line being written waits
    _members_read += len(complete)
    for line in complete.decode().splitlines():
        pid, _, started = line.partition(" ")
        _members_seen.setdefault(int(pid), set()).add(None if started == "None" else int(started))
    return {pid: set(starts) for pid, starts in _members_seen.items()}


# What session_members read so far: the bytes, and the members in them.
_members_read = 0
_members_seen: dict[int, set[int | None]] = {}


# Helper processes that outlive a pool by design (one of each per test session).
_HELPERS = ("resource_tracker", "forkserver import main", "sweeper_main")


def descendants(pid: int | None = None) -> dict[int, str]:
    """Every live descendant of ``pid`` (default: this process), with its command line.

    Walks down from ``pid`` through each thread's ``/proc/<pid>/task/<tid>/children``
    (a few reads per descendant, whatever else runs on the machine); where the kernel
    does not provide those files, scans every process's parent in ``/proc``.
    """
    scanned = None if _HAVE_CHILDREN_FILES else _children_by_scan()
    found: dict[int, str] = {}
    todo = [os.getpid() if pid is None else pid]
    while todo:
        parent = todo.pop()
        for child in _children(parent) if scanned is None else scanned.get(parent, []):
            if child in found:
                continue
            try:
                with open(f"/proc/{child}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # gone meanwhile
            if state == b"Z":
                continue  # exited, not yet reaped: not live (its children are reparented)
            found[child] = cmdline
            todo.append(child)
    return found


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (any of its threads may have started one)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return found


def _children_by_scan() -> dict[int, list[int]]:
    """{parent: [children]} of every process, from every ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


# CONFIG_PROC_CHILDREN: a kernel built without it has no children files.
_HAVE_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


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
    """Descendants that are not the long-lived helpers (resource trackers, fork servers)
    nor the workers of the module's reused pools (see ``executor``)."""
    kept = _reused_workers()
    return {
        p: cmd
        for p, cmd in descendants().items()
        if p not in kept and not any(h in cmd for h in _HELPERS)
    }


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


@contextlib.contextmanager
def module_by_value(name: str, source: str) -> Iterator[types.ModuleType]:
    """A module made of ``source``, pickled by value (as a script's ``__main__`` is);
    dropped afterwards with the namespace this process made of it, its globals cleared
    (pytest holds a fixture's value until every teardown is done)."""
    import cloudpickle

    from sharexec import _wire

    module = types.ModuleType(name)
    exec(source, module.__dict__)
    sys.modules[name] = module
    cloudpickle.register_pickle_by_value(module)
    try:
        yield module
    finally:
        cloudpickle.unregister_pickle_by_value(module)
        del sys.modules[name]
        _wire._namespaces.pop(name, None)
        module.__dict__.clear()


def method_id(method: str | None) -> str:
    """A start method as a test id or a script's argument: ``default`` for None."""
    return "default" if method is None else method


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--start-methods",
        default=None,
        help="run the tests of start_method under these methods only, e.g. "
        "'default,spawn' (a leg of CI's matrix whose point is not the start methods)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test of ``start_method`` runs under every start method, or, marked
    ``transport`` (and not ``process``), under TRANSPORT_METHODS; ``--start-methods``
    keeps only some of them."""
    if "start_method" in metafunc.fixturenames:
        transport = _is_transport(metafunc.definition)
        methods = TRANSPORT_METHODS if transport else START_METHODS
        only = metafunc.config.getoption("--start-methods")
        if only:
            methods = [m for m in methods if method_id(m) in only.split(",")]
        metafunc.parametrize("start_method", methods, ids=method_id, indirect=True)


def _is_transport(node: pytest.Item) -> bool:
    """Whether a test is of transport semantics: marked ``transport`` (itself or its
    module), and not ``process`` (a test of a transport module that is about how a
    worker starts, e.g. what an initializer is given)."""
    return bool(node.get_closest_marker("transport")) and not node.get_closest_marker("process")


@pytest.fixture
def start_method(request: pytest.FixtureRequest) -> str | None:
    """The start method under test (None: the ``mp_context`` a user who passes none
    gets); see ``pytest_generate_tests``."""
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
    left = workers_left()
    if left:
        faults_plugin.crashed("processes left behind")
    assert not left, f"processes left behind: {left}"


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
    request: pytest.FixtureRequest,
    start_method: str | None,
    no_leaks: None,
    reused_pools: dict[str | None, sharexec.SharedProcessPoolExecutor],
) -> Iterator[sharexec.SharedProcessPoolExecutor]:
    """A 2-worker executor; nothing may be left after the test, and it may not be broken.

    A test of process semantics gets a new one, shut down (waiting) after it. A test
    marked ``transport`` gets the module's pool for its start method (``reused_pools``),
    made at the first such test and reset after each (every call done, its warm
    segments dropped: what the test made must be gone, as ``no_leaks`` checks); one
    that breaks it or shuts it down leaves it to the next test new. Mark a transport
    test ``fresh_pool`` if it needs a pool of its own (it counts statistics from zero,
    it relies on which worker took what).
    """
    node = request.node
    reuse = _is_transport(node) and not node.get_closest_marker("fresh_pool")
    ex = reused_pools.get(start_method) if reuse else None
    if ex is None:
        ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
        if reuse:
            reused_pools[start_method] = ex
    try:
        yield ex
    finally:
        if reuse and not ex._pool_shut_down:
            try:
                _reset(ex)
            except BaseException:  # calls left running: the next test gets a new pool
                del reused_pools[start_method]
                ex.shutdown(wait=False, cancel_futures=True)
                raise
        else:
            if reuse:  # the test shut it down: the next one makes a new one
                del reused_pools[start_method]
            ex.shutdown(wait=True)
        if ex._flags.broken is not None:
            faults_plugin.crashed("the pool was broken")
        assert ex._flags.broken is None, "the pool was broken"


def _reset(ex: sharexec.SharedProcessPoolExecutor) -> None:
    """Bring a reused pool back to where the next test may start: every call of the
    test done (bounded), and the warm segments kept for reuse dropped."""
    deadline = time.monotonic() + 60
    for future in ex._pending_futures():  # futures, and map's slots (no condition)
        with contextlib.suppress(BaseException):
            future.result(timeout=max(0.0, deadline - time.monotonic()))
    running = [f for f in ex._pending_futures() if not f.done()]
    assert not running, f"{len(running)} calls still running after the test"
    gc.collect()  # results the test dropped, in cycles: their segments join the pool
    ex._transport.pool.clear()


# The pools of the module's transport tests, by start method: {None: <executor>, ...}.
_REUSED: list[dict[str | None, sharexec.SharedProcessPoolExecutor]] = []


@pytest.fixture(scope="module")
def reused_pools() -> Iterator[dict[str | None, sharexec.SharedProcessPoolExecutor]]:
    """The pools the transport tests of one module share (see ``executor``), shut down
    after the module: then every worker of theirs must be gone."""
    before = segments_now()
    pools: dict[str | None, sharexec.SharedProcessPoolExecutor] = {}
    _REUSED.append(pools)
    try:
        yield pools
    finally:
        _REUSED.remove(pools)
        workers = [p.pid for ex in pools.values() for p in ex._pool_processes()]
        for ex in pools.values():
            ex.shutdown(wait=True)
        assert not wait_exit(workers, timeout=30), "a reused pool's workers outlived it"
        drop_warm_arrays()
        assert_none_left(segments_now() - before)


def _reused_workers() -> set[int]:
    """The workers of the reused pools alive now."""
    return {p.pid for pools in _REUSED for ex in pools.values() for p in ex._pool_processes()}
