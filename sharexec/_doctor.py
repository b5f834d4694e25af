"""``python -m sharexec doctor``: what this machine offers sharexec, and what is wrong.

Collects facts (platform, versions, the shared-memory folder and its free space, the
fallback folder, ``SHAREXEC_*`` variables that are invalid or unknown, start methods,
stale segments left by dead processes) as :class:`Finding` records; only the command
line prints them.

A segment is *stale* when its creator is dead, no process maps it and it has not changed
for a minute: a segment whose creator died is not enough (a worker's result handed to a
parent that is still running, a shared array a dead worker made for a live parent), and
``--clean`` must never remove another program's live data on a shared machine.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

from . import _segments
from ._config import Options, check_variables, describe_unknown, unknown_variables
from .errors import ConfigError

__all__ = ["Finding", "examine", "remove_stale", "stale_segments", "variable_findings"]

# Below this, /dev/shm is too small for the arrays sharexec is meant for (Docker's
# default is 64 MB): segments then spill to disk.
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


def stale_segments() -> list[tuple[str, int]]:
    """sharexec segments whose creating process is dead, that no process maps and that
    have not changed for ``STALE_AFTER_SECONDS``, with their sizes."""
    found = []
    mapped: set[str] | None = None
    now = time.time()
    for name in _segments.listdir():
        pid = name.split("-")[1]
        if not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        path = os.path.join(_segments.SHM_FOLDER, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.getuid() or now - st.st_mtime < STALE_AFTER_SECONDS:
            continue
        if mapped is None:
            mapped = mapped_segments()
        if name not in mapped:
            found.append((name, st.st_size))
    return found


def remove_stale() -> list[str]:
    """Unlink the stale segments; return their names."""
    names = [name for name, _ in stale_segments()]
    for name in names:
        _segments.unlink(name)
    return names


def variable_findings() -> list[Finding]:
    """One error per invalid ``SHAREXEC_*`` value, one warning per unknown variable."""
    findings = [Finding("environment", str(error), "error") for error in check_variables()]
    for name, closest in unknown_variables():
        findings.append(Finding("environment", describe_unknown(name, closest), "warning"))
    return findings


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
    shm = _segments.SHM_FOLDER
    if os.path.isdir(shm):
        usage = shutil.disk_usage(shm)
        detail = f"{shm}: {_size(usage.free)} free of {_size(usage.total)}"
        if usage.total < SMALL_SHM_BYTES:
            findings.append(
                Finding(
                    "shared memory",
                    f"{detail}: small (Docker's default is 64 MB); large arrays will spill "
                    "to disk. In Docker, run with --shm-size=8g (or more)",
                    "warning",
                )
            )
        else:
            findings.append(Finding("shared memory", detail, "ok"))
    else:
        findings.append(
            Finding("shared memory", f"{shm} is missing: every segment spills to disk", "error")
        )
    findings.extend(variable_findings())
    try:
        options = Options.resolve({})
        source = ""
    except ConfigError:  # reported above; the defaults stand for the rest
        options = Options()
        source = " (the default: a variable is invalid, see above)"
    spill = options.temp_folder or tempfile.gettempdir()
    findings.append(
        Finding(
            "fallback folder",
            f"{spill}: {_size(shutil.disk_usage(spill).free)} free "
            "(set SHAREXEC_TEMP_FOLDER to change it)",
            "ok",
        )
    )
    findings.append(
        Finding("min_share_bytes", f"{options.min_share_bytes:,} bytes{source}", "ok"),
    )
    methods = multiprocessing.get_all_start_methods()
    findings.append(Finding("start methods", ", ".join([*methods, "loky"]), "ok"))
    stale = stale_segments()
    if stale:
        total = sum(size for _, size in stale)
        findings.append(
            Finding(
                "stale segments",
                f"{len(stale)} left by dead processes ({_size(total)}): "
                f"{', '.join(name for name, _ in stale[:5])}"
                f"{' …' if len(stale) > 5 else ''}; remove them with "
                "`python -m sharexec doctor --clean`",
                "warning",
            )
        )
    else:
        findings.append(Finding("stale segments", "none", "ok"))
    return findings
