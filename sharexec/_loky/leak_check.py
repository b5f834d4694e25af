"""In sharexec's workers: loky's leak check counts private memory only.

Replaces loky 3.7's ``loky.process_executor._get_memory_usage`` (the one module attribute
of loky that sharexec replaces), in its own workers only, never in the parent nor in a
worker of another pool: loky's measure is the worker's resident memory, which counts
the shared pages a worker maps (a large shared array read by a task), so a worker would
be restarted for memory it does not own.
"""

from __future__ import annotations

import gc
import importlib

from loky import process_executor


def count_private_memory_only() -> None:
    """Make loky's leak check in this worker count private memory only.

    With psutil installed, a loky worker measures its resident memory after its first
    task and restarts itself (with a warning about a memory leak) once it has grown by
    300 MB. Pages of shared memory this worker merely maps count in that figure: a
    worker reading a large shared array kept in a global by its initializer was restarted
    for it, and its initializer run again. Here the measure leaves shared pages out
    (psutil's ``shared``: resident pages backed by a file or by shared memory), so a
    real leak of private memory still restarts the worker. Only this process, a worker
    of ours, is changed: loky's ``process_executor._get_memory_usage`` is replaced in it.
    """
    if process_executor._USE_PSUTIL:
        process_executor._get_memory_usage = _private_memory


def _private_memory(pid: int, force_gc: bool = False) -> int:
    """Resident memory of ``pid`` that is its own: what loky's leak check should count."""
    psutil = importlib.import_module("psutil")  # present: loky found it

    if force_gc:
        gc.collect()
    info = psutil.Process(pid).memory_info()
    return int(info.rss - getattr(info, "shared", 0))
