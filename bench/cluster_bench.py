"""The cluster executor beside plain and expert Dask, on one LocalCluster.

One ``LocalCluster(processes=True, n_workers=2, threads_per_worker=1)`` for the whole run;
the three systems take turns within each repetition:

* ``get_executor``: ``client.get_executor()``'s ``submit``, as a user of
  ``concurrent.futures`` would write it;
* ``expert Dask``: ``client.scatter`` once, ``client.submit(..., pure=False)``, gather;
* ``sharexec``: ``sharexec.ClusterExecutor(client)``, ``submit`` as with any executor.

Workloads: W1, 8 calls of ``total`` on one 200 MB array; fill, one 200 MB array filled in
16 slices (sharexec: a ``sharexec.zeros`` array the tasks write into; Dask: each task
returns its slice, which the client copies into a NumPy array). Time is the wall time of
the calls, the median of ``--reps`` repetitions; memory the peak extra of client,
scheduler (in the client process) and workers together, from ``bench/measure.py``
(private PSS plus /dev/shm files, each counted once), in one more repetition: sampling
reads every process's page tables every few ms, which would slow the timed ones (as in
``run.py``), and not evenly (4 KiB pages of shared memory cost more to read than the
huge pages of a heap).

Then point 5: the memory of one 200 MB array held by both workers at once, sent with
Dask's own scatter (``replicate``) and with sharexec's executor (a task on each worker,
both over the array): /dev/shm files and each worker's resident and private memory, and
what Dask's accounting (``managed`` memory) says.

Run inside a private /dev/shm: ``PTEST_CMD="python bench/cluster_bench.py" /work/bin/ptest``
(``--scale 0.25``: quarter-size arrays; ``--json PATH``: the figures, for the docs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tasks

import sharexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "cluster-bench.json")
PAGE = os.path.join(ROOT, "docs", "scaling-out.md")
BEGIN, END = "<!-- cluster-bench: begin -->\n", "<!-- cluster-bench: end -->"

MB = 1_000_000
MiB = 1 << 20


# ---------------------------------------------------------------------------------------
# The systems
# ---------------------------------------------------------------------------------------


def w1_get_executor(client: Any, a: np.ndarray, count: int) -> list[float]:
    ex = client.get_executor()
    return [f.result() for f in [ex.submit(tasks.total, a) for _ in range(count)]]


def w1_expert(client: Any, a: np.ndarray, count: int) -> list[float]:
    ref = client.scatter(a)
    futures = [client.submit(tasks.total, ref, pure=False) for _ in range(count)]
    out = client.gather(futures)
    del futures, ref
    return list(out)


def w1_sharexec(client: Any, a: np.ndarray, count: int) -> list[float]:
    with sharexec.ClusterExecutor(client) as ex:
        return [f.result() for f in [ex.submit(tasks.total, a) for _ in range(count)]]


def bounds(n: int, parts: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, parts + 1).astype(int)
    return list(zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True))


def fill_get_executor(client: Any, n: int, parts: int) -> np.ndarray:
    ex = client.get_executor()
    out = np.empty(n)
    futures = [
        (lo, hi, ex.submit(tasks.fresh, hi - lo, float(i)))
        for i, (lo, hi) in enumerate(bounds(n, parts))
    ]
    for lo, hi, f in futures:
        out[lo:hi] = f.result()
    return out


def fill_expert(client: Any, n: int, parts: int) -> np.ndarray:
    out = np.empty(n)
    futures = [
        (lo, hi, client.submit(tasks.fresh, hi - lo, float(i), pure=False))
        for i, (lo, hi) in enumerate(bounds(n, parts))
    ]
    for lo, hi, f in futures:
        out[lo:hi] = f.result()
    return out


def fill_sharexec(client: Any, n: int, parts: int) -> np.ndarray:
    out = sharexec.zeros(n)
    with sharexec.ClusterExecutor(client) as ex:
        futures = [
            ex.submit(tasks.fill, out[lo:hi], float(i))
            for i, (lo, hi) in enumerate(bounds(n, parts))
        ]
        for f in futures:
            f.result()
    return out


SYSTEMS = ["get_executor", "expert Dask", "sharexec"]
W1 = dict(zip(SYSTEMS, [w1_get_executor, w1_expert, w1_sharexec], strict=True))
FILL = dict(zip(SYSTEMS, [fill_get_executor, fill_expert, fill_sharexec], strict=True))


def timed(run: Callable[[], Any], check: Callable[[Any], bool]) -> float:
    gc.collect()
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    assert check(result), "wrong result"
    return elapsed


def sampled(run: Callable[[], Any], check: Callable[[Any], bool]) -> int:
    """The peak extra memory of one run."""
    from measure import MemorySampler

    gc.collect()
    with MemorySampler() as memory:
        result = run()
    assert check(result), "wrong result"
    del result
    return memory.extra


# ---------------------------------------------------------------------------------------
# Point 5: one copy per host
# ---------------------------------------------------------------------------------------


def _worker_memory(dask_worker: Any = None) -> dict[str, int]:
    import psutil

    info = psutil.Process().memory_full_info()
    return {"rss": info.rss, "uss": info.uss, "managed": dask_worker.state.nbytes}


def _shm_bytes() -> int:
    total = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith("sharexec-"):
            total += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
    return total


def point5(client: Any, a: np.ndarray) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    before = client.run(_worker_memory)
    ref = client.scatter(a)
    client.replicate([ref], n=2)
    after = client.run(_worker_memory)
    figures["Dask scatter"] = _held(before, after, 0)
    del ref
    time.sleep(1.0)  # let the workers drop it before the next measure
    before = client.run(_worker_memory)
    shm0 = _shm_bytes()
    import distributed

    started = distributed.Queue(f"started-{os.urandom(4).hex()}", client=client)
    gate = distributed.Event(f"gate-{os.urandom(4).hex()}", client=client)
    with sharexec.ClusterExecutor(client) as ex:
        futures = [ex.submit(_hold, a, started.name, gate.name) for _ in range(2)]
        pids = {started.get(timeout=60) for _ in futures}
        assert len(pids) == 2, "both workers hold the array"
        after = client.run(_worker_memory)
        figures["sharexec"] = _held(before, after, _shm_bytes() - shm0)
        gate.set()
        assert [f.result() for f in futures] == [a.sum()] * 2
    return figures


def _hold(a: np.ndarray, started: str, gate: str) -> float:
    """A task that reads all of ``a``, then holds it until the gate opens."""
    import distributed

    total = float(a.sum())
    distributed.Queue(started).put(os.getpid())
    assert distributed.Event(gate).wait(timeout=60)
    return total


def _held(before: dict[str, Any], after: dict[str, Any], shm: int) -> dict[str, Any]:
    deltas = {
        what: [(after[w][what] - before[w][what]) / MB for w in sorted(after)]
        for what in ("rss", "uss", "managed")
    }
    return {**deltas, "shm": shm / MB}


# ---------------------------------------------------------------------------------------


def render(run: dict[str, Any]) -> str:
    """The docs' block of figures, from a run's results (``--json``)."""
    lines = [
        f"Load average at the start and end of the run: {run['load'][0]} and "
        f"{run['load'][1]}; arrays of {run['n'] * 8 / 1e6:.0f} MB; times are medians of "
        f"{run['reps']} repetitions, memory from one more, sampled.",
        "",
        "| workload | system | time (s) | peak extra memory (MB) |",
        "|---|---|---|---|",
    ]
    for row in run["rows"]:
        lines.append(
            f"| {row['workload']} | {row['system']} | {row['time_s']:.2f} | "
            f"{row['memory_mb']:.0f} |"
        )
    lines += [
        "",
        f"One {run['n'] * 8 / 1e6:.0f} MB array held by both workers of the host at once "
        "(Dask: scattered, then `client.replicate`; sharexec: a task on each worker, both "
        "reading it), the change in each worker's memory and in sharexec's `/dev/shm` "
        "files (MB):",
        "",
        "| sent with | resident, per worker | private, per worker | Dask's managed, per "
        "worker | /dev/shm |",
        "|---|---|---|---|---|",
    ]
    for system, f in run["point5"].items():
        cells = [", ".join(f"{v:.0f}" for v in f[what]) for what in ("rss", "uss", "managed")]
        lines.append(f"| {system} | {' | '.join(cells)} | {f['shm']:.0f} |")
    return "\n".join(lines) + "\n"


def rendered_page(run: dict[str, Any]) -> str:
    """docs/scaling-out.md with its block of figures rendered from ``run``."""
    with open(PAGE, encoding="utf-8") as f:
        text = f.read()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return head + BEGIN + render(run) + END + tail


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as uptime shows them."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def load() -> dict[str, Any]:
    with open(RESULTS, encoding="utf-8") as f:
        run: dict[str, Any] = json.load(f)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument(
        "--render", action="store_true", help=f"rewrite the figures of the docs from {RESULTS}"
    )
    opts = parser.parse_args()
    if opts.render:
        page = rendered_page(load())
        with open(PAGE, "w", encoding="utf-8") as f:
            f.write(page)
        return
    import distributed

    load_at_start = load_average()
    n = int(25_000_000 * opts.scale)  # 200 MB of float64
    cluster = distributed.LocalCluster(
        processes=True, n_workers=2, threads_per_worker=1, dashboard_address=":0"
    )
    client = distributed.Client(cluster)
    client.wait_for_workers(2)
    a = np.random.default_rng(0).random(n)
    expected = a.sum()
    times: dict[str, dict[str, list[float]]] = {
        w: {s: [] for s in SYSTEMS} for w in ("W1", "fill")
    }
    peaks: dict[str, dict[str, list[int]]] = {w: {s: [] for s in SYSTEMS} for w in ("W1", "fill")}
    print(
        f"load average: {load_at_start}, n = {n:,} float64 "
        f"({n * 8 / MB:.0f} MB), {opts.reps} repetitions",
        flush=True,
    )
    runs = {
        "W1": {
            s: (partial_w1(W1[s], client, a), lambda r: np.allclose(r, expected)) for s in SYSTEMS
        },
        "fill": {
            s: (partial(FILL[s], client, n, 16), lambda r: r[-1] == 15.0 and r[0] == 0.0)
            for s in SYSTEMS
        },
    }
    for rep in range(opts.reps + 1):  # the last one sampled, for memory
        for system in SYSTEMS:
            for workload, by_system in runs.items():
                if rep < opts.reps:
                    times[workload][system].append(timed(*by_system[system]))
                else:
                    peaks[workload][system].append(sampled(*by_system[system]))
            if rep < opts.reps:
                print(
                    f"rep {rep} {system}: W1 {times['W1'][system][-1]:.2f} s, "
                    f"fill {times['fill'][system][-1]:.2f} s",
                    flush=True,
                )
    rows = []
    print("\n| workload | system | time (s) | peak extra memory (MB) |\n|---|---|---|---|")
    for workload in ("W1", "fill"):
        for system in SYSTEMS:
            t = statistics.median(times[workload][system])
            m = peaks[workload][system][0] / MB
            rows.append({"workload": workload, "system": system, "time_s": t, "memory_mb": m})
            print(f"| {workload} | {system} | {t:.2f} | {m:.0f} |")
    held = point5(client, a)
    print(f"\npoint 5, one {a.nbytes / MB:.0f} MB array held by both workers (MB per worker):")
    for system, f in held.items():
        print(
            f"  {system}: rss {f['rss']}, uss {f['uss']}, Dask managed {f['managed']}, "
            f"sharexec /dev/shm {f['shm']:.0f}"
        )
    load_at_end = load_average()
    print(f"load average: {load_at_end}")
    if opts.json:
        with open(opts.json, "w") as f:
            run = {
                "rows": rows,
                "point5": held,
                "n": n,
                "reps": opts.reps,
                "load": [load_at_start, load_at_end],
                "command": " ".join(sys.argv),
            }
            json.dump(run, f, indent=1)
    client.close()
    cluster.close()


def partial_w1(fn: Callable[..., Any], client: Any, a: np.ndarray) -> Callable[[], Any]:
    return lambda: fn(client, a, 8)


if __name__ == "__main__":
    main()
