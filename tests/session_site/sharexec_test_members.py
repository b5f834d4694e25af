"""Which processes belong to this test session, recorded as each one starts.

Segment names carry their creator's pid (``sharexec-<pid>-<random>``), and a creator may
be dead by the time a test looks (a worker killed on purpose, a worker whose results the
parent adopted). To tell a dead creator of this session from one of another program on
the machine, every Python process the session starts writes its pid and start time
into the session's members file(s) as it starts: ``tests/conftest.py`` puts this folder
first on ``PYTHONPATH`` (its ``sitecustomize`` calls :func:`install`) and names the files
in ``PYTEST_SHAREXEC_MEMBERS`` (``os.pathsep``-separated: a test session run inside
another one records its processes in both). A process forked without ``exec`` (the
``fork`` and ``forkserver`` start methods) records itself through an at-fork hook.

Imports only ``os``: it runs in every worker the session starts.
"""

from __future__ import annotations

import os

ENV = "PYTEST_SHAREXEC_MEMBERS"


def start_time(pid: int) -> int | None:
    """The start time of a live process (clock ticks since boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19])  # field 22 of proc(5); fields[0] is field 3


def record() -> None:
    """Append this process (pid and start time) to every members file named in ENV."""
    paths = os.environ.get(ENV)
    if not paths:
        return
    pid = os.getpid()
    line = f"{pid} {start_time(pid)}\n".encode()
    for path in paths.split(os.pathsep):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            continue  # that session is over
        try:
            os.write(fd, line)  # one write of a short line: appends never interleave
        finally:
            os.close(fd)


_installed = False


def install() -> None:
    """Record this process now (again, if the members files changed), and every child it
    forks as that child starts."""
    global _installed
    record()
    if not _installed:
        _installed = True
        os.register_at_fork(after_in_child=record)
