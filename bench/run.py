"""The benchmark suite of sharexec against its peers: ``python bench/run.py``.

Runs each workload on each system with a warm pool of 2 workers, times pool start-up
separately, repeats each measurement (``--reps``, default 5) and prints a markdown table of
medians: wall time, its ratio to the stdlib's in the same run, CPU time of the parent and
its descendants, and the peak extra memory (their PSS less shared pages, plus the size of
their /dev/shm files, sampled every few ms in one more repetition, so that sampling never
slows a timed one; see ``measure.py``).
It also measures the machine's floor, writes every figure to ``bench/results/*.json`` and
plots W1's time against the array size (log-log) to ``docs/_static/bench_w1.png``.

Systems: ``stdlib`` (``concurrent.futures.ProcessPoolExecutor``), ``loky``
(``loky.ProcessPoolExecutor``), ``joblib`` (``Parallel(n_jobs=2)``, loky backend, its
auto-memmapping), ``mpire`` (``WorkerPool``, kept alive: ``imap`` with its automatic chunk
size, ``apply_async`` per call), ``shm`` (hand-written ``multiprocessing.shared_memory``
with the stdlib executor) and ``sharexec``. Every system uses the same start method
(``--start-method``, default spawn); W6 repeats start-up and W1 under the other methods
(``--methods``).

Workloads (sizes in MiB, times ``--scale``):

- W1: 8 submits of ``f(a) -> float(a.sum())`` with one 128 MiB float64 array (also at 2, 8
  and 32 MiB, time only, for the plot). W1s (sharexec): the same with ``a =
  sharexec.share(a)`` done once before, at 8, 128 and 1024 MiB; ``f = a[0]`` alone shows
  the dispatch is O(1).
- W2: ``ex.map(chunk_sum, np.array_split(a, 64))`` over a 512 MiB array.
- W3: 8 tasks each returning a fresh 64 MiB array.
- W4: 16 tasks fill a 512 MiB output slice by slice.
- W5: 10,000 tiny tasks (``--tasks``), by ``submit`` and by ``map``.
- W6: start-up and W1 under spawn, fork, forkserver and each system's default.
- small-shm: sharexec's W1 to W4 with the host's /dev/shm and in a private mount namespace
  whose /dev/shm is a 64 MB tmpfs (a default container's; needs root and ``unshare``),
  each a run of this script in a child process, 3 of each, alternating, in one run: per
  workload the ratio of the namespace's time to the host's (target: at most 1.2) and the
  warnings the namespace's runs printed (target: none).

Start-up is timed twice: until every worker has answered (``start-up``, ``ready.py``'s
rendezvous) and until the first call's result (``start-up, first``). Each repetition is a
new pool in the same process: a system's one-time start in a process (sharexec's warm
server, the stdlib's forkserver) is in the first repetition only, logged apart.

Worker functions live in ``tasks.py`` and ``ready.py``; systems in ``systems.py``;
instruments and the floor in ``measure.py``. This module imports only the standard library
at the top, so that a worker importing the main module (spawn) stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from console import commit, compile_sharexec, log, uptime
from small_shm import in_small_shm

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
SYSTEM_ORDER = ["stdlib", "loky", "joblib", "mpire", "shm", "sharexec"]
METHODS = ["spawn", "fork", "forkserver", "default"]  # default: each system's own

# Sizes in MiB at scale 1.
W1_MIB = 128
W1_PLOT_MIB = [2, 8, 32]  # W1 is also timed at these sizes, for the plot
W1S_MIB = [8, 128, 1024]
W2_MIB = 512
W3_MIB = 64  # each of 8 results
W4_MIB = 512
FLOOR_MIB = 256
WARM_MIB = 4  # warm-up size: above sharexec's min_share_bytes (256 KiB)

# Targets for sharexec, as ratios to the stdlib.
DISPATCH_REPS = 21  # W1s with f = a[0], at least
TARGETS = {
    "W1": 0.03,
    "W2": 0.08,
    "W3": 0.10,
    "W4": 0.90,
    "W5 submit": 0.10,  # batching of tiny calls
    "W5 map": 0.10,
    "start-up": 2.0,
    "start-up, first": 2.0,
}
# Targets as ratios to the hand-written shared memory, same run.
SHM_TARGETS = {"W4": 0.5}


@dataclass
class Row:
    """One measurement: a workload on a system under a start method."""

    workload: str  # e.g. "W1", "W1s", "W5 map", "start-up"
    method: str
    system: str
    mib: float | None = None  # the array size, where there is one
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    extra_bytes: int | None = None  # peak extra memory, from the sampled repetition
    held_bytes: int | None = None  # still in use after it, over the same reference
    samples: int = 0  # memory samples taken in that repetition
    note: str = ""
    unsupported: str = ""  # why the system cannot run it
    dispatch: list[float] = field(default_factory=list)  # W1s: times with f = a[0]
    ratio: float | None = None
    target: str = ""

    @property
    def time(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    @property
    def cpu_median(self) -> float | None:
        return statistics.median(self.cpu) if self.cpu else None


class Inputs:
    """The input arrays, made once (a fixed seed) and shared by every system."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._arrays: dict[int, Any] = {}

    def n(self, mib: float) -> int:
        return max(int(mib * self.scale * MiB) // 8, 1024)

    def array(self, mib: float) -> Any:
        import numpy as np

        n = self.n(mib)
        if n not in self._arrays:
            self._arrays[n] = np.random.default_rng(n).random(n)
        return self._arrays[n]

    def drop(self, mib: float) -> None:
        self._arrays.pop(self.n(mib), None)


# ---------------------------------------------------------------------------------------
# Measuring one workload
# ---------------------------------------------------------------------------------------


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[Row] = []

    def measure(
        self,
        row: Row,
        run: Callable[[], Any],
        check: Callable[[Any], None],
        memory: bool,
    ) -> Row:
        """Time ``run`` ``--reps`` times, then sample memory during one more run.

        Memory is counted from a reference taken before the first repetition (the inputs
        already made), so what a system keeps from one repetition to the next counts.
        """
        import measure
        from systems import Unsupported

        self.rows.append(row)
        memory = memory and not self.args.no_memory
        try:
            if memory:
                gc.collect()
                reference = measure.memory_now()
            for _ in range(self.args.reps):
                gc.collect()
                before = measure.cpu_snapshot()
                start = time.perf_counter()
                out = run()
                row.times.append(time.perf_counter() - start)
                row.cpu.append(measure.cpu_delta(before, measure.cpu_snapshot()))
                check(out)
                del out
            if memory:
                gc.collect()
                interval = self.args.interval / 1000
                with measure.MemorySampler(interval, baseline=reference) as sampler:
                    out = run()
                    check(out)
                    del out
                    gc.collect()
                row.extra_bytes, row.samples = sampler.extra, sampler.samples
                row.held_bytes = measure.memory_now() - reference
        except Unsupported as e:
            row.unsupported = str(e)
        label = f"{row.workload}" + (f" {row.mib:g} MiB" if row.mib else "")
        if row.unsupported:
            log(f"  [{row.method}] {row.system:8} {label}: n/a ({row.unsupported})")
        else:
            log(f"  [{row.method}] {row.system:8} {label}: {row.time:.4g} s")
        return row


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(abs(a), abs(b), 1.0)


def expect(value: Any) -> Callable[[Any], None]:
    def check(out: Any) -> None:
        ok = (
            all(close(x, y) for x, y in zip(out, value, strict=True))
            if isinstance(value, list)
            else close(out, value)
        )
        if not ok:
            raise AssertionError(f"wrong result: {out!r:.200} != {value!r:.200}")

    return check


def expect_w3(n: int, count: int) -> Callable[[Any], None]:
    want = [(n, float(i), float(i)) for i in range(count)]

    def check(out: Any) -> None:
        if out != want:
            raise AssertionError(f"wrong W3 result: {out!r:.200}")

    return check


# ---------------------------------------------------------------------------------------
# One system under one start method
# ---------------------------------------------------------------------------------------


def run_system(runner: Runner, inputs: Inputs, name: str, method: str, main_method: bool) -> None:
    import numpy as np
    import systems
    import tasks

    args = runner.args
    cls = systems.SYSTEMS[name]
    startup = Row("start-up", method, name, note=cls.method_note(method))
    runner.rows.append(startup)
    system: systems.System | None = None
    try:
        for rep in range(args.reps):
            candidate = cls(method)
            start = time.perf_counter()
            candidate.start()
            startup.times.append(time.perf_counter() - start)
            if rep < args.reps - 1:
                candidate.shutdown()
            else:
                system = candidate
    except systems.Unsupported as e:
        startup.unsupported = str(e)
        log(f"  [{method}] {name:8} start-up: n/a ({e})")
        w1 = Row("W1", method, name, W1_MIB, unsupported=str(e))
        runner.rows.append(w1)
        return
    log(
        f"  [{method}] {name:8} start-up: {startup.time:.4g} s "
        f"(the first in this process: {startup.times[0]:.4g} s)"
    )
    first = Row("start-up, first", method, name, note=cls.method_note(method))
    runner.rows.append(first)
    for _ in range(args.reps):
        candidate = cls(method)
        start = time.perf_counter()
        candidate.first_result()
        first.times.append(time.perf_counter() - start)
        candidate.shutdown()
    log(f"  [{method}] {name:8} start-up, first result: {first.time:.4g} s")
    assert system is not None
    try:
        want = set(args.workloads)
        # Warm-up: every workload once, small, untimed (imports, first code paths).
        warm = inputs.array(WARM_MIB)
        system.w1(warm, count=2)
        if main_method:
            system.w2(warm, parts=4)
            system.w3(inputs.n(WARM_MIB), count=2)
            system.w4(inputs.n(WARM_MIB), parts=4)
            for w5 in (system.w5_submit, system.w5_map):
                with contextlib.suppress(systems.Unsupported):
                    w5(100)

        def note(workload: str) -> str:
            return cls.notes.get(workload, "")

        if "W1" in want:
            a = inputs.array(W1_MIB)
            w1_note = note("W1") if main_method else cls.method_note(method)
            runner.measure(
                Row("W1", method, name, W1_MIB, note=w1_note),
                lambda: system.w1(a),
                expect([float(a.sum())] * 8),
                memory=main_method,
            )
            if main_method:
                for mib in W1_PLOT_MIB:
                    b = inputs.array(mib)
                    runner.measure(
                        Row("W1", method, name, mib, note=note("W1")),
                        lambda b=b: system.w1(b),
                        expect([float(b.sum())] * 8),
                        memory=False,
                    )
        if not main_method:
            return
        if "W1s" in want and isinstance(system, systems.Sharexec):
            import sharexec

            for mib in W1S_MIB:
                a = inputs.array(mib)
                start = time.perf_counter()
                s = sharexec.share(a)
                shared_in = time.perf_counter() - start
                row = runner.measure(
                    Row("W1s", method, name, mib),
                    lambda s=s: system.w1(s),
                    expect([float(a.sum())] * 8),
                    memory=True,
                )
                for _ in range(max(args.reps, DISPATCH_REPS)):  # about 1 ms each: noisy
                    start = time.perf_counter()
                    system.w1(s, fn=tasks.first)
                    row.dispatch.append(time.perf_counter() - start)
                row.note = (
                    f"share() once: {shared_in:.3g} s, untimed; "
                    f"with f = a[0]: {statistics.median(row.dispatch) * 1e3:.3g} ms"
                )
                del s
                if mib not in (W1_MIB, *W1_PLOT_MIB):
                    inputs.drop(mib)
                gc.collect()
        if "W2" in want:
            a = inputs.array(W2_MIB)
            runner.measure(
                Row("W2", method, name, W2_MIB, note=note("W2")),
                lambda: system.w2(a),
                expect(float(sum(c.sum() for c in np.array_split(a, 64)))),
                memory=True,
            )
        if "W3" in want:
            n = inputs.n(W3_MIB)
            runner.measure(
                Row("W3", method, name, W3_MIB, note=note("W3")),
                lambda: system.w3(n),
                expect_w3(n, 8),
                memory=True,
            )
        if "W4" in want:
            n = inputs.n(W4_MIB)
            runner.measure(
                Row("W4", method, name, W4_MIB, note=note("W4")),
                lambda: system.w4(n),
                expect([float(k + 1) for k in range(16) for _ in (0, 1)]),
                memory=True,
            )
        if "W5" in want:
            count = args.tasks
            total = count * (count + 1) // 2
            runner.measure(
                Row("W5 submit", method, name),
                lambda: system.w5_submit(count),
                expect(total),
                memory=False,
            )
            runner.measure(
                Row("W5 map", method, name),
                lambda: system.w5_map(count),
                expect(total),
                memory=False,
            )
    finally:
        system.shutdown()
        gc.collect()


# ---------------------------------------------------------------------------------------
# Ratios, targets and the table
# ---------------------------------------------------------------------------------------


WORKLOAD_ORDER = [
    "start-up",
    "start-up, first",
    "W1",
    "W1s",
    "W2",
    "W3",
    "W4",
    "W5 submit",
    "W5 map",
]


# The small-/dev/shm part: its workloads, and the target of each ratio to the host's.
SMALL_SHM_WORKLOADS = ["W1", "W2", "W3", "W4"]
SMALL_SHM_TARGET = 1.2
SMALL_SHM_ROUNDS = 3  # runs of each side, alternating (host first, then namespace first…)
# Repetitions of each run, at least: W4's first two allocate its 512 MiB output fresh
# (0.23-0.32 s, the pages faulted in; the second while the first is still held) and its
# third recycles a segment it must zero, on both sides alike, so that the median of 5
# fell on that change (a run's median between 0.026 and 0.084 s on the host).
SMALL_SHM_REPS = 9


def small_shm_reps(args: argparse.Namespace) -> int:
    """The repetitions of each of the small /dev/shm part's runs."""
    return max(args.reps, SMALL_SHM_REPS)


def small_shm(args: argparse.Namespace) -> dict[str, Any]:
    """sharexec's W1 to W4 with the host's /dev/shm and in a 64 MB one: each side a run of
    this script in a child (``--one-side``), its rows read from its results file;
    :data:`SMALL_SHM_ROUNDS` runs of each, alternating, and per workload the median of
    a side's runs (each the median of its ``--reps``, at least :data:`SMALL_SHM_REPS`)."""
    import subprocess
    import tempfile

    sides: dict[str, dict[str, list[float]]] = {"host": {}, "namespace": {}}
    warnings: list[str] = []
    order = [("host", "namespace"), ("namespace", "host")]
    with tempfile.TemporaryDirectory() as tmp:
        for side in [s for r in range(SMALL_SHM_ROUNDS) for s in order[r % 2]]:
            out = Path(tmp, f"{side}.json")
            command = [
                *(sys.executable, __file__),
                *("--one-side", "--systems", "sharexec", "--no-memory"),
                *("--workloads", ",".join(SMALL_SHM_WORKLOADS)),
                *("--reps", str(small_shm_reps(args)), "--scale", str(args.scale)),
                *("--start-method", args.start_method),
                *("--json", str(out)),
            ]
            if side == "namespace":
                command = in_small_shm(command)
            log(f"small /dev/shm: a run of the {side}'s side")
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                raise RuntimeError(f"the {side}'s side failed:\n{done.stderr[-4000:]}")
            if side == "namespace":
                warnings += [line for line in done.stderr.splitlines() if "Warning" in line]
            for r in json.loads(out.read_text())["rows"]:
                wanted = r["workload"] in SMALL_SHM_WORKLOADS and r["time"] is not None
                if wanted and (r["workload"] != "W1" or r["mib"] == W1_MIB):
                    sides[side].setdefault(r["workload"], []).append(r["time"])
    table = []
    for workload in SMALL_SHM_WORKLOADS:
        runs = [sides[side].get(workload) for side in ("host", "namespace")]
        host, namespace = (statistics.median(t) if t else None for t in runs)
        ratio = namespace / host if host and namespace else None
        table.append(
            {
                "workload": workload,
                "host_s": host,
                "namespace_s": namespace,
                "ratio": ratio,
                "host_runs": runs[0],
                "namespace_runs": runs[1],
            }
        )
    return {
        "shm_size": "64m",
        "method": args.start_method,
        "rounds": SMALL_SHM_ROUNDS,
        "reps": small_shm_reps(args),
        "target": SMALL_SHM_TARGET,
        "rows": table,
        "warnings": warnings,
    }


def small_shm_table(part: dict[str, Any]) -> str:
    """The small-/dev/shm part as a Markdown table, with its verdict."""
    lines = [
        "| workload | host's /dev/shm (s) | 64 MB /dev/shm (s) | ratio |",
        "|---|--:|--:|--:|",
    ]
    met = not part["warnings"]
    for r in part["rows"]:
        ratio = r["ratio"]
        met = met and ratio is not None and ratio <= part["target"]
        lines.append(
            f"| {r['workload']} | {fmt(r['host_s'])} | {fmt(r['namespace_s'])} "
            f"| {fmt(ratio, 'x')} |"
        )
    warned = len(part["warnings"])
    lines.append("")
    lines.append(
        f"Target: every workload within {part['target']:g}x of the host's time, no warning "
        f"({warned} printed): {'met' if met else 'missed'}."
    )
    return "\n".join(lines) + "\n"


def judge(rows: list[Row], scale: float) -> None:
    """Fill in each row's ratio to the stdlib and, for sharexec, its target."""
    stdlib = {
        (r.workload, r.method, r.mib): r.time
        for r in rows
        if r.system == "stdlib" and r.time is not None
    }
    for r in rows:
        base = stdlib.get(("W1" if r.workload == "W1s" else r.workload, r.method, r.mib))
        if r.time is not None and base:
            r.ratio = r.time / base
    for r in rows:
        if r.system != "sharexec" or r.time is None:
            continue
        limit = TARGETS.get(r.workload)
        if limit is None or r.ratio is None:
            continue
        if r.workload == "W1" and r.mib != W1_MIB:
            continue
        met = r.ratio <= limit
        text = f"≤ {limit:g}x"
        if r.workload == "W3":
            results = 8 * W3_MIB * scale * MiB
            text += f", mem ≤ {results / MiB:.0f} MiB"
            met = met and r.extra_bytes is not None and r.extra_bytes <= results
        r.target = f"{text}: {'met' if met else 'missed'}"
    shm = {(r.workload, r.method, r.mib): r.time for r in rows if r.system == "shm" and r.time}
    for r in rows:
        limit = SHM_TARGETS.get(r.workload)
        base = shm.get((r.workload, r.method, r.mib))
        if r.system != "sharexec" or r.time is None or limit is None or not base:
            continue
        ratio = r.time / base
        verdict = "met" if ratio <= limit else "missed"
        r.target = ", ".join(
            filter(None, [r.target, f"≤ {limit:g}x shm: {verdict} ({ratio:.2g}x)"])
        )
    w1s = [r for r in rows if r.workload == "W1s" and r.dispatch]
    if len(w1s) > 1:
        d = [statistics.median(r.dispatch) for r in w1s]
        spread = max(d) / min(d)
        verdict = "met" if spread <= 2 else "missed"
        w1s[-1].target = f"f = a[0] flat over sizes (≤ 2x): {verdict} ({spread:.2g}x)"


def fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.3g}{unit}"


def mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else str(round(nbytes / MiB))


def table(rows: list[Row], main_method: str) -> str:
    def key(r: Row) -> tuple[Any, ...]:
        return (
            r.method != main_method,
            METHODS.index(r.method) if r.method in METHODS else 9,
            WORKLOAD_ORDER.index(r.workload),
            r.mib or 0,
            SYSTEM_ORDER.index(r.system),
        )

    lines = [
        "| workload | start | system | time (s) | vs stdlib | CPU (s) | extra mem (MiB) "
        "| held (MiB) | target | notes |",
        "|---|---|---|--:|--:|--:|--:|--:|---|---|",
    ]
    for r in sorted(rows, key=key):
        if r.workload == "W1" and r.mib in W1_PLOT_MIB:
            continue  # in the JSON and the plot
        name = r.workload + (f" {r.mib:g} MiB" if r.mib and "start-up" not in r.workload else "")
        if r.unsupported:
            cells = ["n/a", "", "", "", "", "", r.unsupported]
        else:
            cells = [
                fmt(r.time),
                fmt(r.ratio, "x"),
                fmt(r.cpu_median),
                mib(r.extra_bytes),
                mib(r.held_bytes),
                r.target,
                r.note,
            ]
        lines.append("| " + " | ".join([name, r.method, r.system, *cells]) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, main_method: str, scale: float) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in SYSTEM_ORDER:
        points = sorted(
            (r.mib * scale, r.time)
            for r in rows
            if r.workload == "W1"
            and r.system == system
            and r.method == main_method
            and r.time is not None
            and r.mib
        )
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=system)
    points = sorted(
        (r.mib * scale, r.time) for r in rows if r.workload == "W1s" and r.time and r.mib
    )
    if points:
        ax.plot(
            *zip(*points, strict=True),
            marker="s",
            linestyle="--",
            label="sharexec, pre-shared (W1s)",
        )
    points = sorted(
        (r.mib * scale, statistics.median(r.dispatch))
        for r in rows
        if r.workload == "W1s" and r.dispatch and r.mib
    )
    if points:
        ax.plot(
            *zip(*points, strict=True),
            marker="s",
            linestyle=":",
            label="sharexec, pre-shared, f = a[0]",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_xlabel("array size (MiB)")
    ax.set_ylabel("time for 8 submits of a.sum() (s)")
    ax.set_title(f"W1: one big argument, 2 workers, {main_method}, median")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for module in ("numpy", "loky", "joblib", "psutil", "sharexec"):
        try:
            out[module] = __import__(module).__version__
        except Exception as e:  # pragma: no cover - reported, not fatal
            out[module] = f"unavailable: {e}"
    out["sharexec_commit"] = commit(ROOT)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every array size")
    p.add_argument("--tasks", type=int, default=10_000, help="W5's task count")
    p.add_argument("--start-method", default="spawn", choices=METHODS)
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="start methods of W6 (start-up and W1), comma-separated",
    )
    p.add_argument("--systems", default=",".join(SYSTEM_ORDER), help="comma-separated")
    p.add_argument(
        "--workloads",
        default="W1,W1s,W2,W3,W4,W5,W6,floor",
        help="comma-separated among W1,W1s,W2,W3,W4,W5,W6,floor,small-shm",
    )
    # One side of the small-/dev/shm part (a child of the run): no ratios to the stdlib.
    p.add_argument("--one-side", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, default=5.0, help="memory sampling period, ms")
    p.add_argument("--no-memory", action="store_true", help="skip the memory repetition")
    p.add_argument("--json", type=Path, help="default: bench/results/<date>.json")
    p.add_argument(
        "--plot",
        type=Path,
        default=ROOT / "docs" / "_static" / "bench_w1.png",
        help="the W1 plot (default docs/_static/bench_w1.png)",
    )
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.methods = [m for m in args.methods.split(",") if m]
    for s in args.systems:
        if s not in SYSTEM_ORDER:
            p.error(f"unknown system {s!r}")
    if "stdlib" not in args.systems and not args.one_side:
        p.error("ratios need the stdlib: keep it in --systems")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    compile_sharexec()
    import measure

    started = time.perf_counter()
    # When and what ran, taken first: the work tree may change while the run goes on.
    started_at = datetime.datetime.now(datetime.UTC)
    run_versions = versions()
    load_before = uptime()
    shm_before = set(os.listdir(measure.SHM))
    log(f"load before: {load_before}")
    runner = Runner(args)
    inputs = Inputs(args.scale)
    floor: dict[str, float] = {}
    if "floor" in args.workloads:  # first: the pipe writer is a plain fork
        nbytes = max(int(FLOOR_MIB * args.scale * MiB) // 8 * 8, MiB)
        floor = {
            "memcpy into touched memory (GB/s)": measure.memcpy_touched(nbytes, args.reps),
            "copy into fresh /dev/shm pages (GB/s)": measure.copy_fresh_shm(nbytes, args.reps),
            "pipe, writer process to parent (GB/s)": measure.pipe_throughput(nbytes, args.reps),
            f"one a.sum() of {W1_MIB * args.scale:g} MiB in the parent (s)": (
                measure.compute_sum(inputs.n(W1_MIB) * 8, args.reps)
            ),
        }
        for k, v in floor.items():
            log(f"  floor: {k}: {v:.3g}")
    # Only the floor, or the small-/dev/shm part (runs of its own): no system here.
    methods = [args.start_method] if set(args.workloads) - {"floor", "small-shm"} else []
    if "W6" in args.workloads:
        methods += [m for m in args.methods if m != args.start_method]
    for method in methods:
        if method == "forkserver":
            from multiprocessing import forkserver

            forkserver.ensure_running()  # its one-time start is no system's start-up
        for name in args.systems:
            run_system(runner, inputs, name, method, main_method=method == args.start_method)
    judge(runner.rows, args.scale)
    small = small_shm(args) if "small-shm" in args.workloads else None
    wall = time.perf_counter() - started
    load_after = uptime()
    leaked = sorted(set(os.listdir(measure.SHM)) - shm_before)

    print(f"\n## sharexec benchmark: {datetime.datetime.now():%Y-%m-%d %H:%M}\n")
    print(
        f"2 workers, start method {args.start_method}, {args.reps} repetitions (medians), "
        f"scale {args.scale:g}; {os.cpu_count()} CPUs; Python {platform.python_version()}.\n"
    )
    if runner.rows:
        print(table(runner.rows, args.start_method))
        print(
            "\nCPU: parent and descendants, user + system. Extra memory: the peak of the "
            "PSS (less shared pages) of the parent and its descendants, plus the allocated "
            "size of their /dev/shm files (mapped, or theirs by name), sampled every "
            f"{args.interval:g} ms in one more repetition, over a reference taken before the "
            "workload's first repetition (inputs already made): what a system keeps between "
            "repetitions counts. Held: the same, after that repetition (gc run). joblib is "
            "run with loky's start method where spawn is asked for.\n"
        )
    if floor:
        print("| floor | |\n|---|--:|")
        for k, v in floor.items():
            print(f"| {k} | {v:.3g} |")
        print()
    if small is not None:
        print("## sharexec in a 64 MB /dev/shm (a default container) against the host's\n")
        print(small_shm_table(small))
        for line in small["warnings"]:
            print(f"warning: {line}")
        print()
    print(f"load before: {load_before}")
    print(f"load after:  {load_after}")
    print(f"wall time: {wall:.0f} s")
    joblib_dirs = [n for n in leaked if n.startswith("joblib_memmapping_folder_")]
    if joblib_dirs:
        size = sum(p.stat().st_size for n in joblib_dirs for p in Path(measure.SHM, n).rglob("*"))
        print(
            f"/dev/shm: {len(joblib_dirs)} joblib temp folders ({size / MiB:.0f} MiB) are "
            "still there; joblib removes them at exit"
        )
    others = [n for n in leaked if n not in joblib_dirs]
    if others:
        shown = ", ".join(others[:10]) + (", ..." if len(others) > 10 else "")
        print(f"/dev/shm: new since the start (machine-wide): {shown}")

    results = ROOT / "bench" / "results"
    out = args.json or results / f"{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "date": f"{started_at:%Y-%m-%d %H:%M} UTC",
        "cpus": os.cpu_count(),
        "versions": run_versions,
        "load_before": load_before,
        "load_after": load_after,
        "wall_s": wall,
        "floor": floor,
        "small_shm": small,
        "leaked_shm": leaked,
        "rows": [asdict(r) | {"time": r.time, "cpu_median": r.cpu_median} for r in runner.rows],
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    if any(r.workload == "W1" and r.time for r in runner.rows) and not args.one_side:
        plot(runner.rows, args.plot, args.start_method, args.scale)
        shown = args.plot.relative_to(ROOT) if args.plot.is_relative_to(ROOT) else args.plot
        print(f"plot: {shown}")


if __name__ == "__main__":
    main()
