"""Faults: whatever dies, and however, no segment and no process is left.

Each scenario runs as its own program in a subprocess. Once it is over (and its sweeper
has exited), the segment folder holds nothing the scenario created, and none of its
processes is alive.
"""

from __future__ import annotations

import ast
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import container
import faults_plugin
import pytest
from conftest import assert_none_left, descendants, method_id, segments_now, wait_exit

import sharexec
from sharexec import _segments

pytestmark = pytest.mark.timeout(120)

PRELUDE = """
import faulthandler, os, signal, sys
import numpy as np
import sharexec
from sharexec import _session, _tracking
from concurrent.futures.process import BrokenProcessPool

METHOD = None if sys.argv[1] == "default" else sys.argv[1]  # None: sharexec's default

# Ctrl-C raises KeyboardInterrupt here even if this program was started with SIGINT
# ignored (as a shell starts a background job).
signal.signal(signal.SIGINT, signal.default_int_handler)

# A scenario that hangs writes where each of its threads stands (the test shows it).
faulthandler.dump_traceback_later(80, exit=False)

FIFO_DIR = sys.argv[2] if len(sys.argv) > 2 else None


def rendezvous(folder, n):
    # this worker's pid, once n distinct workers have run this
    import time
    open(os.path.join(folder, str(os.getpid())), "w").close()
    while len(os.listdir(folder)) < n:
        time.sleep(0.001)
    return os.getpid()


def both_up(ex, n=2):
    # have ex start n workers now (they start on demand)
    folder = os.path.join(FIFO_DIR, "up")
    os.mkdir(folder)
    assert len(set(ex.map(rendezvous, [folder] * n, [n] * n))) == n

def started():
    # tell the test this task runs (with its segments mapped), then wait to be let go
    with open(os.path.join(FIFO_DIR, "started"), "w") as f:
        f.write("x")
    with open(os.path.join(FIFO_DIR, "go")) as f:
        f.read()

def announce_sweeper():
    print("sweeper", _session._channel.sweeper_pid, flush=True)
"""


def alive(pid: int) -> bool:
    """Whether the process ``pid`` has not exited (a zombie has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        return not select.select([fd], [], [], 0)[0]
    finally:
        os.close(fd)


def left_by(proc: subprocess.Popen) -> set[str]:
    """Segments that appeared since the scenario started and whose creator is dead.

    Names carry their creator's pid: once the scenario is over, its segments (the
    parent's and its workers') all have dead creators, unlike other live programs'.
    """
    return segments_now() - _before.pop(proc.pid, set())


_before: dict[int, set[str]] = {}
_scenarios: list[subprocess.Popen] = []  # the scenarios the running test started


@pytest.fixture(autouse=True)
def no_scenario_left() -> Iterator[None]:
    """A scenario still running when its test ends (the test failed or timed out while it
    hung) is killed with every process it started, and the test fails: one hang must
    not leave processes that fail every later test's leak check."""
    yield
    left = [proc for proc in _scenarios if proc.poll() is None]
    stacks = []
    for proc in left:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
        stacks.append((err or "")[-8000:])  # with the stacks it wrote once it hung 80 s
    _scenarios.clear()
    if left:
        faults_plugin.crashed("a scenario was still running at the end of its test")
    assert not left, "a scenario was still running at the end of its test: killed\n" + "\n".join(
        stacks
    )


def run_scenario(tmp_path: Path, body: str, method: str, **kwargs):
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    before = segments_now()
    proc = subprocess.Popen(
        [sys.executable, str(script), method_id(method), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )
    _before[proc.pid] = before
    _scenarios.append(proc)
    return proc


def finish(proc: subprocess.Popen, expect_rc: int | None = 0) -> str:
    out, err = proc.communicate(timeout=100)
    if expect_rc is not None:
        exited(proc.returncode, expect_rc)
        assert proc.returncode == expect_rc, err
    sweeper = [int(line.split()[1]) for line in out.splitlines() if line.startswith("sweeper")]
    still = wait_exit([p for p in sweeper if p], 15)
    if still:
        faults_plugin.crashed("the sweeper did not finish")
    assert not still, "the sweeper did not finish"
    return out


def exited(returncode: int, expected: int = 0) -> None:
    """Note a scenario that exited otherwise than expected (a crash, for nox -s faults)."""
    if returncode != expected:
        faults_plugin.crashed(f"the scenario exited with {returncode}")


def kill_and_check_swept(proc: subprocess.Popen, kin: list[int]) -> None:
    """SIGKILL the scenario's parent: within 5 s every process of ``kin`` has exited (no
    worker runs the queue on) and every segment of the scenario is swept."""
    proc.kill()
    proc.wait(10)
    outlived = wait_exit(kin, 5.0)
    if outlived:
        faults_plugin.crashed("processes outlived the parent by 5 s")
    assert not outlived, "processes outlived the parent by 5 s"
    assert_none_left(left_by(proc))
    proc.stdout.close()
    proc.stderr.close()


def family(proc: subprocess.Popen) -> list[int]:
    return list(descendants(proc.pid))


# ---------------------------------------------------------------------------------------


def test_task_raises(start_method, tmp_path):
    proc = run_scenario(
        tmp_path,
        """
        def f(a):
            b = sharexec.zeros(300_000)
            raise ValueError("boom")

        if __name__ == "__main__":
            with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
                fut = ex.submit(f, np.ones(1_000_000))
                try:
                    fut.result()
                except ValueError:
                    print("raised")
                announce_sweeper()
        """,
        start_method,
    )
    out = finish(proc)
    assert "raised" in out
    assert_none_left(left_by(proc))


@pytest.mark.parametrize(
    "death",
    [
        pytest.param("os.kill(os.getpid(), signal.SIGKILL)", id="sigkill"),
        pytest.param("import ctypes; ctypes.string_at(0)", id="segfault"),
        pytest.param("os._exit(3)", id="os-exit"),
    ],
)
def test_worker_dies_mid_task(start_method, tmp_path, death):
    proc = run_scenario(
        tmp_path,
        f"""
        def f(a):
            mine = sharexec.zeros(300_000)      # owned by the worker
            result = sharexec.full(300_000, 2.0)
            {death}

        if __name__ == "__main__":
            ex = sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD)
            futures, refused = [], 0
            for _ in range(4):
                try:
                    futures.append(ex.submit(f, np.ones(1_000_000)))
                except BrokenProcessPool:  # a worker may have died already
                    refused += 1
            broken = [isinstance(fut.exception(), BrokenProcessPool) for fut in futures]
            print("broken", all(broken) and len(broken) + refused == 4)
            ex.shutdown()
            announce_sweeper()
        """,
        start_method,
    )
    out = finish(proc)
    assert "broken True" in out
    assert_none_left(left_by(proc))


def test_ctrl_c_in_map(start_method, tmp_path):
    os.mkfifo(tmp_path / "started")
    os.mkfifo(tmp_path / "go")
    proc = run_scenario(
        tmp_path,
        """
        def f(a):
            started()
            return a * 2  # a large result

        if __name__ == "__main__":
            announce_sweeper_later = True
            with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
                try:
                    print("sweeper",
                          _session.sweeper_address() and _session._channel.sweeper_pid,
                          flush=True)
                    list(ex.map(f, [np.ones(500_000)] * 6))
                except KeyboardInterrupt:
                    print("interrupted", flush=True)
        """,
        start_method,
    )
    with open(tmp_path / "started") as started:
        assert started.read(1) == "x"  # a task runs, with its argument mapped
        proc.send_signal(signal.SIGINT)
        with open(tmp_path / "go", "w"):
            pass  # let every task go (each open of the fifo pairs with one task)
        # later tasks start and must be let go too, until the pool has drained
        drain(tmp_path, proc)
    out = finish(proc)
    assert "interrupted" in out
    assert_none_left(left_by(proc))


def drain(tmp_path: Path, proc: subprocess.Popen) -> None:
    """Let any further task through until the scenario has exited."""
    while proc.poll() is None:
        try:
            fd = os.open(tmp_path / "go", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no task waiting to read
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.05)
            continue
        os.close(fd)


def test_parent_killed_with_tasks_in_flight(start_method, tmp_path):
    os.mkfifo(tmp_path / "started")
    os.mkfifo(tmp_path / "go")
    proc = run_scenario(
        tmp_path,
        """
        def f(a):
            result = np.ones(500_000)
            out = sharexec.zeros(300_000)
            started()
            return result, out

        def quick(a):
            return a * 3

        if __name__ == "__main__":
            ex = sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD)
            keep = sharexec.zeros(1_000_000)
            results = [ex.submit(quick, np.ones(500_000)).result() for _ in range(3)]
            futures = [ex.submit(f, np.ones(1_000_000)) for _ in range(6)]
            announce_sweeper()
            for fut in futures:
                fut.result()
        """,
        start_method,
    )
    with open(tmp_path / "started") as started:
        assert started.read(1) == "x"
    sweeper = int(proc.stdout.readline().split()[1])
    kin = family(proc)
    assert sweeper in kin and len(kin) >= 3
    assert len(segments_now() - _before[proc.pid]) >= 4, "the scenario should hold segments"
    kill_and_check_swept(proc, kin)


def test_sweeper_of_a_package_installed_elsewhere(tmp_path):
    """The sweeper runs without site-packages (``python -S``): it finds the package where
    the parent imported it from, here a copy outside this checkout (a plain install)."""
    site = tmp_path / "site"
    shutil.copytree(
        Path(sharexec.__file__).parent,
        site / "sharexec",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    proc = run_scenario(
        tmp_path,
        """
        if __name__ == "__main__":
            print("from", sharexec.__file__, flush=True)
            keep = sharexec.zeros(300_000)
            announce_sweeper()
            os.kill(os.getpid(), signal.SIGKILL)
        """,
        "spawn",
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    out = finish(proc, expect_rc=-signal.SIGKILL)
    assert f"from {site / 'sharexec' / '__init__.py'}" in out
    assert_none_left(left_by(proc))


def test_max_tasks_per_child_recycling_under_load(start_method, tmp_path):
    if start_method == "fork":
        pytest.skip("max_tasks_per_child is refused with fork")
    proc = run_scenario(
        tmp_path,
        """
        def f(a, i):
            own = sharexec.full(10, float(i))
            return a * i, own

        if __name__ == "__main__":
            with sharexec.SharedProcessPoolExecutor(
                2, mp_context=METHOD, max_tasks_per_child=2
            ) as ex:
                futures = [ex.submit(f, np.ones(400_000), i) for i in range(24)]
                ok = all(
                    (r.sum() == 400_000 * i and own.sum() == 10 * i)
                    for i, (r, own) in ((i, fut.result()) for i, fut in enumerate(futures))
                )
            print("exact", ok)
            announce_sweeper()
        """,
        start_method,
    )
    out = finish(proc)
    assert "exact True" in out
    assert_none_left(left_by(proc))


# ---------------------------------------------------------------------------------------
# The sweeper itself: out of reach, it costs crash protection, never a task
# ---------------------------------------------------------------------------------------


def test_a_dead_sweeper_fails_nothing(start_method, tmp_path):
    """With the sweeper killed, segments are still created: by workers, which cannot
    connect to it, and by the root, whose pipe to it is broken."""
    proc = run_scenario(
        tmp_path,
        """
        def f(a):
            mine = sharexec.full(300_000, 2.0)  # this worker's first segment
            return float((mine * a).sum()), a * 3  # and a large result

        if __name__ == "__main__":
            keep = sharexec.zeros(300_000)  # the sweeper starts
            sweeper = _session._channel.sweeper_pid
            os.kill(sweeper, signal.SIGKILL)
            os.waitpid(sweeper, 0)
            more = sharexec.ones(300_000)
            with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
                results = [ex.submit(f, np.ones(300_000)).result() for _ in range(3)]
            print("exact", more.sum() == 300_000 and all(
                total == 600_000 and tripled.sum() == 900_000 for total, tripled in results
            ))
        """,
        start_method,
    )
    out = finish(proc)
    assert "exact True" in out
    assert_none_left(left_by(proc))


def test_a_sweeper_out_of_reach_is_tried_again(no_leaks):
    """A process that cannot connect to the sweeper tells it nothing and raises nothing,
    and tries again at its next segment: a failed connection is not kept. Its new line
    starts with what it still owns (the first segment), then the second."""
    code = textwrap.dedent(
        """
        import os, socket
        from sharexec import _session, _tracking

        address = b"\\0sharexec-test-" + os.urandom(12).hex().encode()
        _session.join_sweeper(address)  # as a worker does; nobody listens there yet
        first = _tracking.new_private(4096)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(1)
        second = _tracking.new_private(4096)
        conn, _ = listener.accept()
        expected = f"R {first.name}\\nR {second.name}\\n"
        heard = b""
        while len(heard) < len(expected):
            heard += conn.recv(4096)
        print(repr(heard.decode()))
        print(repr(expected))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    heard, expected = (ast.literal_eval(line) for line in done.stdout.splitlines())
    assert heard == expected  # on the new connection: what it owns, then the second


def test_a_forked_child_does_not_keep_the_sweeper_waiting(tmp_path):
    """A forked child closes its copy of the root's pipe to the sweeper at once: when the
    root dies, what it owned is swept while the child lives on."""
    proc = run_scenario(
        tmp_path,
        """
        if __name__ == "__main__":
            keep = sharexec.zeros(300_000)  # the sweeper starts
            child = os.fork()
            if child == 0:
                os.read(0, 1)  # lives until the test closes its stdin
                os._exit(0)
            print("child", child, flush=True)
            announce_sweeper()
            os.kill(os.getpid(), signal.SIGKILL)
        """,
        "fork",
        stdin=subprocess.PIPE,
    )
    child = int(proc.stdout.readline().split()[1])
    sweeper = int(proc.stdout.readline().split()[1])
    try:
        proc.wait(60)
        exited(proc.returncode, -signal.SIGKILL)
        assert proc.returncode == -signal.SIGKILL
        outlived = wait_exit([sweeper], 15)
        assert alive(child), "the forked child should still be alive"
        if outlived:
            faults_plugin.crashed("the sweeper waited for a forked child")
        assert not outlived, "the sweeper waited for the root's forked child"
        assert_none_left(left_by(proc))
    finally:
        proc.stdin.close()  # the child goes
        wait_exit([child], 15)
        proc.stdout.close()
        proc.stderr.close()


# ---------------------------------------------------------------------------------------
# A small /dev/shm (Docker's default is 64 MB): never SIGBUS, fall back, stay exact
# ---------------------------------------------------------------------------------------

SMALL_SHM = """
import warnings
from sharexec import _segments

def double(a):
    return a * 2

def fill(out, value):
    out[...] = value

if __name__ == "__main__":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = np.random.default_rng(0).random(25_000_000)  # 200 MB
        shared = sharexec.zeros(20_000_000)  # 160 MB: more than /dev/shm holds
        with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
            doubled = ex.submit(double, a).result()  # 200 MB argument and result
            sums = list(ex.map(np.sum, np.array_split(a, 8)))
            ex.submit(fill, shared[5:10], 3.0).result()
        exact = (
            np.array_equal(doubled, a * 2)
            and sums == [np.sum(c) for c in np.array_split(a, 8)]
            and shared[5:10].tolist() == [3.0] * 5 and shared.sum() == 15.0
        )
    del a, doubled, shared
    import gc; gc.collect()
    sharexec._arrays.recycling.clear()  # its warm segments (a freed shared array's)
    gc.collect()
    print("exact", exact)
    print("warnings", sum(issubclass(w.category, sharexec.SharexecWarning) for w in caught))
    print("left", _segments.listdir())
"""


def in_small_shm(
    tmp_path: Path,
    script: str,
    method: str,
    extra_mount: str = "",
    size: str = "64m",
    spill: Path | None = None,
):
    """Run ``script`` in a private mount namespace whose /dev/shm is a small tmpfs."""
    path = tmp_path / "scenario.py"
    path.write_text(PRELUDE + textwrap.dedent(script))
    spill_env = {"SHAREXEC_TEMP_FOLDER": str(spill or tmp_path / "spill")}
    return container.in_namespace(path, method, setup=extra_mount, size=size, env=spill_env)


def left_in(stdout: str) -> set[str]:
    """The segments a small-/dev/shm scenario found left in its own /dev/shm."""
    lines = [line for line in stdout.splitlines() if line.startswith("left ")]
    assert lines, stdout
    return set(ast.literal_eval(lines[-1].removeprefix("left ")))


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounting a small tmpfs in a private namespace needs root and unshare",
)


def no_memfd_anywhere(script: str) -> str:
    """``SMALL_SHM`` on a system without anonymous shared memory, in its workers too."""
    return script.replace(
        'if __name__ == "__main__":\n',
        "def no_memfd():\n    _segments._anonymous_supported = False\n\n"
        'if __name__ == "__main__":\n    no_memfd()\n',
    ).replace("mp_context=METHOD)", "mp_context=METHOD, initializer=no_memfd)")


@needs_root
@pytest.mark.transport  # where the bytes go: the same whatever started the worker
def test_small_dev_shm_spills_to_disk(start_method, tmp_path):
    """No anonymous shared memory (no memfd_create, or no /proc): what does not fit in
    /dev/shm goes to files, the worker's result too, with one warning."""
    (tmp_path / "spill").mkdir()
    out = in_small_shm(tmp_path, no_memfd_anywhere(SMALL_SHM), start_method, "true &&")
    exited(out.returncode)
    assert out.returncode == 0, out.stderr
    assert "exact True" in out.stdout
    assert "warnings 1" in out.stdout, out.stdout  # one warning, however many fallbacks
    assert_none_left(left_in(out.stdout))
    assert_none_left({str(p) for p in (tmp_path / "spill").iterdir()})  # spill files


@needs_root
@pytest.mark.transport  # where the bytes go: the same whatever started the worker
def test_small_dev_shm_needs_no_file(start_method, tmp_path):
    """With anonymous shared memory, nothing goes to a file, not even a worker's 200 MB
    result (its descriptor is passed to the parent): no warning."""
    (tmp_path / "spill").mkdir()
    out = in_small_shm(tmp_path, SMALL_SHM, start_method, "true &&")
    exited(out.returncode)
    assert out.returncode == 0, out.stderr
    assert "exact True" in out.stdout
    assert "warnings 0" in out.stdout, out.stdout
    assert_none_left(left_in(out.stdout))
    assert list((tmp_path / "spill").iterdir()) == []  # no folder was ever made there


@needs_root
@pytest.mark.transport  # where the bytes go: the same whatever started the worker
def test_no_room_anywhere_falls_back_to_pickling(start_method, tmp_path):
    """No room in /dev/shm, nor in the spill folder, and no anonymous shared memory (a
    system without memfd_create, or without /proc): large buffers are pickled."""
    (tmp_path / "spill").mkdir()
    script = SMALL_SHM.replace(
        "shared = sharexec.zeros(20_000_000)  # 160 MB: more than /dev/shm holds",
        "shared = sharexec.zeros(20)",
    ).replace(
        'if __name__ == "__main__":\n',
        'if __name__ == "__main__":\n    _segments._anonymous_supported = False  # no memfd\n',
    )
    tiny = f"mount -t tmpfs -o size=1m tmpfs {tmp_path / 'spill'} &&"
    out = in_small_shm(tmp_path, script, start_method, tiny)
    exited(out.returncode)
    assert out.returncode == 0, out.stderr
    assert "exact True" in out.stdout
    assert "warnings 1" in out.stdout, out.stdout
    assert_none_left(left_in(out.stdout))


@container.needs_root
@pytest.mark.parametrize("root", ["rw", "ro"])
@pytest.mark.parametrize("whom", ["parent", "worker"])
def test_a_kill_in_a_container_leaves_nothing(start_method, whom, root):
    """In a 64 MB /dev/shm, where the large argument and shared array are anonymous
    segments, with the root file system as it is or read-only without a writable /tmp: a
    SIGKILL of the parent, or of a worker, leaves nothing in /dev/shm, and no process
    holds (open or mapped) any anonymous segment of the parent's once all of its
    processes have exited (the kernel frees them: nothing to sweep)."""
    out = container.run(start_method, "crash", whom, root=root)
    exited(out.returncode)
    assert out.returncode == 0, out.stdout + out.stderr
    assert container.printed(out.stdout, "kind") == "anonymous"
    killed = whom == "parent"
    assert container.printed(out.stdout, "returncode") == (-signal.SIGKILL if killed else 0)
    if not killed:
        assert container.printed(out.stdout, "again") is True
        assert container.printed(out.stdout, "held") == []
    outlived = container.printed(out.stdout, "outlived")
    if outlived:
        faults_plugin.crashed(f"processes outlived the {whom}'s death: {outlived}")
    assert outlived == []
    assert container.printed(out.stdout, "left") == []
    assert container.printed(out.stdout, "holders") == []


# ---------------------------------------------------------------------------------------
# The faults a long-running program meets
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("notices", ["root", "worker"])
def test_a_killed_sweeper_is_restarted_and_the_crash_sweep_holds(start_method, tmp_path, notices):
    """The sweeper is killed (as a program's cleanup of its children would). Whoever
    notices first (the root, creating a segment; or a worker, whose result tells the
    root) has the root start a new one, told of everything still owned; nothing fails
    meanwhile, and a SIGKILL of the parent afterwards still leaves nothing."""
    os.mkfifo(tmp_path / "started")
    os.mkfifo(tmp_path / "go")
    proc = run_scenario(
        tmp_path,
        f"""
        def make(n):
            mine = sharexec.full(n, 2.0)  # the worker's own segment: it must tell the sweeper
            return float(mine.sum())

        def hold(a):
            mine = sharexec.full(300_000, 2.0)
            started()
            return a * 2, mine

        if __name__ == "__main__":
            keep = sharexec.zeros(300_000)  # the sweeper starts
            ex = sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD)
            assert ex.submit(make, 10).result() == 20.0  # the workers are up, connected
            first = _session._channel.sweeper_pid
            os.kill(first, signal.SIGKILL)
            os.waitpid(first, 0)
            if {notices!r} == "root":
                more = sharexec.ones(300_000)  # the root's line is broken: it restarts it
                assert _session._channel.sweeper_pid != first
            # workers whose lines broke: their results tell the root (if it did not notice)
            sums = [ex.submit(make, 300_000).result() for _ in range(4)]
            second = _session._channel.sweeper_pid
            print("restarted", second not in (0, first), sums == [600_000.0] * 4, flush=True)
            futures = [ex.submit(hold, np.ones(1_000_000)) for _ in range(4)]
            announce_sweeper()
            for fut in futures:
                fut.result()
        """,
        start_method,
    )
    with open(tmp_path / "started") as started:
        assert started.read(1) == "x"  # a task runs, holding its segments
    assert proc.stdout.readline().split() == ["restarted", "True", "True"]
    sweeper = int(proc.stdout.readline().split()[1])
    kin = family(proc)
    assert sweeper in kin
    # At least: `keep`, the one copy the four equal arguments share, and the array of the
    # task that said it started; the other worker's task may not have made its own yet.
    assert len(segments_now() - _before[proc.pid]) >= 3, "the scenario should hold segments"
    kill_and_check_swept(proc, kin)


def test_a_frozen_worker_is_ended_once_the_parent_is_gone(start_method, tmp_path):
    """Workers stopped with SIGSTOP cannot run their parent watch: once the parent is
    killed, the sweeper kills them after its grace period (here 2 s), then sweeps."""
    os.mkfifo(tmp_path / "started")
    os.mkfifo(tmp_path / "go")
    proc = run_scenario(
        tmp_path,
        """
        from sharexec import _sweeper

        def hold(a):
            mine = sharexec.full(300_000, 2.0)
            started()
            return a * 2, mine

        if __name__ == "__main__":
            _sweeper.WAIT_FOR_MEMBERS = 2.0  # read when the sweeper starts
            ex = sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD)
            both_up(ex)  # workers start on demand: both, now
            print("workers", *ex._processes, flush=True)
            futures = [ex.submit(hold, np.ones(1_000_000)) for _ in range(4)]
            announce_sweeper()
            for fut in futures:
                fut.result()
        """,
        start_method,
    )
    with open(tmp_path / "started") as started:
        assert started.read(1) == "x"
    workers = [int(pid) for pid in proc.stdout.readline().split()[1:]]
    sweeper = int(proc.stdout.readline().split()[1])
    assert len(workers) == 2 and sweeper
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    proc.kill()
    proc.wait(10)
    outlived = wait_exit([*workers, sweeper], 2.0 + 15.0)
    if outlived:
        faults_plugin.crashed("stopped workers outlived the parent")
    for pid in outlived:  # do not leave them stopped for ever
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not outlived, f"outlived the parent and the sweeper's grace: {outlived}"
    assert_none_left(left_by(proc))
    proc.stdout.close()
    proc.stderr.close()


@pytest.mark.transport  # where the bytes go: the same whatever started the worker
def test_kept_results_hold_no_file_descriptor(start_method, tmp_path):
    """With a soft limit of 256 open files, 600 results of 512 KiB and 300 shared arrays
    stay alive at once; the pool stays within its count after a call of 400 buffers."""
    if shutil.disk_usage(_segments.SHM_FOLDER).free < 1 << 30:
        # Where they do not fit, the parent's segments are anonymous: each is a descriptor
        # (test_container.py::test_out_of_descriptors_raises_the_soft_limit covers them).
        pytest.skip(f"{_segments.SHM_FOLDER} cannot hold 450 MB of segments at once")
    proc = run_scenario(
        tmp_path,
        """
        import resource
        from sharexec._config import WARM_SEGMENTS

        def fds():
            return len(os.listdir("/proc/self/fd"))

        if __name__ == "__main__":
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
            with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
                assert ex.submit(abs, -1).result() == 1
                before = fds()
                futures = [ex.submit(np.full, 65_536, float(i)) for i in range(600)]
                results = [fut.result() for fut in futures]  # 512 KiB each, kept
                shared = [sharexec.full(65_536, float(i)) for i in range(300)]
                print("exact", all(r[0] == r[-1] == i for i, r in enumerate(results))
                      and all(a[0] == i for i, a in enumerate(shared)))
                print("descriptors", fds() - before <= 8)
                many = [np.full(32_768, float(i)) for i in range(400)]  # 256 KiB each
                assert ex.submit(len, many).result() == 400
                print("pooled", len(ex._transport.pool) <= WARM_SEGMENTS)
        """,
        start_method,
    )
    out = finish(proc)
    assert "exact True" in out
    assert "descriptors True" in out
    assert "pooled True" in out
    assert_none_left(left_by(proc))


@pytest.mark.transport  # where the bytes go: the same whatever started the worker
def test_out_of_descriptors_falls_back_to_pickling(start_method, tmp_path):
    """A program that uses every file descriptor it may: a large argument is pickled
    instead of shared, exact, with one warning that names the limit."""
    proc = run_scenario(
        tmp_path,
        """
        import resource
        import warnings

        if __name__ == "__main__":
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))  # quick to fill
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
                    assert ex.submit(np.sum, np.ones(300_000)).result() == 300_000  # warm
                    filler = []
                    try:
                        while True:
                            filler.append(os.open("/dev/null", os.O_RDONLY))
                    except OSError:
                        pass
                    try:  # no descriptor left for a segment (nor a file to spill to)
                        total = ex.submit(np.sum, np.full(1_000_000, 2.0)).result()
                    finally:
                        for fd in filler:
                            os.close(fd)
                    print("exact", total == 2_000_000.0)
            messages = [str(w.message) for w in caught
                        if issubclass(w.category, sharexec.SharexecWarning)]
            print("warnings", len(messages))
            print("names the limit", all("open files" in m for m in messages))
        """,
        start_method,
    )
    out = finish(proc)
    assert "exact True" in out
    assert "warnings 1" in out, out
    assert "names the limit True" in out, out
    assert_none_left(left_by(proc))


@pytest.mark.transport  # where the bytes go: the same whatever started the worker
def test_shutdown_without_waiting_keeps_no_copy(start_method, no_leaks):
    """``shutdown(wait=False)`` while tasks with large arguments run or wait: the pool is
    emptied at once, and once the tasks are done no copy of theirs (nor of the
    initializer's argument) is left in /dev/shm, while the executor object lives on (the
    closed pool refuses what comes back)."""
    import gc
    from multiprocessing import get_context

    import numpy as np
    import workers

    before = segments_now()
    ex = sharexec.SharedProcessPoolExecutor(
        2,
        mp_context=start_method,
        initializer=workers.hold_nothing,  # its large argument is copied for each worker
        initargs=(np.ones(300_000),),
    )
    try:
        with get_context("spawn").Manager() as manager:
            started, go = manager.Event(), manager.Event()
            assert ex.submit(workers.total, np.ones(400_000)).result() == 400_000
            assert ex._transport.pooled(), "the finished task's copy should be pooled"
            running = [
                ex.submit(workers.wait_then_read, np.full(500_000, float(i)), started, go)
                for i in range(4)
            ]
            assert started.wait(60)
            # loky forgets its manager thread at any shutdown: a later shutdown(wait=True)
            # would not wait for the workers, so the test joins it (it joins them).
            manager_thread = ex._executor_manager_thread
            ex.shutdown(wait=False)
            assert not ex._transport.pooled()
            go.set()
            assert [fut.result(60) for fut in running] == [0.0, 1.0, 2.0, 3.0]
        gc.collect()
        assert ex._transport.pooled() == []
        assert_none_left(segments_now() - before)
        manager_thread.join(60)
    finally:
        ex.shutdown(wait=True)


def test_executors_dropped_without_shutdown_keep_no_segment(start_method, no_leaks):
    """Six executors, each sent one large array and dropped without ``shutdown``, as a
    standard library executor may be: once collected, none of their warm segments is
    left in /dev/shm (not only once their pools' idle timers fire), and their workers
    exit, as a collected ``ProcessPoolExecutor``'s do."""
    import gc

    import numpy as np
    import workers

    before = segments_now()
    pids = []
    for i in range(6):
        # Half with an initializer given a large argument (copied, but for fork's),
        # which its workers need as long as the executor may start one.
        init = {"initializer": workers.total, "initargs": (np.ones(1 << 19),)} if i % 2 else {}
        ex = sharexec.SharedProcessPoolExecutor(1, mp_context=start_method, **init)
        assert ex.submit(workers.total, np.ones(1 << 19)).result() == 1 << 19  # 4 MiB
        assert ex._transport.pooled(), "the finished task's copy should be pooled"
        pids += [p.pid for p in ex._pool_processes()]
        del ex
    gc.collect()
    assert_none_left(segments_now() - before)
    outlived = wait_exit(pids, 60)
    if outlived:
        faults_plugin.crashed("workers outlived their collected executor")
    assert not outlived, "workers outlived their collected executor"


# ---------------------------------------------------------------------------------------
# doctor --clean from another PID namespace that shares /dev/shm
# ---------------------------------------------------------------------------------------

# Runs in a new PID namespace: a process there makes a segment and dies (its segment,
# unchanged for an hour, is stale), then the doctor cleans from there.
IN_ANOTHER_NAMESPACE = """
import os, subprocess, sys, time
from sharexec import _segments

pid = os.fork()
if pid == 0:
    name = _segments.new_name()
    _segments.create(4096, name).close()
    hour_ago = time.time() - 3600
    os.utime(os.path.join(_segments.SHM_FOLDER, name), (hour_ago, hour_ago))
    print("dead", name, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
sys.exit(subprocess.run([sys.executable, "-m", "sharexec", "doctor", "--clean"]).returncode)
"""


def in_new_pid_namespace() -> list[str]:
    """The command that runs a program in a new PID namespace with its own /proc (and
    the same /dev/shm); skips the test where the system refuses one."""
    command = ["unshare", "--pid", "--fork", "--mount-proc"]
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command (util-linux)")
    if os.geteuid() != 0:
        command[1:1] = ["--user", "--map-root-user"]  # a user namespace of one's own
    probe = subprocess.run([*command, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.strip()}")
    return command


@pytest.mark.timeout(60)
def test_doctor_in_another_pid_namespace_keeps_a_live_array(tmp_path, no_leaks):
    """A live shared array, unwritten for an hour and mapped only by its creator (out of
    sight of another PID namespace), is kept by ``doctor --clean`` run there and stays
    usable; a segment whose creator died in the doctor's own namespace is removed."""
    import time

    import numpy as np
    import workers

    from sharexec import _arrays, _segments, _tracking

    command = in_new_pid_namespace()
    a = sharexec.full(1 << 17, 7.0)  # 1 MiB
    found = _tracking.find_shared(*_arrays.byte_bounds(a))
    assert found is not None
    live = found[0].name
    hour_ago = time.time() - 3600
    os.utime(os.path.join(_segments.SHM_FOLDER, live), (hour_ago, hour_ago))
    script = tmp_path / "doctor.py"
    script.write_text(IN_ANOTHER_NAMESPACE)
    run = subprocess.run(
        [*command, sys.executable, str(script)], capture_output=True, text=True, timeout=50
    )
    dead = next(line.split()[1] for line in run.stdout.splitlines() if line.startswith("dead "))
    try:
        assert run.returncode == 0, run.stdout + run.stderr
        assert live in _segments.listdir(), run.stdout
        assert f"removed {live}" not in run.stdout
        here = _segments.pid_namespace()
        assert f"kept {live}: made in PID namespace pid:[{here}], not this one" in run.stdout
        assert "not ours to judge" in run.stdout  # the summary line
        assert f"removed {dead}" in run.stdout
        assert dead not in _segments.listdir()
        with sharexec.SharedProcessPoolExecutor(1) as ex:  # the array still serves
            assert ex.submit(workers.total, a).result() == 7.0 * (1 << 17)
        assert np.all(a == 7.0)
    finally:
        _segments.unlink(dead)
        del a


# ---------------------------------------------------------------------------------------
# Nothing held after a worker dies: what a worker handed over goes with its adopter
# ---------------------------------------------------------------------------------------

HOLDS = """
def holding():
    # what this process owns now: the names, and statistics' count of them
    import gc
    gc.collect()
    from sharexec import _session

    return sorted(_session.owned.sizes)

def hold_until_told(owned):
    print("holds", *owned, flush=True)
    sys.stdin.read()  # the test looks at /dev/shm meanwhile, then closes our stdin
"""


def settled(proc: subprocess.Popen, held: set[str], seconds: float = 15.0) -> set[str]:
    """The scenario's segments left, beyond ``held`` (what its live processes hold), once
    nothing more goes within ``seconds``: what a dead worker handed over is freed by
    the sweeper as soon as it hears of the death, not when the program exits."""
    deadline = time.monotonic() + seconds
    while True:
        left = segments_now() - _before[proc.pid] - held
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.mark.parametrize("stop", ["sigkill", "terminate_workers", "kill_workers"])
def test_a_dead_worker_leaves_nothing_for_the_parent(start_method, tmp_path, stop):
    """Workers stop (one SIGKILLed, all terminated, all killed) while 1 MiB arguments,
    1 MiB results and shared arrays made in workers flow: what they handed over and the
    parent will never read is freed at once, not at the program's exit, and so is every
    copy of an argument. What is left is what the results the parent got hold, and
    ``segments_live`` counts it."""
    how = {
        "sigkill": "os.kill(worker, signal.SIGKILL)",
        "terminate_workers": "ex.terminate_workers()",
        "kill_workers": "ex.kill_workers()",
    }[stop]
    proc = run_scenario(
        tmp_path,
        HOLDS
        + textwrap.dedent(
            f"""
        from sharexec import _segments

        def big(a, i):
            return np.full(1 << 17, float(i)), sharexec.full(1 << 17, float(i)), os.getpid()

        def segment(a):
            # the segment an array of a result lies in
            while not isinstance(a, _segments.Mapping):
                a = a.obj if isinstance(a, memoryview) else a.base
            return a.name

        if __name__ == "__main__":
            kept = []
            for round in range(3):
                ex = sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD)
                *first, worker = ex.submit(big, np.ones(1 << 17), 0).result()
                kept.append(first)
                futures = [ex.submit(big, np.ones(1 << 17), i) for i in range(120)]
                futures[5].exception()  # results are flowing back
                {how}
                ex.shutdown()
                kept += [f.result()[:2] for f in futures
                         if not f.cancelled() and f.exception() is None]
                del futures
            exact = all(a[0] == s[0] == a[-1] == s[-1] for a, s in kept)
            owned = holding()
            live = ex.statistics().segments_live
            print("exact", exact, "live", live, "owned", len(owned), flush=True)
            hold_until_told({{segment(a) for result in kept for a in result}})
            announce_sweeper()
        """
        ),
        start_method,
        stdin=subprocess.PIPE,
    )
    said = proc.stdout.readline().split()
    if len(said) != 6:  # the scenario failed: its error
        finish(proc)
    exact, live, owned = said[1], int(said[3]), int(said[5])
    results = set(proc.stdout.readline().split()[1:])  # the segments its results lie in
    left = settled(proc, results)
    finish(proc)  # closes its stdin: it exits
    assert_none_left(left)
    assert exact == "True"
    assert live == owned == len(results)
    assert_none_left(left_by(proc))


def test_a_killed_child_process_frees_the_results_it_held(start_method, tmp_path):
    """The root forks a child that runs an executor and holds large results (arrays, and
    shared arrays its workers made); the child is SIGKILLed: what it held is freed while
    the root lives on. Its workers handed it to the child, not to the root."""
    proc = run_scenario(
        tmp_path,
        HOLDS
        + textwrap.dedent(
            """
        def big(i):
            return np.full(1 << 17, float(i)), sharexec.full(1 << 17, float(i))

        if __name__ == "__main__":
            keep = sharexec.zeros(300_000)  # the root starts the sweeper
            child = os.fork()
            if child == 0:
                ex = sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD)
                held = [ex.submit(big, i).result() for i in range(3)]
                print("child", os.getpid(), len(holding()), flush=True)
                sys.stdin.read()  # until the test kills it
                os._exit(0)
            os.waitpid(child, 0)
            hold_until_told(holding())
            announce_sweeper()
        """
        ),
        start_method,
        stdin=subprocess.PIPE,
    )
    said = proc.stdout.readline().split()
    if len(said) != 3:  # the scenario failed: its error
        finish(proc)
    child, held = int(said[1]), int(said[2])
    assert held >= 6, "the child should hold its results"
    os.kill(child, signal.SIGKILL)
    owned = set(proc.stdout.readline().split()[1:])  # the root's, once the child is reaped
    left = settled(proc, owned)
    finish(proc)
    assert_none_left(left)
    assert_none_left(left_by(proc))


def test_a_nested_pool_s_results_go_with_the_worker_that_got_them(start_method, tmp_path):
    """A task runs a pool of its own (``get_executor``) and drops a large result from
    it, whose segment its pool keeps warm; then its worker is killed (SIGKILL: no
    cleanup runs): that segment goes with it, while the program lives on."""
    proc = run_scenario(
        tmp_path,
        HOLDS
        + textwrap.dedent(
            """
        def inner(i):
            return np.full(1 << 17, float(i))

        def outer(i):
            pool = sharexec.get_executor(1)
            total = float(pool.submit(inner, i).result().sum())  # the result is dropped
            return total, len(pool._transport.pool), os.getpid()

        if __name__ == "__main__":
            ex = sharexec.SharedProcessPoolExecutor(1, mp_context=METHOD)
            total, pooled, worker = ex.submit(outer, 2).result()
            os.kill(worker, signal.SIGKILL)
            ex.shutdown()
            print("exact", total == 2.0 * (1 << 17), "pooled", pooled, flush=True)
            hold_until_told(holding())
            announce_sweeper()
        """
        ),
        start_method,
        stdin=subprocess.PIPE,
    )
    said = proc.stdout.readline().split()
    if len(said) != 4:  # the scenario failed: its error
        finish(proc)
    owned = set(proc.stdout.readline().split()[1:])
    left = settled(proc, owned)
    finish(proc)
    assert_none_left(left)
    assert said[1] == "True"
    assert said[3] == "1", "the inner pool should keep the result's segment warm"
    assert_none_left(left_by(proc))


def test_the_sweeper_hears_sender_and_receiver_in_any_order(no_leaks):
    """A worker's lines and those of the process its results go to are read in any order
    (two sockets). A receiver's ``A`` heard before the worker's ``R`` and ``H`` keeps
    the segment its own; one handed over for a token closed already is freed as it
    comes; one in flight goes when its token is closed, or when its receiver dies."""
    import socket

    from sharexec import _segments, _sweeper

    root, root_end = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(b"\0sharexec-test-" + os.urandom(12).hex().encode())
    listener.listen()
    sweeper = _sweeper._Sweeper(1.0, os.getpid(), listener, root.fileno())
    worker, worker_end = socket.socketpair()
    receiver, receiver_end = socket.socketpair()
    sweeper.add_line(worker, 1_000_001)  # pids of no process: only lines are looked at
    sweeper.add_line(receiver, 1_000_002)
    me = os.getpid()  # the root's, as the sweeper knows it
    made = [_segments.create(4096, _segments.new_name()) for _ in range(4)]
    adopted, late, closed, orphaned = (m.name for m in made)

    def exists(name: str) -> bool:
        return name in _segments.listdir()

    try:
        sweeper.act("root", "A", adopted)  # heard first
        sweeper.act(worker, "R", adopted)
        sweeper.act(worker, "H", f"{me} 1 {adopted}")
        sweeper.act("root", "C", "2")  # closed before the worker's hand-off is heard
        for name, to, token in [(late, me, 2), (closed, me, 1), (orphaned, 1_000_002, 3)]:
            sweeper.act(worker, "R", name)
            sweeper.act(worker, "H", f"{to} {token} {name}")
        sweeper.gone(worker)  # the worker exits: nothing of this is its own any more
        assert [exists(name) for name in (adopted, late, closed, orphaned)] == [
            True,
            False,
            True,
            True,
        ]
        sweeper.act("root", "C", "1")
        assert exists(adopted) and not exists(closed)
        sweeper.gone(receiver)
        assert not exists(orphaned)
        sweeper.gone("root")
        assert not exists(adopted)
    finally:
        for mapping in made:
            _segments.unlink(mapping.name)
            mapping.close()
        for end in (root, root_end, listener, worker_end, receiver_end):
            end.close()
        sweeper.events.close()
