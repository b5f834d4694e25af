"""A rendezvous task that tells when every worker of a pool is up (stdlib imports only).

Start-up is timed from the pool's constructor until each of its ``n`` workers has run
:func:`rendezvous`. A worker running it writes a file named after its pid into a shared
folder, then waits until ``n`` such files exist: ``n`` tasks can only finish together, on
``n`` distinct workers. The module imports nothing heavy, so a start-up does not include
importing NumPy (the first warm-up task does).
"""

from __future__ import annotations

import os
import time


def rendezvous(folder: str, n: int, timeout: float = 120.0) -> int:
    """Mark this worker as up in ``folder``; return its pid once ``n`` workers are."""
    pid = os.getpid()
    with open(os.path.join(folder, str(pid)), "w"):
        pass
    deadline = time.monotonic() + timeout
    while len(os.listdir(folder)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(os.listdir(folder))} of {n} workers came up")
        time.sleep(0.0005)
    return pid


def pid() -> int:
    """This worker's pid: a call that needs nothing but a worker."""
    return os.getpid()
