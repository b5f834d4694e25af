"""What the bench scripts print besides their results: progress on stderr, and the
machine's load (``uptime``), which every published run states before and after."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def log(*parts: object) -> None:
    """A line of progress, on stderr."""
    print(*parts, file=sys.stderr, flush=True)


def uptime() -> str:
    """``uptime``'s line, e.g. "13:50:35 up 4:03, 0 user, load average: 0.14, 0.17, 0.30"."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def commit(root: Path) -> str:
    """The checkout's commit as ``git describe --always --dirty`` says it ("" without
    git), e.g. "8b66752-dirty": every published run names the code it measured."""
    try:
        return subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return ""


def compile_sharexec() -> None:
    """Write the bytecode of the sharexec this process imports (``__pycache__``), as
    ``pip install`` does for a user: without it each process compiles sharexec's sources
    at import (about 0.1 s of CPU in the parent and as much in the warm server), which a
    checkout run with ``PYTHONDONTWRITEBYTECODE`` set (as on our machines) never saves."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("sharexec")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            compileall.compile_dir(folder, quiet=1)
