"""Scenarios run in a container-like namespace (see ``container.py``), as a program:
``python container_scenarios.py <start method id> <scenario> [argument]``.

Each prints what the test judges, as ``<key> <Python literal>`` lines: the namespace and
its /dev/shm are gone once it exits. Scenarios:

* ``repeated``: 3 repetitions of 4 calls on a 96 MiB argument (more than /dev/shm
  holds) and a 80 MB shared array a worker fills: what went where, what was copied;
* ``results``: 8 calls each returning a fresh 64 MiB array and 2 returning an 80 MB
  shared array of their own (more than /dev/shm holds): where they live, and what the
  workers still hold;
* ``doctor``: what ``python -m sharexec doctor`` finds there;
* ``fork-server-folder``: a program (a child) runs a call, says where multiprocessing's
  private folder is (a fork server's socket goes there), its mode and the sockets in it,
  and exits; then whether that folder is gone, and what ``pymp-`` folder is left in
  /dev/shm;
* ``no-folder``: the error that making an executor raises, if any;
* ``crash parent`` and ``crash worker``: a program of the same work (its victim, a
  child) is SIGKILLed, or one of its workers is, while large results are on their way
  back; then what is left of it, in /dev/shm and held anywhere as anonymous shared
  memory (by any process, under the label of the victim or of any of its workers).
"""

from __future__ import annotations

import ast
import gc
import os
import signal
import stat
import subprocess
import sys
import time
import warnings
from concurrent.futures.process import BrokenProcessPool

import numpy as np

import sharexec
from sharexec import _arrays, _segments, _tracking

METHOD = None if sys.argv[1] == "default" else sys.argv[1]  # None: sharexec's default
ARGUMENT = 12 << 20  # float64 elements: 96 MiB
SHARED = 10_000_000  # float64 elements: 80 MB
RESULT = 8 << 20  # float64 elements: 64 MiB


def strided_sum(a: np.ndarray) -> float:
    return float(a[::4096].sum())


def fill(out: np.ndarray, value: float) -> None:
    out[...] = value


def worker_pid() -> int:
    return os.getpid()


def make(n: int, value: float) -> np.ndarray:
    return np.full(n, value)


def make_shared(n: int, value: float) -> np.ndarray:
    out = sharexec.zeros(n)
    out[...] = value
    return out


def slow_make(n: int, value: float) -> np.ndarray:
    time.sleep(0.2)
    return np.full(n, value)


def held_by(pid: int) -> list[str]:
    """The anonymous segments the process ``pid`` holds open."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:{_segments.PREFIX}") and "probe" not in target:
            held.append(target)
    return held


def worker_holds(_: object) -> tuple[int, list[str]]:
    time.sleep(0.05)  # so that each worker takes one
    return os.getpid(), held_by(os.getpid())


def segment_kind(array: np.ndarray) -> str:
    """Where a shared array lives: "anonymous", "file" or "named"."""
    found = _tracking.find_shared(*_arrays.byte_bounds(array))
    assert found is not None
    name = found[0].name
    return "anonymous" if name.startswith("memfd:") else "file" if name[0] == "/" else "named"


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from each process's parent in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != b"Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Poll until every pid has exited (or the timeout); return those still alive."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def held_here() -> list[str]:
    """The anonymous segments this process still holds open."""
    return held_by(os.getpid())


def results() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
            futures = [ex.submit(make, RESULT, float(i)) for i in range(8)]
            got = [f.result() for f in futures]
            shared = [ex.submit(make_shared, SHARED, float(i)).result() for i in (1, 2)]
            exact = all(float(r[0]) == float(r[-1]) == i for i, r in enumerate(got)) and all(
                float(s[0]) == float(s[-1]) == i for i, s in zip((1, 2), shared, strict=True)
            )
            kinds = sorted({segment_kind(s) for s in shared})
            # Each worker, once every result is the parent's: what it still holds.
            workers = dict(ex.map(worker_holds, range(8)))
            stats = ex.statistics()
            del got, shared, futures
    gc.collect()
    _arrays.recycling.clear()
    gc.collect()
    print("exact", exact)
    print("kinds", kinds)
    print("fallbacks", stats.fallbacks)
    print("workers", len(workers))
    print("worker_held", sorted(h for held in workers.values() for h in held))
    print(
        "warnings",
        [str(w.message) for w in caught if issubclass(w.category, sharexec.SharexecWarning)],
    )
    print("left", _segments.listdir())
    print("held", held_here())


def repeated() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = np.random.default_rng(0).random(ARGUMENT)
        expected = strided_sum(a)
        shared = sharexec.zeros(SHARED)
        kind = segment_kind(shared)
        with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
            results = [list(ex.map(strided_sum, [a] * 4)) for _ in range(3)]
            ex.submit(fill, shared[5:10], 3.0).result()
            stats = ex.statistics()
        exact = (
            results == [[expected] * 4] * 3
            and shared[5:10].tolist() == [3.0] * 5
            and float(shared.sum()) == 15.0
        )
    del a, shared
    gc.collect()
    _arrays.recycling.clear()  # its warm segments (the freed shared array's)
    gc.collect()
    print("exact", exact)
    print("kind", repr(kind))
    print("nbytes", ARGUMENT * 8)
    print(
        "stats",
        {
            "fallbacks": stats.fallbacks,
            "bytes_copied": stats.bytes_copied,
            "segments_pooled": stats.segments_pooled,
        },
    )
    print(
        "warnings",
        [str(w.message) for w in caught if issubclass(w.category, sharexec.SharexecWarning)],
    )
    print("left", _segments.listdir())
    print("held", held_here())


def victim(whom: str) -> None:
    """The program that is killed (``whom`` "parent"), or whose worker is."""
    a = np.random.default_rng(0).random(ARGUMENT)
    shared = sharexec.zeros(SHARED)
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD)
    list(ex.map(strided_sum, [a] * 4))  # a copy, pooled; workers map it
    ex.submit(fill, shared[5:10], 3.0).result()
    kept = ex.submit(make, RESULT, 1.0).result()  # a worker's anonymous segment, passed
    print("kind", repr(segment_kind(shared)))
    print("kin", descendants(os.getpid()), flush=True)
    # Large results on their way back when the kill comes: made, passed, or in the pipe.
    in_flight = [ex.submit(slow_make, RESULT, 2.0) for _ in range(4)]
    in_flight[0].result()  # the others are being made, passed, or in the pipe
    if whom == "parent":
        os.kill(os.getpid(), signal.SIGKILL)
    worker = ex.submit(worker_pid).result()
    os.kill(worker, signal.SIGKILL)
    assert not wait_gone([worker], 20), "the killed worker is still alive"
    try:
        again = list(ex.map(strided_sum, [a] * 4)) == [strided_sum(a)] * 4
    except BrokenProcessPool:
        again = True  # the pool may break: what matters is what is left
    ex.shutdown()
    [future.exception() for future in in_flight]  # done, or failed with the pool
    del a, shared, ex, kept, in_flight
    gc.collect()
    _arrays.recycling.clear()
    gc.collect()
    print("again", again)
    print("held", held_here(), flush=True)


def crash(whom: str) -> None:
    """Run the victim, let it die (or finish), wait for every process it started to
    exit, then say what is left of it."""
    proc = subprocess.Popen(
        [sys.executable, __file__, sys.argv[1], "victim", whom],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = proc.communicate(timeout=90)
    print(out, end="")
    kin = [int(p) for p in out.split("kin [", 1)[1].split("]", 1)[0].split(",") if p.strip()]
    print("returncode", proc.returncode)
    print("outlived", wait_gone(kin, 30))
    print("left", _segments.listdir())
    labels = tuple(f"/memfd:{_segments.PREFIX}{pid}-" for pid in [proc.pid, *kin])
    holders = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/maps") as maps:
                    if any(label in line for line in maps for label in labels):
                        holders.append(int(entry))
                for fd in os.listdir(f"/proc/{entry}/fd"):
                    if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(labels):
                        holders.append(int(entry))
            except OSError:
                continue
    print("holders", sorted(set(holders)))


def folder_user() -> None:
    """Run a call, then say where multiprocessing's private folder is: None if nothing
    made it."""
    from multiprocessing import process

    with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
        print("answer", ex.submit(worker_pid).result() != os.getpid())
        folder = process.current_process()._config.get("tempdir")
        print("folder", repr(folder))
        if folder is not None:
            print("mode", oct(os.stat(folder).st_mode & 0o777))
            sockets = [
                n for n in os.listdir(folder) if stat.S_ISSOCK(os.lstat(f"{folder}/{n}").st_mode)
            ]
            print("sockets", len(sockets))


def fork_server_folder() -> None:
    proc = subprocess.run(
        [sys.executable, __file__, sys.argv[1], "folder-user"],
        stdout=subprocess.PIPE,
        text=True,
        timeout=90,
    )
    print(proc.stdout, end="")
    print("returncode", proc.returncode)
    folder = printed_here(proc.stdout, "folder")
    print("gone", folder is None or not os.path.exists(folder))
    print("pymp_left", sorted(n for n in os.listdir("/dev/shm") if n.startswith("pymp-")))


def printed_here(stdout: str, key: str) -> object:
    lines = [line for line in stdout.splitlines() if line.startswith(key + " ")]
    return ast.literal_eval(lines[-1][len(key) + 1 :]) if lines else None


def no_folder() -> None:
    try:
        sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD).shutdown()
    except Exception as exc:
        print("error", repr((type(exc).__name__, str(exc))))
    else:
        print("error", None)


if __name__ == "__main__":
    scenario = sys.argv[2]
    if scenario == "repeated":
        repeated()
    elif scenario == "results":
        results()
    elif scenario == "victim":
        victim(sys.argv[3])
    elif scenario == "crash":
        crash(sys.argv[3])
    elif scenario == "folder-user":
        folder_user()
    elif scenario == "fork-server-folder":
        fork_server_folder()
    elif scenario == "no-folder":
        no_folder()
    elif scenario == "doctor":
        from sharexec import _doctor

        print("findings", [(f.topic, f.status, f.detail) for f in _doctor.examine()])
    else:
        raise SystemExit(f"no scenario {scenario!r}")
