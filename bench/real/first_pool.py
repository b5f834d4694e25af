"""A pool's start-up as a script pays it: from ``Executor(2)`` to both workers having run
a task, for the first pool of a process and the ones after it.

NumPy and sharexec are imported at the top (the measure starts after them), as in a
script that uses sharexec. Each pool gets two tasks of :func:`rendezvous`: a task marks
its worker as up (a file named after its pid, in a folder of its pool) and returns only
once two such files exist, so the two tasks can only finish together, on two distinct
workers, each having run one. The time stops when both results are in (their pids are
checked to differ); the pool is then shut down, untimed. Prints the times of
``--pools`` pools in a row, in seconds, as one JSON line.
"""

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy  # noqa: F401  (imported before the measure, as in a user's script)
from harness import EXECUTORS, executor_class

import sharexec  # noqa: F401


def rendezvous(folder, n, timeout=60.0):
    with open(os.path.join(folder, str(os.getpid())), "w"):
        pass
    deadline = time.monotonic() + timeout
    while len(os.listdir(folder)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(os.listdir(folder))} of {n} workers came up")
        time.sleep(0.0005)
    return os.getpid()


def one_pool(Executor):
    folder = tempfile.mkdtemp(prefix="first-pool-")
    try:
        start = time.perf_counter()
        ex = Executor(2)
        futures = [ex.submit(rendezvous, folder, 2) for _ in range(2)]
        pids = {f.result() for f in futures}
        elapsed = time.perf_counter() - start
        ex.shutdown()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if len(pids) != 2:
        raise AssertionError(f"two tasks ran on {len(pids)} worker(s)")
    return elapsed


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--executor", default="stdlib", choices=EXECUTORS)
    p.add_argument("--pools", type=int, default=5)
    args = p.parse_args()
    Executor = executor_class(args.executor)
    print(json.dumps([one_pool(Executor) for _ in range(args.pools)]), flush=True)
