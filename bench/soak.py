"""A soak: a service-like loop whose workers are killed now and then, for minutes.

    python bench/soak.py --minutes 10 --kill-every 3

The loop submits calls that return a 1 MiB array (so each result comes back through a
segment), a few at a time, for as long as asked. Every ``--kill-every`` seconds it
SIGKILLs one of the pool's workers while results flow back, as a crash or the OOM killer
would. A pool broken by the death is shut down and replaced by a new one, as a service
would do on ``BrokenProcessPool``; the calls it lost are counted, never retried.

Every ``--report-every`` seconds, at the end (after the last pool is shut down and
garbage collected) and once nothing is left (or 30 s later) it prints one line: the
segments in ``/dev/shm`` named after this process or any process it started, their
bytes, this process's open descriptors and its resident memory. What must hold: all
three flat from the first report to the last, and no segment once settled.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

import sharexec

SHM = Path("/dev/shm")
PREFIX = "sharexec-"


def big_and_pid(i: int) -> tuple[np.ndarray, int]:
    """A 1 MiB result, and the worker that made it."""
    return np.full(1 << 17, i, dtype=np.float64), os.getpid()


def take(finished: set[Future[tuple[np.ndarray, int]]], workers: set[int], pids: set[int]) -> int:
    """Check the results of ``finished`` and note their workers; how many there were.
    (A function of its own, so that no result outlives it in a local variable.)"""
    for future in finished:
        result, worker = future.result()
        assert result[0] == result[-1]
        workers.add(worker)
        pids.add(worker)
    return len(finished)


def descendants(pid: int) -> set[int]:
    """The live processes below ``pid``."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def our_names(pids: set[int]) -> list[str]:
    """The names of the segments that carry one of ``pids`` in their name."""
    names = []
    for entry in os.scandir(SHM):
        if entry.name.startswith(PREFIX):
            pid = entry.name[len(PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and int(pid) in pids:
                names.append(entry.name)
    return names


def our_segments(pids: set[int]) -> tuple[int, int]:
    """How many segments, and how many bytes, carry one of ``pids`` in their name."""
    count = size = 0
    for entry in os.scandir(SHM):
        if not entry.name.startswith(PREFIX):
            continue
        try:
            pid = int(entry.name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid in pids:
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            count += 1
            size += stat.st_blocks * 512
    return count, size


def resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds")
    parser.add_argument("--report-every", type=float, default=30.0, help="seconds")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=8, help="calls kept submitted")
    args = parser.parse_args()

    pids = {os.getpid()}  # every process of the run: segments are named after their maker
    start = time.monotonic()
    end = start + args.minutes * 60
    next_kill = start + args.kill_every
    next_report = start
    done = lost = kills = pools = 0
    rows: list[str] = []

    def report(label: str) -> None:
        pids.update(descendants(os.getpid()))
        count, size = our_segments(pids)
        fds = len(os.listdir("/proc/self/fd"))
        row = (
            f"{label:>7} | {time.monotonic() - start:6.0f} s | {count:8d} | "
            f"{size / 2**20:8.1f} | {fds:5d} | {resident_kib() / 1024:7.1f} | "
            f"{done:7d} | {lost:5d} | {kills:5d} | {pools:5d}"
        )
        rows.append(row)
        print(row, flush=True)

    columns = ["segments", "shm MiB ", " fds ", "RSS MiB", "  calls", " lost", "kills", "pools"]
    print("  label |  time    | " + " | ".join(columns))
    while time.monotonic() < end:
        pools += 1
        executor = sharexec.SharedProcessPoolExecutor(args.workers)
        pending = set()
        workers: set[int] = set()
        i = 0
        done_before = done
        try:
            while time.monotonic() < end:
                while len(pending) < args.in_flight:
                    pending.add(executor.submit(big_and_pid, i))
                    i += 1
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                done += take(finished, workers, pids)  # BrokenProcessPool: a new pool
                del finished  # nothing of a result outlives this step
                now = time.monotonic()
                if now >= next_kill and workers:
                    next_kill = now + args.kill_every
                    victim = sorted(workers)[kills % len(workers)]
                    workers.discard(victim)
                    try:
                        os.kill(victim, signal.SIGKILL)
                        kills += 1
                    except ProcessLookupError:
                        pass
                if now >= next_report:
                    next_report = now + args.report_every
                    report("running")
        except BrokenProcessPool:
            lost += i - (done - done_before)  # submitted to this pool, never returned
        finally:
            pids.update(descendants(os.getpid()))
            executor.shutdown(wait=True, cancel_futures=True)
            del pending, executor
            with contextlib.suppress(NameError):
                del finished  # the futures of the step a broken pool failed
    gc.collect()
    report("end")
    # What results were in flight when a pool broke is freed by the sweeper once it hears
    # that their executor reads no more results: a moment later, not at once.
    settle = time.monotonic() + 30
    while our_segments(pids)[0] and time.monotonic() < settle:
        time.sleep(0.1)
    report("settled")
    for name in sorted(our_names(pids)):  # what is left, if anything, to look into
        print(f"left: {name}", flush=True)


if __name__ == "__main__":
    main()
