"""Worker functions of test_worker_state.py (importable by every start method)."""

from __future__ import annotations

import os
import signal
from typing import Any


def umask() -> int:
    """This process's umask, read without changing it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise LookupError("no Umask in /proc/self/status")


def state() -> dict[str, Any]:
    """What a process took from its parent: the variables of the tests, the working
    directory, the umask, the dispositions and blocking of the tests' signals."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    return {
        "SHAREXEC_TEST_NEW": os.environ.get("SHAREXEC_TEST_NEW"),
        "SHAREXEC_TEST_GONE": os.environ.get("SHAREXEC_TEST_GONE"),
        "cwd": os.getcwd(),
        "umask": umask(),
        "SIGUSR1 ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
        "SIGUSR2 ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN,
        "SIGTERM blocked": signal.SIGTERM in blocked,
    }
