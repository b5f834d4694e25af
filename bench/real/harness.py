"""How each program of ``bench/real_programs.py`` is run: its executor, its timing, its result.

A program is a script written the way users write them (its functions in ``__main__``,
its libraries imported at the top) with one function ``main(Executor, scale)``: it makes
its pools with ``Executor(2)`` and returns a small result, the same whatever the
executor. Its ``if __name__ == "__main__":`` block hands ``main`` to :func:`run`, which
takes the executor's name from the command line (``--executor``), calls ``main`` and
prints one JSON line: the result and the time ``main`` took. The bench runs each script
in a fresh Python process and times the whole process too, so that the interpreter's
start, the script's imports and the first pool count, as for a user running it.

Executors (:data:`EXECUTORS`): ``stdlib`` is ``concurrent.futures.ProcessPoolExecutor``
with its defaults (fork on Python 3.11 to 3.13), ``stdlib-forkserver`` and
``stdlib-spawn`` the same with that start method, ``sharexec`` is
``sharexec.SharedProcessPoolExecutor`` with its defaults and ``sharexec-fork`` the same
under fork (``mp_context``). sharexec is imported only by
the runs that use it, after the script's own imports, as a user's ``import sharexec``
would be. Imports only the standard library.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import multiprocessing
import sys
import time
from collections.abc import Callable
from typing import Any

EXECUTORS = [
    "stdlib",
    "stdlib-fork",
    "stdlib-forkserver",
    "stdlib-spawn",
    "sharexec",
    "sharexec-fork",
]


def executor_class(name: str) -> Callable[..., concurrent.futures.Executor]:
    """What a program calls as ``Executor(2)``, for the executor named ``name``."""
    if name.startswith("sharexec"):
        from sharexec import SharedProcessPoolExecutor

        if name == "sharexec":
            return SharedProcessPoolExecutor
        context = multiprocessing.get_context(name.removeprefix("sharexec-"))
        return functools.partial(SharedProcessPoolExecutor, mp_context=context)
    if name == "stdlib":
        return concurrent.futures.ProcessPoolExecutor
    if name.startswith("stdlib-"):
        context = multiprocessing.get_context(name.removeprefix("stdlib-"))
        return functools.partial(concurrent.futures.ProcessPoolExecutor, mp_context=context)
    raise ValueError(f"unknown executor {name!r}: one of {', '.join(EXECUTORS)}")


def run(main: Callable[[Callable[..., concurrent.futures.Executor], float], Any]) -> None:
    """Run a program's ``main`` with the executor named on the command line; print the
    result and the time ``main`` took (seconds) as one JSON line on stdout."""
    p = argparse.ArgumentParser()
    p.add_argument("--executor", default="stdlib", choices=EXECUTORS)
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the work")
    args = p.parse_args()
    entered = time.time()  # the wall clock, comparable with the parent's
    Executor = executor_class(args.executor)
    start = time.perf_counter()
    result = main(Executor, args.scale)
    main_s = time.perf_counter() - start
    line = {"result": result, "main_s": main_s, "entered": entered}
    print(json.dumps(line), flush=True)
    sys.stdout.flush()
