"""``python -m sharexec doctor``: what this machine offers sharexec, and what is wrong.

Collects facts (platform, versions, the shared-memory folder and its free space, the
fallback folder, start methods, stale segments left by dead processes) as
:class:`Finding` records; only the command line prints them.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass

from . import _segments
from ._config import Options

__all__ = ["Finding", "examine", "remove_stale"]

# Below this, /dev/shm is too small for the arrays sharexec is meant for (Docker's
# default is 64 MB): segments then spill to disk.
SMALL_SHM_BYTES = 1 << 30


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


def stale_segments() -> list[tuple[str, int]]:
    """sharexec segments whose creating process is dead, with their sizes."""
    found = []
    for name in _segments.listdir():
        pid = name.split("-")[1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            path = os.path.join(_segments.SHM_FOLDER, name)
            try:
                found.append((name, os.stat(path).st_size))
            except FileNotFoundError:
                continue
    return found


def remove_stale() -> list[str]:
    """Unlink the stale segments; return their names."""
    names = [name for name, _ in stale_segments()]
    for name in names:
        _segments.unlink(name)
    return names


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
    options = Options.resolve({})
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
        Finding("min_share_bytes", f"{options.min_share_bytes:,} bytes", "ok"),
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
