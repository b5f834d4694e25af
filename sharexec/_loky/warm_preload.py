"""In sharexec's warm server only: importing the parent's packages for its workers.

The standard library's fork server takes one input at its start, the list of module
names it imports (``set_forkserver_preload``), each with ``__import__`` and an
``ImportError`` ignored. sharexec keeps that server as it is (its loop, its
authentication of clients) and says what else to do through those names:

* this module, first: imported, it adds :class:`_Preloader` to the server's
  ``sys.meta_path`` and makes itself a package (``__path__``), so that the names below,
  its submodules, reach that finder and nothing else;
* ``<this module>.orders_<hex>``: the file (its path in hexadecimal, in the parent's
  private temporary folder: ``temp_folder``) that lists the parent's packages to
  import, in JSON, with the parent's ``sys.path`` they are imported from: for each
  top-level package, the names of its modules the parent imported, e.g.
  ``{"path": ["/home/me/project", ...], "packages": [["scipy", "scipy.stats", ...],
  ...]}`` (the parent writes it first, and never changes it: a server started again
  after its death reads the same).

Each module's import is guarded: its output goes to ``/dev/null``, any exception is
swallowed (the module is then not preloaded; a worker imports it when a task needs it,
as before), and an executor made meanwhile is refused. After each top-level package,
the server checks that it runs no thread it did not run before the parent's packages
(``/proc/self/task``: its main thread, and the pool of NumPy's OpenBLAS, which stops at
each fork; a new one is looked at again after a throwaway fork, as a library's OpenBLAS
stops its pool then): a server with a thread of a package's making is no safe process
to fork workers from. It then writes that package's name in the file
``<orders>.left-out`` and exits before it serves a fork; the parent reads that file
when its fork request fails, and starts a server without the package
(``warm_server._WarmServer``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from collections.abc import Iterator, Sequence

from . import warm_server

__path__: list[str] = []  # a package: the names above are its submodules


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


# The server's threads once it has imported what sharexec preloads itself, before the
# parent's packages: its main thread, and the pool NumPy's OpenBLAS may start at import,
# which it stops at each fork (its own handler) and starts again when next needed. A
# package that leaves any other thread running makes the server unfit to fork from.
_BASELINE = _threads()


def new_threads() -> bool:
    """Whether a thread runs here that did not when this module was imported, as a fork
    would find it: if one does, a throwaway fork first, which stops the pools of the
    libraries that stop theirs at a fork (SciPy's own OpenBLAS starts one at import)."""
    if not _threads() - _BASELINE:
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return bool(_threads() - _BASELINE)


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """Descriptors 1 and 2 on ``/dev/null`` (what Python buffered meanwhile too)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (null, *saved):
            os.close(fd)


def _import_quietly(name: str) -> None:
    warm_server.preloading(True)
    try:
        with _silenced():
            importlib.import_module(name)
    except BaseException:  # SystemExit, KeyboardInterrupt too: the package is skipped
        pass
    finally:
        warm_server.preloading(False)


class _Preloader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The finder of this module's submodules: each one an order to the server."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(warm_server.PRELOAD_PREFIX):
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        order = module.__name__.removeprefix(warm_server.PRELOAD_PREFIX)
        if not order.startswith("orders_"):
            return
        orders = bytes.fromhex(order.removeprefix("orders_")).decode()
        try:
            with open(orders) as f:
                told = json.load(f)
            path: list[str] = told["path"]
            packages: list[list[str]] = told["packages"]
        except (OSError, ValueError, KeyError, TypeError):
            return  # the parent is gone: this server will fork nothing
        # Where the parent found them: the server runs ``python -c`` (its working folder
        # first, the script's folder not at all) and multiprocessing's server ignores
        # the sys_path it is given (Python 3.11 to 3.13), so a package of the script's
        # folder would be missed, and one of the same name in the working folder taken.
        sys.path[:] = path
        for modules in packages:
            for name in modules:
                _import_quietly(name)
            if new_threads():
                with open(orders + ".left-out", "w") as f:
                    f.write(modules[0])
                os._exit(0)  # before serving any fork: the parent starts one without it


sys.meta_path.append(_Preloader())
