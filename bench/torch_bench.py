"""The tensor benchmark: ``python bench/torch_bench.py``.

PyTorch programs run unchanged on three pools of 2 workers, in the same run and under the
same start method (``--start-method``, default spawn): ``stdlib``
(``concurrent.futures.ProcessPoolExecutor``, which pickles with multiprocessing's
``ForkingPickler`` and so with torch's reducers: tensors moved to torch's shared memory,
passed by file descriptor), ``torch.mp.Pool`` (``torch.multiprocessing``'s ``Pool``, the
same reducers) and ``sharexec``; with ``--torch-road`` also ``sharexec/torch``
(``SharedProcessPoolExecutor(tensor_sharing="torch")``: private tensors through torch's
reducers too). Each pool is started and warmed up (torch imported in every worker) before
anything is timed; each workload is timed ``--reps`` times (default 5) on fresh inputs, made
outside the timing (round robin: each repetition runs every system once), and the tables
show the medians of wall time and of CPU time (this process and all its descendants,
with psutil), and their ratio to the stdlib's.

Workloads (sizes in MiB, times ``--scale``):

- T1: 8 tasks ``total(t) -> float(t.sum())``, each with its own private 128 MiB float32
  tensor. Every system ends with the parent's tensor in shared memory (checked).
- T2: 8 tasks each returning a fresh 64 MiB float32 tensor (``torch.full``).
- T3: 16 tasks fill one private 512 MiB float32 tensor (``t = torch.zeros(n)``), slice by
  slice, in place; the parent sees every slice (checked).
- T3s (sharexec only): the same with the tensor allocated in a sharexec segment
  (``torch.from_numpy(sharexec.zeros(n, np.float32))``): nothing to move.

Prints two markdown tables (wall, CPU); ``--json PATH`` writes the run, every time in it:
``--json docs/bench-torch-results.json`` publishes it, and ``bench/render.py`` renders the
docs' tensor figures from that file. Run it with a private /dev/shm where other programs'
segments might interfere (a tmpfs mounted in a private mount namespace: ``unshare``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console import commit, compile_sharexec, log, uptime

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent

MiB = 1 << 20
SYSTEMS = ["stdlib", "torch.mp.Pool", "sharexec", "sharexec/torch"]


# ---------------------------------------------------------------------------------------
# The systems: one submit, whatever the pool
# ---------------------------------------------------------------------------------------


class Pool:
    """A pool of 2 workers of one system, with ``submit(fn, *args)`` and ``close()``."""

    def __init__(self, system: str, method: str) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        import torch.multiprocessing as torch_mp

        import sharexec

        self.system = system
        if system == "stdlib":
            self._pool: Any = ProcessPoolExecutor(
                2, mp_context=multiprocessing.get_context(method)
            )
        elif system == "torch.mp.Pool":
            self._pool = torch_mp.get_context(method).Pool(2)
        elif system == "sharexec":
            self._pool = sharexec.SharedProcessPoolExecutor(2, mp_context=method)
        elif system == "sharexec/torch":
            self._pool = sharexec.SharedProcessPoolExecutor(
                2, mp_context=method, tensor_sharing="torch"
            )
        else:
            raise ValueError(system)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
        """Send ``fn(*args)``; return what waits for its result."""
        if self.system == "torch.mp.Pool":
            return self._pool.apply_async(fn, args).get
        return self._pool.submit(fn, *args).result

    def close(self) -> None:
        if self.system == "torch.mp.Pool":
            self._pool.close()
            self._pool.join()
        else:
            self._pool.shutdown(wait=True)


# ---------------------------------------------------------------------------------------
# The workloads: make the inputs (untimed), run (timed), check (untimed)
# ---------------------------------------------------------------------------------------


def shared(t: Any) -> bool:
    import sharexec

    return bool(t.is_shared() or sharexec.is_shared(t))


def t1(pool: Pool, scale: float) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    import torch
    import torch_tasks

    n = int(128 * MiB * scale) // 4
    tensors = [torch.rand(n) for _ in range(8)]
    expected = [float(t.sum()) for t in tensors]

    def run() -> Any:
        waits = [pool.submit(torch_tasks.total, t) for t in tensors]
        return [wait() for wait in waits]

    def check(out: Any) -> None:
        assert all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(out, expected, strict=True)), (
            "wrong sums"
        )
        assert all(map(shared, tensors)), "a parent's tensor was not moved to shared memory"

    return run, check


def t2(pool: Pool, scale: float) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    import torch
    import torch_tasks

    n = int(64 * MiB * scale) // 4

    def run() -> Any:
        waits = [pool.submit(torch_tasks.make, n, float(i)) for i in range(8)]
        return [wait() for wait in waits]

    def check(out: Any) -> None:
        for i, r in enumerate(out):
            assert type(r) is torch.Tensor and r.dtype == torch.float32 and r.shape == (n,)
            assert float(r[0]) == i and float(r[-1]) == i, "wrong result"

    return run, check


def t3(pool: Pool, scale: float, native: bool = False) -> tuple[Any, Any]:
    import numpy as np
    import torch
    import torch_tasks

    import sharexec

    n = int(512 * MiB * scale) // 4
    t = torch.from_numpy(sharexec.zeros(n, dtype=np.float32)) if native else torch.zeros(n)
    bounds = [(n * i // 16, n * (i + 1) // 16) for i in range(16)]

    def run() -> Any:
        waits = [
            pool.submit(torch_tasks.fill, t, lo, hi, float(i + 1))
            for i, (lo, hi) in enumerate(bounds)
        ]
        return [wait() for wait in waits]

    def check(out: Any) -> None:
        for i, (lo, hi) in enumerate(bounds):
            assert float(t[lo]) == i + 1 and float(t[hi - 1]) == i + 1, "a write was lost"

    return run, check


WORKLOADS: dict[str, tuple[str, Callable[..., Any]]] = {
    "T1": ("8 tasks, each a 128 MiB tensor argument", t1),
    "T2": ("8 tasks, each returning a 64 MiB tensor", t2),
    "T3": ("16 tasks fill a 512 MiB tensor (torch.zeros)", t3),
    "T3s": ("the same, allocated in a sharexec segment", lambda p, s: t3(p, s, native=True)),
}


def cpu_meter() -> Callable[[], float]:
    """CPU seconds (user + system) of this process and all its descendants so far, from
    bench/measure.py (psutil; the ``bench`` extra); a meter that reads nothing without it.

    Less swayed than wall time by other programs on a loaded machine: what a system
    costs, not when the scheduler let it run.
    """
    try:
        import measure
    except ImportError:
        return lambda: float("nan")
    return lambda: sum(measure.cpu_snapshot().values())


def measure_once(
    pool: Pool, workload: str, scale: float, cpu: Callable[[], float]
) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``workload`` on ``pool``."""
    run, check = WORKLOADS[workload][1](pool, scale)  # fresh inputs, untimed
    gc.collect()
    cpu_before = cpu()
    start = time.perf_counter()
    out = run()
    elapsed = time.perf_counter() - start
    spent = cpu() - cpu_before
    check(out)
    del run, check, out
    gc.collect()
    return elapsed, spent


def versions() -> dict[str, str]:
    """What ran: Python, torch, NumPy, loky, sharexec and its commit."""
    import platform

    out = {"python": platform.python_version()}
    for module in ("torch", "numpy", "loky", "sharexec"):
        out[module] = __import__(module).__version__
    out["sharexec_commit"] = commit(ROOT)
    return out


def table(record: dict[str, Any], kind: str) -> str:
    """The markdown table of ``record``'s ``kind`` ("wall" or "cpu"): medians in s
    (min-max), and sharexec's median over the stdlib's (T3s: over the stdlib's T3, the
    same program with ``torch.zeros``)."""
    systems = record["systems"]
    times = record[kind]
    lines = [
        "| workload | " + " | ".join(systems) + " | sharexec / stdlib |",
        "|---|" + "---:|" * (len(systems) + 1),
    ]
    for workload in record["workloads"]:
        row = times[workload]
        cells = [
            f"{statistics.median(row[s]):.3f} ({min(row[s]):.2f}-{max(row[s]):.2f})"
            if s in row
            else "-"
            for s in systems
        ]
        base = times["T3" if workload == "T3s" else workload].get("stdlib")
        ratio = (
            f"{statistics.median(row['sharexec']) / statistics.median(base):.2f}"
            if base and "sharexec" in row
            else "-"
        )
        lines.append(
            f"| {workload}: {WORKLOADS[workload][0]} | " + " | ".join(cells) + f" | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    compile_sharexec()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--start-method", default="spawn")
    parser.add_argument("--workloads", default="T1,T2,T3,T3s")
    parser.add_argument("--torch-road", action="store_true", help="also sharexec/torch")
    parser.add_argument(
        "--json", type=Path, help="write the run here (docs/bench-torch-results.json: publish it)"
    )
    args = parser.parse_args()

    import torch
    import torch_tasks

    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.UTC)
    run_versions = versions()  # first: the work tree may change while the run goes on
    workloads = args.workloads.split(",")
    systems = [s for s in SYSTEMS if s != "sharexec/torch" or args.torch_road]
    log(f"torch {torch.__version__}, sharexec {run_versions['sharexec']}, {args.start_method}")
    load_before = uptime()
    log(f"before: {load_before}")
    results: dict[str, dict[str, list[float]]] = {w: {} for w in workloads}
    cpu_results: dict[str, dict[str, list[float]]] = {w: {} for w in workloads}
    cpu = cpu_meter()
    pools = {system: Pool(system, args.start_method) for system in systems}
    try:
        for pool in pools.values():
            for wait in [pool.submit(torch_tasks.warm, torch.ones(4)) for _ in range(4)]:
                wait()
        # Round robin: each repetition runs every system once, so that a change in the
        # machine's load during the run weighs on all of them alike.
        for rep in range(args.reps):
            for workload in workloads:
                for system, pool in pools.items():
                    if workload == "T3s" and not system.startswith("sharexec"):
                        continue
                    elapsed, spent = measure_once(pool, workload, args.scale, cpu)
                    results[workload].setdefault(system, []).append(elapsed)
                    cpu_results[workload].setdefault(system, []).append(spent)
                    log(
                        f"  [{rep + 1}/{args.reps}] {system:15} {workload}: {elapsed:.3f} s"
                        f" wall, {spent:.3f} s CPU"
                    )
    finally:
        for pool in pools.values():
            pool.close()
    load_after = uptime()
    log(f"after: {load_after}")
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "date": f"{started_at:%Y-%m-%d %H:%M} UTC",
        "cpus": os.cpu_count(),
        "versions": run_versions,
        "load_before": load_before,
        "load_after": load_after,
        "wall_s": time.perf_counter() - started,
        "systems": systems,
        "workloads": workloads,
        "wall": results,
        "cpu": cpu_results,
    }
    print(f"\n{args.reps} repetitions, 2 workers, {args.start_method}, scale {args.scale:g}")
    print(f"before: {load_before}\nafter: {load_after}")
    print("\nWall time: medians in s (min-max)\n")
    print(table(record, "wall"))
    print("CPU time, all processes: medians in s (min-max)\n")
    print(table(record, "cpu"))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        log(f"JSON: {args.json}")


if __name__ == "__main__":
    main()
