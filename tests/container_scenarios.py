"""Scenarios run in a container-like namespace (see ``container.py``), as a program:
``python container_scenarios.py <start method id> <scenario> [argument]``.

Each prints what the test judges, as ``<key> <Python literal>`` lines: the namespace and
its /dev/shm are gone once it exits. Scenarios:

* ``repeated``: 3 repetitions of 4 calls on a 96 MiB argument (more than /dev/shm
  holds) and a 80 MB shared array a worker fills: what went where, what was copied;
* ``doctor``: what ``python -m sharexec doctor`` finds there;
* ``crash parent`` and ``crash worker``: a program of the same work (its victim, a
  child) is SIGKILLed, or one of its workers is; then what is left of it, in /dev/shm
  and held anywhere as anonymous shared memory.
"""

from __future__ import annotations

import gc
import os
import signal
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


def strided_sum(a: np.ndarray) -> float:
    return float(a[::4096].sum())


def fill(out: np.ndarray, value: float) -> None:
    out[...] = value


def worker_pid() -> int:
    return os.getpid()


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
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:{_segments.PREFIX}") and "probe" not in target:
            held.append(target)
    return held


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
    print("kind", repr(segment_kind(shared)))
    print("kin", descendants(os.getpid()), flush=True)
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
    del a, shared, ex
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
    label = f"/memfd:{_segments.PREFIX}{proc.pid}-"
    holders = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/maps") as maps:
                    if any(label in line for line in maps):
                        holders.append(int(entry))
                for fd in os.listdir(f"/proc/{entry}/fd"):
                    if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(label):
                        holders.append(int(entry))
            except OSError:
                continue
    print("holders", sorted(set(holders)))


if __name__ == "__main__":
    scenario = sys.argv[2]
    if scenario == "repeated":
        repeated()
    elif scenario == "victim":
        victim(sys.argv[3])
    elif scenario == "crash":
        crash(sys.argv[3])
    elif scenario == "doctor":
        from sharexec import _doctor

        print("findings", [(f.topic, f.status, f.detail) for f in _doctor.examine()])
    else:
        raise SystemExit(f"no scenario {scenario!r}")
