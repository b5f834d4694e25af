"""Start-up: workers started on demand, and sharexec's default start method,
forks of a warm server.

Under every start method: a call starts a worker only if none is idle, never more than
``max_workers``; broken pools and shutdown behave as before. Under the default: workers
are forks of sharexec's own server (single-threaded, NumPy imported), the user's own
``mp_context`` and initializer keep their meaning, and the parent is never forked.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import forkserver
from pathlib import Path

import pytest
import startup_workers as sw
from conftest import method_id

import sharexec
from sharexec import _loky

pytestmark = pytest.mark.timeout(120)


def watch_starts(ex: sharexec.SharedProcessPoolExecutor) -> list[int]:
    """The pids of every worker ``ex`` starts from now on, as it starts them."""
    started: list[int] = []
    report = ex._workers_started

    def record(pids: list[int]) -> None:
        started.extend(pids)
        report(pids)

    ex._workers_started = record  # type: ignore[method-assign]
    return started


# ---------------------------------------------------------------------------------------
# On demand, under every start method
# ---------------------------------------------------------------------------------------


def test_a_pool_that_runs_nothing_starts_nothing(start_method, no_leaks):
    with sharexec.SharedProcessPoolExecutor(64, mp_context=start_method) as ex:
        assert ex._pool_processes() == []


def test_one_call_starts_one_worker_of_64_and_the_idle_worker_is_reused(start_method, no_leaks):
    if start_method == "fork":
        pytest.skip("under fork every worker starts at the first call (the next test)")
    with sharexec.SharedProcessPoolExecutor(64, mp_context=start_method) as ex:
        started = watch_starts(ex)
        first = ex.submit(sw.pid).result()
        assert [p.pid for p in ex._pool_processes()] == [first] == started
        # Each call submitted after the previous result finds that worker idle.
        assert {ex.submit(sw.pid).result() for _ in range(6)} == {first}
        assert started == [first]


def threads_at_each_start(ex: sharexec.SharedProcessPoolExecutor) -> list[set[str]]:
    """The names of this process's threads each time ``ex`` starts workers, from now."""
    seen: list[set[str]] = []
    report = ex._workers_started

    def record(pids: list[int]) -> None:
        seen.append({t.name for t in threading.enumerate()})
        report(pids)

    ex._workers_started = record  # type: ignore[method-assign]
    return seen


def test_under_fork_every_worker_starts_at_the_first_call_before_the_pool_threads(no_leaks):
    # As the standard library does: a worker forked later, while the pool's feeder thread
    # held a lock (tempfile's, at its first use), never got that lock.
    with sharexec.SharedProcessPoolExecutor(4, mp_context="fork") as ex:
        threads_at_start = threads_at_each_start(ex)
        ex.submit(sw.pid).result()
        assert len(ex._pool_processes()) == 4
        assert {ex.submit(sw.pid).result() for _ in range(8)} <= {
            p.pid for p in ex._pool_processes()
        }
    assert len(threads_at_start) == 1  # all four at once
    assert not threads_at_start[0] & {"QueueFeederThread", "ExecutorManagerThread"}


def test_but_under_fork_the_manager_thread_starts_before_the_first_worker(start_method, no_leaks):
    if start_method == "fork":
        pytest.skip("under fork every worker starts before the pool threads (the test above)")
    with sharexec.SharedProcessPoolExecutor(2, mp_context=start_method) as ex:
        threads_at_start = threads_at_each_start(ex)
        ex.submit(sw.pid).result()
    assert "ExecutorManagerThread" in threads_at_start[0]


def test_workers_start_as_calls_wait_and_never_more_than_max_workers(
    start_method, no_leaks, tmp_path: Path
):
    folder = tmp_path / "up"
    folder.mkdir()
    with sharexec.SharedProcessPoolExecutor(3, mp_context=start_method) as ex:
        started = watch_starts(ex)
        # Three calls can only finish together on three distinct workers; nine wait.
        futures = [ex.submit(sw.rendezvous, str(folder), 3) for _ in range(9)]
        pids = {f.result() for f in futures}
        assert len(pids) == 3
        assert sorted(started) == sorted(pids) == sorted(p.pid for p in ex._pool_processes())


def test_a_user_initializer_runs_once_in_each_worker_started(
    start_method, no_leaks, tmp_path: Path
):
    folder = tmp_path / "up"
    folder.mkdir()
    with sharexec.SharedProcessPoolExecutor(
        8, mp_context=start_method, initializer=sw.record_start, initargs=(str(tmp_path),)
    ) as ex:
        started = watch_starts(ex)
        pids = {f.result() for f in [ex.submit(sw.rendezvous, str(folder), 2) for _ in range(2)]}
        pids.add(ex.submit(sw.pid).result())
    if start_method == "fork":  # every worker at once; any of them may take a call
        assert len(started) == 8
    else:
        assert len(pids) == 2
        assert len(started) == 2
    assert pids <= set(started)
    assert sorted(p.name for p in tmp_path.glob("init-*")) == sorted(f"init-{p}" for p in started)


def test_an_initializer_whose_argument_cannot_be_rebuilt_says_why(start_method, capfd):
    # As the standard library's worker, ours logs its initializer's exception and the
    # pool breaks; the error logged is the rebuild's, not a failure to read its call.
    if start_method == "fork":
        pytest.skip("under fork the initializer's call is inherited, not rebuilt")
    if start_method not in ("spawn", "loky"):  # forks of a server started earlier
        pytest.skip("the workers of a fork server write to the server's stderr, not ours")
    with (
        sharexec.SharedProcessPoolExecutor(
            1, mp_context=start_method, initializer=sw.record_start, initargs=(sw.Unrebuildable(),)
        ) as ex,
        pytest.raises(BrokenProcessPool),
    ):
        ex.submit(sw.pid).result(timeout=60)
    err = capfd.readouterr().err
    assert "ValueError: this argument cannot be rebuilt in a worker" in err
    assert "AttributeError" not in err


def test_ctrl_c_while_workers_start_is_raised_once_they_are_counted(start_method, no_leaks):
    # A KeyboardInterrupt in the middle of a start left workers without the manager
    # thread that stops them: the program hung at exit, joining them.
    # Ctrl-C raises KeyboardInterrupt, as in a program started from a terminal (pytest
    # started as a background job has SIGINT ignored).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
    started = watch_starts(ex)
    start = ex._start_worker
    ctrl_c_at: list[int] = []

    def start_then_ctrl_c() -> int:
        pid = start()
        ctrl_c_at.append(pid)
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, as the start ends
        return pid

    ex._start_worker = start_then_ctrl_c  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            ex.submit(sw.pid)
        # Raised after every started worker was counted and reported.
        assert started == ctrl_c_at == [p.pid for p in ex._pool_processes()]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ex._start_worker = start  # type: ignore[method-assign]
        assert ex.submit(sw.pid).result() in started
    finally:
        ex.shutdown(wait=True)  # returns: each worker got its own sentinel
        signal.signal(signal.SIGINT, handler)


def test_a_new_workers_code_sees_only_its_main_thread(start_method, no_leaks):
    # As in a standard library worker: the watch of the parent is a bare thread.
    with sharexec.SharedProcessPoolExecutor(1, mp_context=start_method) as ex:
        _, _, _, _, threads = ex.submit(sw.state, "HOME").result()
    assert threads == ["MainThread"]


def test_a_worker_dying_breaks_the_pool_as_before(start_method, no_leaks):
    ex = sharexec.SharedProcessPoolExecutor(4, mp_context=start_method)
    try:
        ex.submit(sw.pid).result()
        with pytest.raises(BrokenProcessPool):
            ex.submit(sw.die).result()
        with pytest.raises(BrokenProcessPool):
            ex.submit(sw.pid)
    finally:
        ex.shutdown()


def test_shutdown_completes_calls_then_refuses_new_ones(start_method, no_leaks):
    ex = sharexec.SharedProcessPoolExecutor(4, mp_context=start_method)
    futures = [ex.submit(sw.pid) for _ in range(8)]
    ex.shutdown(wait=True)
    assert all(f.done() and f.result() != os.getpid() for f in futures)
    with pytest.raises(RuntimeError):
        ex.submit(sw.pid)


# ---------------------------------------------------------------------------------------
# The default: forks of sharexec's warm server
# ---------------------------------------------------------------------------------------


def warm_server_pid() -> int | None:
    pid: int | None = _loky.warm_server._warm_server.server._forkserver_pid
    return pid


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_default_workers_are_forks_of_a_warm_single_threaded_server(no_leaks):
    # A thread of the parent runs throughout: the parent is never forked.
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, daemon=True)
    busy.start()
    try:
        with sharexec.SharedProcessPoolExecutor(2) as ex:
            assert ex._context.get_start_method() == "forkserver"
            futures = [ex.submit(sw.parent_and_modules, (*_loky.WARM_PRELOAD, "numpy"))]
            futures.append(ex.submit(sw.parent_and_modules, ("numpy",)))
            results = [f.result() for f in futures]
            server = warm_server_pid()
            assert server is not None and server != os.getpid()
            assert threads_of(server) == 1
    finally:
        stop.set()
        busy.join()
    for pid, parent, modules in results:
        assert parent == server != pid
        assert "numpy" in modules  # imported once, by the server, before any array
    assert results[0][2] == [*_loky.WARM_PRELOAD, "numpy"]


def test_a_users_forkserver_keeps_its_own_server_and_preload(no_leaks):
    stdlib_server = forkserver._forkserver
    preload = list(stdlib_server._preload_modules)
    with sharexec.SharedProcessPoolExecutor(1) as ex:
        ex.submit(sw.pid).result()
    assert stdlib_server._preload_modules == preload  # the default changed nothing there
    context = multiprocessing.get_context("forkserver")
    with sharexec.SharedProcessPoolExecutor(1, mp_context=context) as ex:
        _, parent, _ = ex.submit(sw.parent_and_modules, ()).result()
    assert parent == stdlib_server._forkserver_pid != warm_server_pid()
    assert stdlib_server._preload_modules == preload


def test_a_forked_child_starts_its_own_warm_server(no_leaks):
    with sharexec.SharedProcessPoolExecutor(1) as ex:
        ex.submit(sw.pid).result()
    ahead = waiting()  # this process's children forked ahead, none of the child's
    with sharexec.SharedProcessPoolExecutor(1, mp_context="fork") as ex:
        worker, parent = ex.submit(sw.nested_default).result()
    # the nested pool's worker is a fork of a server of the fork-started worker's own
    assert parent not in (os.getpid(), warm_server_pid())
    assert worker != parent and worker not in ahead
    with sharexec.SharedProcessPoolExecutor(1) as ex:  # they still wait for this process
        assert ex.submit(sw.pid).result() == ahead[0]


def test_an_executor_reads_the_parents_packages_only_for_a_new_server(monkeypatch, no_leaks):
    with sharexec.SharedProcessPoolExecutor(1) as ex:
        ex.submit(sw.pid).result()  # the server runs
    read: list[int] = []
    packages = _loky.warm_server.parent_packages
    monkeypatch.setattr(_loky.warm_server, "parent_packages", lambda: read.append(1) or packages())
    with sharexec.SharedProcessPoolExecutor(1) as ex:
        ex.submit(sw.pid).result()
    assert read == []


def test_a_script_without_a_main_guard_runs_once_under_the_default(tmp_path: Path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            import sharexec

            print("main ran")
            ex = sharexec.SharedProcessPoolExecutor(2)
            print("worker", ex.submit(os.getpid).result() != os.getpid())
            ex.shutdown()
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["main ran", "worker True"]
    assert out.stdout.count("main ran") == 1


def test_workers_import_what_the_script_imported_from_where_it_did(start_method, tmp_path):
    """A package beside the script, run from a folder holding another of that name: the
    workers use the script's, as the parent does (the warm server preloads from the
    parent's sys.path, not from its own working folder)."""
    for folder, who in (("project", "beside the script"), ("elsewhere", "working folder")):
        (tmp_path / folder / "mypkg").mkdir(parents=True)
        (tmp_path / folder / "mypkg" / "__init__.py").write_text(f"WHO = {who!r}\n")
    script = tmp_path / "project" / "main.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import mypkg
            import sharexec

            def who(_):
                import mypkg
                return mypkg.WHO

            if __name__ == "__main__":
                method = None if sys.argv[1] == "default" else sys.argv[1]
                with sharexec.SharedProcessPoolExecutor(2, mp_context=method) as ex:
                    print(mypkg.WHO, "|", *sorted(set(ex.map(who, range(4)))), sep="")
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script), method_id(start_method)],
        cwd=tmp_path / "elsewhere",
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "beside the script|beside the script"


# ---------------------------------------------------------------------------------------
# The default: the workers of a later pool, forked ahead
# ---------------------------------------------------------------------------------------


def waiting() -> list[int]:
    """The children of the warm server forked ahead, waiting to become workers."""
    return _loky.warm_server._warm_server.waiting()


def await_exit(pids: list[int], timeout: float = 60.0) -> None:
    """Return once every process of ``pids`` has exited (not necessarily ours)."""
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            ready, _, _ = select.select([pidfd], [], [], timeout)
            assert ready, f"process {pid} still runs"
        finally:
            os.close(pidfd)


def two_workers(ex: sharexec.SharedProcessPoolExecutor, folder: Path) -> set[int]:
    """The pids of two distinct workers of ``ex``, each having run a task."""
    folder.mkdir()
    return {f.result() for f in [ex.submit(sw.rendezvous, str(folder), 2) for _ in range(2)]}


def test_a_pool_after_a_shutdown_starts_its_workers_from_children_forked_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leaks: None
):
    with sharexec.SharedProcessPoolExecutor(2) as ex:
        first = two_workers(ex, tmp_path / "first")
    ahead = waiting()
    assert len(ahead) >= 2 and not set(ahead) & first
    # The parent as it is when each worker starts, not when it was forked.
    monkeypatch.setenv("SHAREXEC_TEST_AHEAD", "now")
    monkeypatch.chdir(tmp_path)
    # They ignore SIGINT while they wait: a worker takes this process's disposition.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sharexec.SharedProcessPoolExecutor(2) as ex:
            second = two_workers(ex, tmp_path / "second")
            state = ex.submit(sw.state, "SHAREXEC_TEST_AHEAD").result()
    finally:
        signal.signal(signal.SIGINT, handler)
    assert second == set(ahead[:2])
    assert state[0] in second
    assert state[1:4] == ("now", str(tmp_path), True)  # Ctrl-C raises there, as here
    assert not set(waiting()) & second


def test_a_child_forked_ahead_that_died_is_replaced_by_a_fork(no_leaks):
    with sharexec.SharedProcessPoolExecutor(1) as ex:
        ex.submit(sw.pid).result()
    ahead = waiting()
    assert ahead
    for pid in ahead:
        os.kill(pid, signal.SIGKILL)
    await_exit(ahead)
    with sharexec.SharedProcessPoolExecutor(2) as ex:
        pids = {ex.submit(sw.pid).result() for _ in range(4)}
    assert pids and not pids & set(ahead)


AHEAD_PROGRAM = """
import json, os, signal, sys
import sharexec
from sharexec import _loky
if __name__ == "__main__":
    with sharexec.SharedProcessPoolExecutor(2) as ex:
        ex.submit(abs, 1).result()
    print(json.dumps({
        "server": _loky.warm_server._warm_server.server._forkserver_pid,
        "ahead": _loky.warm_server._warm_server.waiting(),
    }), flush=True)
    if sys.argv[1] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("end", ["exits", "killed"])
def test_children_forked_ahead_exit_quietly_with_their_parent(tmp_path: Path, end: str):
    script = tmp_path / "ahead.py"
    script.write_text(AHEAD_PROGRAM)
    program = subprocess.Popen(
        [sys.executable, str(script), end],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Returns once every holder of the program's output has closed it: the program,
    # its server and the children forked ahead.
    out, err = program.communicate(timeout=100)
    assert program.returncode == (0 if end == "exits" else -signal.SIGKILL), err
    report = json.loads(out)
    assert len(report["ahead"]) == 1
    await_exit([report["server"], *report["ahead"]])
    assert err == ""


# ---------------------------------------------------------------------------------------
# The default: the warm server imports the parent's packages
# ---------------------------------------------------------------------------------------

# Packages of a program's own, in a folder on its PYTHONPATH: each notes the pid of every
# process that imports it in a file of that folder.
PACKAGES = {
    # an ordinary package, with a submodule
    "warmpkg/__init__.py": "import os; NOTE('warmpkg')\nfrom . import sub",
    "warmpkg/sub.py": "VALUE = 7",
    # starts a thread at import
    "threadpkg.py": (
        "import threading; NOTE('threadpkg')\n"
        "threading.Thread(target=threading.Event().wait, daemon=True).start()"
    ),
    # fails in the server only (it imports sharexec's preloader), loudly
    "failpkg.py": (
        "import sys, os; NOTE('failpkg')\n"
        "if 'sharexec._loky.warm_preload' in sys.modules:\n"
        "    print('failpkg says', flush=True); os.write(2, b'failpkg errs')\n"
        "    raise RuntimeError('failpkg')"
    ),
    # makes a pool at its import, in the server only
    "poolpkg.py": (
        "import sys; NOTE('poolpkg')\n"
        "if 'sharexec._loky.warm_preload' in sys.modules:\n"
        "    import sharexec; sharexec.SharedProcessPoolExecutor(1).submit(abs, 1).result()"
    ),
}

PROGRAM = """
import json, logging, os, sys, threading
logging.basicConfig(level=logging.DEBUG, format="LOG %(message)s", stream=sys.stdout)
import numpy, sharexec
from sharexec import _loky
{imports}
def modules(names):
    return os.getpid(), os.getppid(), [n for n in names if n in sys.modules]
if __name__ == "__main__":
    with sharexec.SharedProcessPoolExecutor(2) as ex:
        names = ("warmpkg", "warmpkg.sub", "threadpkg", "failpkg", "poolpkg", "scipy.linalg")
        pid, parent, present = ex.submit(modules, names).result()
        server = _loky.warm_server._warm_server.server._forkserver_pid
        print(json.dumps({{
            "present": present, "parent": parent, "server": server, "me": os.getpid(),
            "server_threads": len(os.listdir(f"/proc/{{server}}/task")),
            "left_out": sorted(_loky.warm_server._warm_server.left_out),
        }}))
"""


def with_packages(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The packages above in a folder: the environment that finds them, and the folder
    of their notes."""
    notes = tmp_path / "notes"
    notes.mkdir()
    for name, code in PACKAGES.items():
        path = tmp_path / "lib" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        note = (
            f"import os as _os\nNOTES = {str(notes)!r}\n"
            "def NOTE(n): open(_os.path.join(NOTES, f'{n}-{_os.getpid()}'), 'w').close()\n"
        )
        path.write_text(note + code + "\n")
    path = [str(tmp_path / "lib"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path)), notes


def run_program(
    tmp_path: Path, imports: str
) -> tuple[dict[str, object], str, dict[str, list[int]]]:
    """Run a program importing ``imports`` (after NumPy and sharexec), with the packages
    above on its path; its report, its whole output, and who imported each package."""
    env, notes = with_packages(tmp_path)
    script = tmp_path / "program.py"
    script.write_text(PROGRAM.format(imports=imports))
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    importers: dict[str, list[int]] = {}
    for note in os.listdir(notes):
        name, pid = note.rsplit("-", 1)
        importers.setdefault(name, []).append(int(pid))
    return report, out.stdout + out.stderr, importers


def test_a_worker_starts_with_the_parents_packages_imported_by_the_server(tmp_path: Path):
    report, _, importers = run_program(tmp_path, "import warmpkg")
    assert report["present"] == ["warmpkg", "warmpkg.sub"]
    assert report["parent"] == report["server"]
    # imported by the program and once by the server, for every worker
    assert sorted(importers["warmpkg"]) == sorted([report["me"], report["server"]])
    assert report["server_threads"] == 1 and report["left_out"] == []


def test_a_package_whose_import_starts_a_thread_is_left_out_and_said(tmp_path: Path):
    report, output, importers = run_program(tmp_path, "import threadpkg, warmpkg")
    assert report["left_out"] == ["threadpkg"]
    assert report["present"] == ["warmpkg", "warmpkg.sub"]  # the others still are
    assert report["server_threads"] == 1
    assert "does not preload 'threadpkg': its import starts a thread" in output
    # the first server imported it and exited; the one that serves did not import it
    assert report["server"] not in importers["threadpkg"]
    assert len(importers["threadpkg"]) == 2


def test_a_package_failing_in_the_server_is_skipped_silently(tmp_path: Path):
    report, output, importers = run_program(tmp_path, "import failpkg, poolpkg, warmpkg")
    assert report["present"] == ["warmpkg", "warmpkg.sub"]  # the others still are
    assert report["left_out"] == []
    assert "failpkg says" not in output and "failpkg errs" not in output
    assert "Traceback" not in output
    # tried by the server, whose pool was refused: no second server imported it
    assert sorted(importers["poolpkg"]) == sorted([report["me"], report["server"]])
    assert sorted(importers["failpkg"]) == sorted([report["me"], report["server"]])


def test_the_doctor_says_which_packages_the_workers_find_imported(tmp_path: Path):
    env, _ = with_packages(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "sharexec", "doctor", "--imports", "threadpkg", "warmpkg"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    lines = [line.split(None, 2) for line in out.stdout.splitlines() if line.startswith("preload")]
    assert lines == [
        [
            "preload",
            "WARNING",
            "threadpkg: left out of the warm server (its import starts a "
            "thread); each worker imports it when a task needs it",
        ],
        ["preload", "ok", "warmpkg: imported by the warm server"],
    ], out.stdout + out.stderr
