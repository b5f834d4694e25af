"""Worker functions of test_startup.py (importable by every start method)."""

from __future__ import annotations

import os
import sys
import time


def pid() -> int:
    return os.getpid()


def parent_and_modules(names: tuple[str, ...]) -> tuple[int, int, list[str]]:
    """This worker's pid, its parent's, and which of ``names`` it has imported."""
    return os.getpid(), os.getppid(), [n for n in names if n in sys.modules]


def rendezvous(folder: str, n: int, timeout: float = 60.0) -> int:
    """Mark this worker as up; return its pid once ``n`` distinct workers are."""
    me = os.getpid()
    with open(os.path.join(folder, str(me)), "w"):
        pass
    deadline = time.monotonic() + timeout
    while len(os.listdir(folder)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(os.listdir(folder))} of {n} workers came up")
        time.sleep(0.001)
    return me


def record_start(folder: str) -> None:
    """An initializer: records that this worker ran it."""
    with open(os.path.join(folder, f"init-{os.getpid()}"), "w"):
        pass


def refuse() -> None:
    raise ValueError("this argument cannot be rebuilt in a worker")


class Unrebuildable:
    """An argument whose rebuild in a worker raises (a class the worker lacks, say)."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return refuse, ()


def die() -> None:
    os._exit(3)


def nested_default() -> tuple[int, int]:
    """From inside a worker: a pool of sharexec's default; (its worker's pid, the pid
    of that worker's parent)."""
    import sharexec

    with sharexec.SharedProcessPoolExecutor(1) as ex:
        return ex.submit(parent_and_modules, ()).result()[:2]


def state(name: str) -> tuple[int, str | None, str, bool, list[str]]:
    """This worker's pid, the variable ``name`` of its environment, its working
    directory, whether Ctrl-C raises ``KeyboardInterrupt`` here, and the names of the
    threads its code sees."""
    import signal
    import threading

    return (
        os.getpid(),
        os.environ.get(name),
        os.getcwd(),
        signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        [t.name for t in threading.enumerate()],
    )
