"""Measuring instruments: CPU time, peak extra memory, and the machine's floor.

CPU time is that of the parent and of all its descendants (the pool's workers, resource
trackers, a fork server), from psutil's per-process ``cpu_times`` (user + system), taken
before and after: unlike ``RUSAGE_CHILDREN`` it counts workers that are still alive.

Memory is sampled by a background thread every few milliseconds: the proportional set
size (PSS) of the parent and its descendants less their shared-memory pages (``Pss_Shmem``),
plus the allocated size of every ``/dev/shm`` file that is theirs, counted once. A file is
theirs if one of them maps it (unlinked or not: found in ``/proc/<pid>/maps`` and measured
through ``/proc/<pid>/map_files``), or by name if none maps it (made by one process, not
yet attached by the other; joblib's memmap files): ``psm_*``
(``multiprocessing.shared_memory``), ``sharexec-<pid>-*`` and
``joblib_memmapping_folder_<pid>_*`` with the pid of a process of ours. The allocated size,
not the mapped pages: a result segment the parent maps but reads two pages of still holds
all its memory. Copy-on-write copies of shared pages are anonymous pages, in PSS. Not the
bytes in use on ``/dev/shm`` as a whole: on a shared machine other programs' segments
swing that by gigabytes during a run.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import psutil

SHM = "/dev/shm"
MiB = 1 << 20


# ---------------------------------------------------------------------------------------
# CPU time
# ---------------------------------------------------------------------------------------


_SEEN: set[int] = {os.getpid()}  # every process of ours seen so far, alive or not


def _family() -> list[psutil.Process]:
    me = psutil.Process()
    family = [me, *me.children(recursive=True)]
    _SEEN.update(p.pid for p in family)
    return family


def cpu_snapshot() -> dict[int, float]:
    """pid -> CPU seconds (user + system) of the parent and its descendants."""
    snapshot = {}
    for proc in _family():
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            snapshot[proc.pid] = t.user + t.system
    return snapshot


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots (a process born in between counts whole)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


# ---------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------


def _pss_private(pid: int) -> int:
    """Pss less Pss_Shmem of one process, in bytes (0 if it is gone)."""
    pss = shmem = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith(b"Pss_Shmem:"):
                    shmem = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return (pss - shmem) * 1024


def _mapped_shm(pid: int, found: dict[int, int]) -> None:
    """Add the /dev/shm files that one process maps to ``found``: inode -> allocated bytes."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = f.readlines()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(b"/dev/shm/"):
            continue
        inode = int(fields[4])
        if inode in found:
            continue
        with contextlib.suppress(OSError):
            st = os.stat(f"/proc/{pid}/map_files/{fields[0].decode()}")
            found[inode] = st.st_blocks * 512


_OURS = re.compile(r"(?:sharexec-|joblib_memmapping_folder_)(\d+)[-_]")


def _ours(name: str) -> bool:
    if name.startswith("psm_"):
        return True
    match = _OURS.match(name)
    return match is not None and int(match[1]) in _SEEN


def _unmapped_shm(found: dict[int, int]) -> None:
    """Add our /dev/shm files that none of our processes maps to ``found``."""
    entries = []
    with contextlib.suppress(FileNotFoundError), os.scandir(SHM) as it:
        entries = [e for e in it if _ours(e.name)]
    for entry in entries:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            if entry.is_dir(follow_symlinks=False):
                with os.scandir(entry.path) as it:
                    files = list(it)
            else:
                files = [entry]
            for f in files:
                st = f.stat(follow_symlinks=False)
                found.setdefault(st.st_ino, st.st_blocks * 512)


def _memory(pids: list[int]) -> int:
    files: dict[int, int] = {}
    for pid in pids:
        _mapped_shm(pid, files)
    _unmapped_shm(files)
    return sum(_pss_private(pid) for pid in pids) + sum(files.values())


def memory_now() -> int:
    """Private PSS of the parent and its descendants, plus their /dev/shm files."""
    return _memory([p.pid for p in _family()])


class MemorySampler:
    """Peak extra memory of the parent and its descendants, while the ``with`` block runs.

    ``extra`` is the peak of :func:`memory_now` less ``baseline``: by default its value when
    the block was entered; give an earlier one to count what a system kept from before
    (a cache of segments, say) as its own.
    """

    def __init__(
        self, interval: float = 0.005, refresh: float = 0.1, baseline: int | None = None
    ) -> None:
        self.interval = interval
        self.refresh = refresh  # how often the list of descendants is re-read
        self.samples = 0
        self.given = baseline
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._pids: list[int] = []
        self._listed = 0.0

    def _sample(self) -> int:
        now = time.monotonic()
        if now - self._listed > self.refresh:
            self._pids = [p.pid for p in _family()]
            self._listed = now
        total = _memory(self._pids)
        self.samples += 1
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._sample())

    def __enter__(self) -> MemorySampler:
        self.peak = self._sample()
        self.baseline = self.peak if self.given is None else self.given
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


# ---------------------------------------------------------------------------------------
# The floor: what this machine can do at best
# ---------------------------------------------------------------------------------------


def _median_rate(nbytes: int, run: Callable[[], float], reps: int) -> float:
    """GB/s (1e9 bytes/s) of the median of ``reps`` timings returned by ``run``."""
    return nbytes / statistics.median(run() for _ in range(reps)) / 1e9


def memcpy_touched(nbytes: int, reps: int) -> float:
    """Copy into memory whose pages are already touched, in GB/s."""
    src = np.ones(nbytes // 8)
    dst = np.zeros_like(src)
    dst[...] = 2.0

    def run() -> float:
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    return _median_rate(src.nbytes, run, reps)


def copy_fresh_shm(nbytes: int, reps: int) -> float:
    """Create a new /dev/shm segment and copy into it, in GB/s (unlink not timed)."""
    src = np.ones(nbytes // 8)

    def run() -> float:
        start = time.perf_counter()
        segment = shared_memory.SharedMemory(create=True, size=src.nbytes)
        view = np.ndarray(src.shape, src.dtype, buffer=segment.buf)
        np.copyto(view, src)
        elapsed = time.perf_counter() - start
        del view
        segment.close()
        segment.unlink()
        return elapsed

    return _median_rate(src.nbytes, run, reps)


def pipe_throughput(nbytes: int, reps: int, chunk: int = MiB) -> float:
    """A writer process writes into an os.pipe, the parent reads, in GB/s.

    Timed from the first bytes read to end of file (the writer's start-up is not timed).
    The pipe has the default capacity, as the executors' pipes have. Call before any pool
    or thread is started: the writer is a plain ``os.fork``.
    """

    def run() -> float:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer
            os.close(r)
            data = memoryview(b"\1" * chunk)
            left = nbytes
            while left > 0:
                left -= os.write(w, data[: min(chunk, left)])
            os._exit(0)
        os.close(w)
        buf = bytearray(chunk)
        with open(r, "rb", buffering=0) as f:
            got = f.readinto(buf) or 0
            start, received = time.perf_counter(), 0
            while n := f.readinto(buf):
                received += n
            elapsed = time.perf_counter() - start
        os.waitpid(pid, 0)
        if got + received != nbytes:
            raise RuntimeError(f"pipe: read {got + received} of {nbytes} bytes")
        return elapsed * nbytes / received

    return _median_rate(nbytes, run, reps)


def compute_sum(nbytes: int, reps: int) -> float:
    """Seconds for one ``a.sum()`` of ``nbytes`` of float64 in the parent (no transport)."""
    a = np.ones(nbytes // 8)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
