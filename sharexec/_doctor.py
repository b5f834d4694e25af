"""``python -m sharexec doctor``: what this machine offers sharexec, and what is wrong.

Collects facts (platform, versions, the shared-memory folder and its free space, which
kind of segment is in use and why, the fallback folder, where fork servers bind their
sockets when no temporary folder is writable, ``SHAREXEC_*`` variables that are invalid
or unknown, start methods, stale segments left by dead processes) as
:class:`Finding` records; only the command line prints them.

A segment is *stale* when its creator is surely dead, no process maps it and it has not
changed for a minute: a segment whose creator died is not enough (a worker's result
handed to a parent that is still running, a shared array a dead worker made for a live
parent), and ``--clean`` must never remove another program's live data on a shared
machine. A pid says which process only within its PID namespace, and programs in
several namespaces may share one ``/dev/shm`` (a container run with ``--ipc=host``, a
sidecar): a segment's name says its creator's namespace, and a creator is judged only
from that namespace. The others are kept, and the report says why (:func:`survey`).
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass

from . import _passing, _segments
from ._config import Options, check_variables, describe_unknown, unknown_variables
from .errors import ConfigError

__all__ = [
    "Finding",
    "Survey",
    "examine",
    "remove_stale",
    "stale_segments",
    "survey",
    "variable_findings",
]

# Below this, /dev/shm is too small for the arrays sharexec is meant for (Docker's
# default is 64 MB): larger segments are then anonymous, or spill to disk.
SMALL_SHM_BYTES = 1 << 30
# A segment unchanged for less than this may be in flight between two processes.
STALE_AFTER_SECONDS = 60.0


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was looked at, what was found, and how it stands."""

    topic: str
    detail: str
    status: str  # "ok", "warning" or "error"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def mapped_segments() -> set[str]:
    """Names of the sharexec segments that some process (that this user may look at)
    maps now, from ``/proc/*/maps``."""
    marker = os.path.join(_segments.SHM_FOLDER, _segments.PREFIX)
    found = set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    at = line.find(marker)
                    if at >= 0:
                        found.add(os.path.basename(line[at:].split()[0]))
        except OSError:  # gone, or not ours to read
            continue
    return found


# The machine's initial PID namespace (``PROC_PID_INIT_INO`` in Linux's
# include/linux/proc_ns.h): every PID namespace is nested in it.
INITIAL_PID_NAMESPACE = 0xEFFFFFFC


@dataclass(frozen=True)
class Survey:
    """The segments of this user that nothing visibly uses: those whose creator is
    known dead (``stale``: name and size, e.g. ``[("sharexec-41-4026531836.Zm9v",
    4096)]``), and those whose creator cannot be judged from here (``kept``: name, size
    and why)."""

    stale: list[tuple[str, int]]
    kept: list[tuple[str, int, str]]


class _Here:
    """What this process can tell of the processes of the machine, read once."""

    def __init__(self) -> None:
        self.namespace = _segments.pid_namespace()
        # /proc may be another namespace's (``unshare --pid`` without ``--mount-proc``, a
        # container given the host's): then its pids are not the ones names carry.
        try:
            self.proc_is_ours = os.readlink("/proc/self") == str(os.getpid())
        except OSError:
            self.proc_is_ours = False
        self._alone: bool | None = None

    def cannot_judge(self, namespace: int | None) -> str | None:
        """Why the liveness of a creator of PID namespace ``namespace`` (None: its name
        does not say) cannot be told from here; None if it can."""
        if self.namespace is None or not self.proc_is_ours:
            return (
                "this process cannot see its own PID namespace's processes (mount its "
                "/proc, e.g. `unshare --pid --fork --mount-proc`)"
            )
        if namespace is None:
            if self.alone():
                return None
            return (
                "named by an older sharexec, without its creator's PID namespace; only "
                "a doctor in the machine's first PID namespace, with no other in sight, "
                "can judge it"
            )
        if namespace != self.namespace:
            return (
                f"made in PID namespace pid:[{namespace}], not this one "
                f"(pid:[{self.namespace}]): its creator may be alive there; "
                "run the doctor in that namespace to judge it"
            )
        return None

    def alone(self) -> bool:
        """Whether every process of the machine is in this PID namespace: then a pid
        that names no process here names no process anywhere."""
        if self._alone is None:
            self._alone = self.namespace == INITIAL_PID_NAMESPACE and not _nested_in_sight()
        return self._alone


def _nested_in_sight() -> bool:
    """Whether any process in sight lives in a PID namespace nested in this one (or
    whether that cannot be told): its ``NSpid`` has more than one pid."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                line = next((line for line in f if line.startswith("NSpid:")), None)
        except OSError:  # gone
            continue
        if line is None or len(line.split()) != 2:
            return True  # nested, or a kernel that does not say (before Linux 4.1)
    return False


def survey() -> Survey:
    """The segments of this user that no process in sight maps and that have not
    changed for ``STALE_AFTER_SECONDS``, whose creator is not alive here.

    Stale: the name says a PID namespace, it is this process's, and no process has its
    pid (an older name, without one: the same where no other namespace is in sight from
    the machine's first). A pid in use keeps a segment, even if it is another process's
    since. Kept, and said why: a segment made in another PID namespace (its creator may
    be alive there, out of sight: a container sharing ``/dev/shm``), or named by an older
    sharexec without one, or any when ``/proc`` is not this namespace's.
    """
    stale: list[tuple[str, int]] = []
    kept: list[tuple[str, int, str]] = []
    mapped: set[str] | None = None
    here: _Here | None = None
    now = time.time()
    for name in _segments.listdir():
        made = _segments.creator(name)
        if made is None:
            continue
        pid, namespace = made
        try:
            st = os.stat(os.path.join(_segments.SHM_FOLDER, name))
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < STALE_AFTER_SECONDS:
            continue
        if here is None:
            here = _Here()
        why = here.cannot_judge(namespace)
        if why is None and os.path.exists(f"/proc/{pid}"):
            continue  # its creator is alive, or its pid is another process's since
        if mapped is None:
            mapped = mapped_segments()
        if name in mapped:
            continue
        if why is None:
            stale.append((name, st.st_size))
        else:
            kept.append((name, st.st_size, why))
    return Survey(stale, kept)


def stale_segments() -> list[tuple[str, int]]:
    """sharexec segments whose creating process is surely dead, that no process maps and
    that have not changed for ``STALE_AFTER_SECONDS``, with their sizes (see
    :func:`survey`)."""
    return survey().stale


def remove_stale() -> Survey:
    """Unlink the stale segments; return what was found (removed: ``stale``)."""
    found = survey()
    for name, _ in found.stale:
        _segments.unlink(name)
    return found


def _names(names: list[str]) -> str:
    return f"{', '.join(names[:5])}{' …' if len(names) > 5 else ''}"


def variable_findings() -> list[Finding]:
    """One error per invalid ``SHAREXEC_*`` value, one warning per unknown variable."""
    findings = [Finding("environment", str(error), "error") for error in check_variables()]
    for name, closest in unknown_variables():
        findings.append(Finding("environment", describe_unknown(name, closest), "warning"))
    return findings


def _shared_memory() -> list[Finding]:
    """The shared-memory folder, and which kind of segment this machine gets, and why."""
    shm = _segments.SHM_FOLDER
    anonymous = _segments.anonymous_supported()
    limit = _segments.memory_limit()
    workers = (
        "workers pass theirs to the parent (descriptors over a Unix socket)"
        if anonymous and _passing.listen()
        else "a worker's fresh results go to files (no abstract Unix socket to pass them)"
    )
    instead = (
        f"anonymous shared memory (memfd) instead, which counts against the memory limit "
        f"({_size(limit)}), not against {shm}; {workers}"
        if anonymous
        else "files on disk instead (no memfd_create, or /proc is not mounted)"
    )
    if not os.path.isdir(shm):
        return [
            Finding(
                "shared memory",
                f"{shm} is missing: segments go to {instead}",
                "warning" if anonymous else "error",
            )
        ]
    usage = shutil.disk_usage(shm)
    detail = f"{shm}: {_size(usage.free)} free of {_size(usage.total)}"
    if usage.total >= SMALL_SHM_BYTES:
        kind = "named, in " + shm
        if anonymous:
            kind += "; anonymous (memfd) for a segment that does not fit there"
        return [Finding("shared memory", detail, "ok"), Finding("segments", kind, "ok")]
    small = f"{detail}: small (Docker's default is 64 MB)"
    kind = f"named, in {shm}, while they fit; larger ones go to {instead}"
    if anonymous:
        return [Finding("shared memory", small, "ok"), Finding("segments", kind, "ok")]
    return [
        Finding("shared memory", f"{small}. In Docker, run with --shm-size=8g", "warning"),
        Finding("segments", kind, "warning"),
    ]


def _fork_servers() -> list[Finding]:
    """Where a fork server's socket goes (the default start method's, ``forkserver``'s),
    said only where no temporary folder is writable: in /dev/shm, or nowhere."""
    from ._loky import fallback_parent

    parent = fallback_parent()
    if parent is None:  # multiprocessing's own private folder, in the temporary folder
        return []
    if parent:
        detail = (
            "no temporary folder is writable: a fork server (the default start method, "
            f"'forkserver') binds its socket in a private folder of {parent} instead"
        )
        return [Finding("fork servers", detail, "ok")]
    detail = (
        "no temporary folder is writable, nor /dev/shm: no fork server (the default start "
        "method, 'forkserver') can bind its socket: mount a tmpfs on /tmp, or set TMPDIR "
        "to a writable folder"
    )
    return [Finding("fork servers", detail, "warning")]


def examine() -> list[Finding]:
    """Look at this machine the way sharexec will use it."""
    import cloudpickle
    import loky
    import numpy

    from . import __version__

    findings = [
        Finding("platform", f"{platform.platform()}, {os.cpu_count()} cores", "ok"),
        Finding(
            "versions",
            f"sharexec {__version__}, Python {platform.python_version()}, "
            f"numpy {numpy.__version__}, loky {loky.__version__}, "
            f"cloudpickle {cloudpickle.__version__}",
            "ok",
        ),
    ]
    if not sys.platform.startswith("linux"):
        findings.append(Finding("platform", "sharexec is tested on Linux only", "warning"))
    findings.extend(_shared_memory())
    findings.extend(variable_findings())
    try:
        options = Options.resolve({})
        source = ""
    except ConfigError:  # reported above; the defaults stand for the rest
        options = Options()
        source = " (the default: a variable is invalid, see above)"
    spill = options.spill_folder()
    if os.access(spill, os.W_OK | os.X_OK):
        findings.append(
            Finding(
                "fallback folder",
                f"{spill}: {_size(shutil.disk_usage(spill).free)} free "
                "(set SHAREXEC_TEMP_FOLDER to change it)",
                "ok",
            )
        )
    else:
        findings.append(
            Finding(
                "fallback folder",
                f"{spill} is not writable (a read-only root file system?): what finds no "
                "room in shared memory is pickled instead (mount a tmpfs on /tmp, or set "
                "SHAREXEC_TEMP_FOLDER to a writable folder)",
                "warning",
            )
        )
    findings.extend(_fork_servers())
    findings.append(
        Finding("min_share_bytes", f"{options.min_share_bytes:,} bytes{source}", "ok"),
    )
    methods = multiprocessing.get_all_start_methods()
    findings.append(Finding("start methods", ", ".join([*methods, "loky"]), "ok"))
    found = survey()
    if found.stale:
        total = sum(size for _, size in found.stale)
        findings.append(
            Finding(
                "stale segments",
                f"{len(found.stale)} left by dead processes ({_size(total)}): "
                f"{_names([name for name, _ in found.stale])}; remove them with "
                "`python -m sharexec doctor --clean`",
                "warning",
            )
        )
    else:
        findings.append(Finding("stale segments", "none", "ok"))
    reasons: dict[str, list[tuple[str, int]]] = {}
    for name, size, why in found.kept:
        reasons.setdefault(why, []).append((name, size))
    for why, kept in reasons.items():
        total = sum(size for _, size in kept)
        findings.append(
            Finding(
                "kept segments",
                f"{len(kept)} ({_size(total)}) not ours to judge, kept: {why} "
                f"({_names([name for name, _ in kept])})",
                "ok",
            )
        )
    return findings


def preload_findings(packages: list[str]) -> list[Finding]:
    """Which of ``packages`` the workers of the default start method find imported.

    Imports them here, as a program would before making its pool, then makes one and
    asks a worker. A package the warm server leaves out (its import starts a thread:
    workers must be forks of a process with one thread) is imported by each worker when
    a task needs it; so is one that fails to import in the server.
    """
    import importlib

    from ._executor import SharedProcessPoolExecutor
    from ._loky import warm_left_out

    findings = []
    imported = []
    for name in packages:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the user's package: anything it raises is a finding
            findings.append(Finding("preload", f"{name}: cannot import it here: {exc}", "error"))
        else:
            imported.append(name)
    if not imported:
        return findings
    with SharedProcessPoolExecutor(1) as ex:
        present = set(ex.submit(_imported, imported).result())
    left_out = warm_left_out()
    for name in imported:
        if name in present:
            findings.append(Finding("preload", f"{name}: imported by the warm server", "ok"))
        elif name in left_out:
            detail = (
                f"{name}: left out of the warm server (its import starts a thread); "
                "each worker imports it when a task needs it"
            )
            findings.append(Finding("preload", detail, "warning"))
        else:
            detail = (
                f"{name}: not imported by the warm server (it failed there, or it is not "
                "a top-level package outside the standard library); each worker imports "
                "it when a task needs it"
            )
            findings.append(Finding("preload", detail, "warning"))
    return findings


def _imported(names: list[str]) -> list[str]:
    """In a worker: which of ``names`` are imported already."""
    return [name for name in names if name in sys.modules]
