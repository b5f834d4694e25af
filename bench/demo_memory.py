"""The peak memory of ``python -m sharexec demo --size-mb N``, which the demo states up front.

Samples the proportional set size (PSS: shared pages split among the processes mapping
them, so that shared memory counts once) of the demo's process tree every 20 ms with
psutil (the ``bench`` extra), and prints the peak. ``sharexec/_demo.py`` (``peak_bytes``)
cites the runs its estimate comes from. Usage: ``python bench/demo_memory.py 256``.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import psutil

size = sys.argv[1]
proc = subprocess.Popen(
    [sys.executable, "-m", "sharexec", "demo", "--size-mb", size],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
)
root = psutil.Process(proc.pid)
peak = 0
while proc.poll() is None:
    total = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        break
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_full_info().pss
    peak = max(peak, total)
    time.sleep(0.02)
out = proc.stdout.read()
print(out)
print(
    f"peak PSS of the tree: {peak / 2**20:.0f} MiB for --size-mb {size} "
    f"({peak / (float(size) * 2**20):.2f}x the array)"
)
