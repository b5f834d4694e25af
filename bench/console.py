"""What the bench scripts print besides their results: progress on stderr, and the
machine's load (``uptime``), which every published run states before and after."""

from __future__ import annotations

import os
import subprocess
import sys


def log(*parts: object) -> None:
    """A line of progress, on stderr."""
    print(*parts, file=sys.stderr, flush=True)


def uptime() -> str:
    """``uptime``'s line, e.g. "13:50:35 up 4:03, 0 user, load average: 0.14, 0.17, 0.30"."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())
