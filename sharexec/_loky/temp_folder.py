"""multiprocessing's private temporary folder, where the system has no writable one.

Replaces nothing of loky 3.7. Each process has a private folder of multiprocessing's
(``multiprocessing.util.get_temp_dir()``: ``pymp-…`` in ``tempfile.gettempdir()``, mode
0700, removed at exit), where a fork server's socket is bound
(``connection.arbitrary_address("AF_UNIX")``) and where sharexec's warm server finds its
orders (``warm_preload``). Under a read-only root file system with no tmpfs on ``/tmp``
(Kubernetes' ``readOnlyRootFilesystem`` without an ``emptyDir``), ``tempfile`` finds no
writable folder, so that folder cannot be made and no fork server can start: neither the
default start method's nor the standard library's ``forkserver``.

:func:`fork_server_folder`, called before either starts: the folder multiprocessing makes,
as it makes it; only where that fails, one made the same way (``pymp-…``, mode 0700) in
``/dev/shm`` (:data:`FALLBACK_PARENTS`: a container's tmpfs, writable where the root is
not), stored where ``get_temp_dir`` looks first (the process's ``_config["tempdir"]``, a
cache multiprocessing keeps there itself) and removed at exit by the same kind of
finalizer. Nothing changes where a temporary folder is writable. Where ``/dev/shm`` is not
writable either, a :class:`FileNotFoundError` that says so and what to do.

Not an abstract socket address (``"\\0…"``, no file): the standard library's server
accepts any connection and unpickles what it is sent, and an abstract address is open to
every user of the network namespace (CVE-2022-42919, why Python 3.9.16 and 3.10.9 left
them); a socket in a folder of mode 0700 is open to its owner only.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from multiprocessing import process as mp_process
from multiprocessing import util as mp_util

logger = logging.getLogger("sharexec")

# Where the folder goes when no temporary folder is writable, in this order.
FALLBACK_PARENTS = ("/dev/shm",)

_lock = threading.Lock()  # one folder made, if two threads start executors at once


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a fork taken while another thread held it


os.register_at_fork(after_in_child=_after_fork_in_child)


def fallback_parent() -> str | None:
    """Where :func:`fork_server_folder` would make the folder now, looking only: None
    where a temporary folder is writable (multiprocessing's own place), else the first of
    :data:`FALLBACK_PARENTS` that is writable, else ``""`` (none is)."""
    import tempfile

    try:
        if os.access(tempfile.gettempdir(), os.W_OK | os.X_OK):
            return None
    except OSError:  # tempfile found none writable
        pass
    for parent in FALLBACK_PARENTS:
        if os.access(parent, os.W_OK | os.X_OK):
            return parent
    return ""


def fork_server_folder() -> str:
    """multiprocessing's private folder of this process, e.g. ``"/tmp/pymp-k2j3"``, made
    if it is not yet: in the temporary folder, as multiprocessing makes it; where none is
    writable, in ``/dev/shm``, e.g. ``"/dev/shm/pymp-k2j3"``.

    Raises :class:`FileNotFoundError` where no temporary folder is writable and no
    fallback either.
    """
    with _lock:
        try:
            folder: str = mp_util.get_temp_dir()
        except OSError as exc:  # tempfile's "No usable temporary directory found in …"
            missing = exc
        else:
            return folder
        import tempfile

        for parent in FALLBACK_PARENTS:
            try:
                folder = tempfile.mkdtemp(prefix="pymp-", dir=parent)
            except OSError:
                continue
            config = mp_process.current_process()._config  # type: ignore[attr-defined]
            config["tempdir"] = folder
            mp_util.Finalize(None, _remove, args=(folder,), exitpriority=-100)
            logger.debug(
                "no writable temporary folder: multiprocessing's private folder (fork "
                "servers' sockets) is %s",
                folder,
            )
            return folder
        raise FileNotFoundError(
            errno.ENOENT,
            f"A fork server (sharexec's default start method, or 'forkserver') binds its "
            f"socket in a private folder, and none can be made: {missing.strerror or missing}"
            f"; {' nor '.join(FALLBACK_PARENTS)} is not writable either. Mount a tmpfs on "
            "/tmp (an emptyDir under Kubernetes) or set TMPDIR to a writable folder",
        ) from missing


def _remove(folder: str) -> None:
    """At exit (multiprocessing's finalizers, as its own folder): remove ``folder``."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    current = mp_process.current_process()
    if current is not None and current._config.get("tempdir") == folder:  # type: ignore[attr-defined]
        current._config["tempdir"] = None  # type: ignore[attr-defined]
