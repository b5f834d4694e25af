"""Real programs: sharexec against the executor it replaces, ``python bench/real_programs.py``.

The main suite (``run.py``) times workloads on warm pools. Here each measurement is a
whole program, run the way a user runs a script: a fresh Python process, its libraries
imported at the top, its functions in ``__main__``, one pool made with ``Executor(2)``.
The programs live in ``bench/real/`` (one script each; ``harness.py`` says how they are
run) and each returns a small result, which must be the same whatever the executor (the
run stops if one differs).

Each program runs with:

- ``stdlib``: ``concurrent.futures.ProcessPoolExecutor(2)`` with its defaults (fork on
  Python 3.11 to 3.13);
- ``sharexec``: ``sharexec.SharedProcessPoolExecutor(2)`` with its defaults;
- ``stdlib-forkserver`` (``--same-method``; or ``stdlib-spawn``): the standard library
  under a start method that, like sharexec's, does not fork the parent: the ratio
  against it tells how much of the gap to the default comes from what a forked worker
  inherits (the parent's imports, its compiled code);
- ``sharexec-fork`` (``--sharexec-fork``, on by default): sharexec under fork, like the
  stdlib's default: the ratio of the two forks is what sharexec itself adds to a program
  (its import, its helper processes, its pool's start and shutdown, the calls' trip),
  the start method set aside.

The time of a run is the wall time of its whole process, from its launch to its exit, as
a user waits for it (the interpreter's start, the script's imports, the first pool and
its shutdown included); the JSON also keeps the time of ``main`` alone. Each program is
run once untimed first (with sharexec: it imports everything the others do; files in the
page cache, ``.pyc`` files written), then ``--reps`` times per system, the systems
alternating within each repetition (their order rotated from one repetition to the
next), so that a change of the machine's load falls on all of them. A program whose
packages are missing is skipped, saying which.

A last part times a pool's start-up as a script pays it (``bench/real/first_pool.py``):
from ``Executor(2)`` to two distinct workers each having run a task, NumPy and sharexec
already imported, in a fresh process per repetition; the first pool of the process and
the 2nd to 5th, for sharexec and the standard library's fork, forkserver and spawn.

Prints a markdown table; writes every figure to ``--json`` (default
``bench/results/real-<date>-<time>.json``). Imports only the standard library.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from console import commit, compile_sharexec, log, uptime

ROOT = Path(__file__).resolve().parent.parent
PROGRAM_DIR = ROOT / "bench" / "real"


@dataclass(frozen=True)
class Program:
    script: str  # in bench/real/
    kind: str  # what it does, for the table
    travels: str  # what each call carries
    requires: tuple[str, ...] = ()  # modules it imports beyond NumPy


PROGRAMS = {
    "images": Program(
        "images.py",
        "scikit-image segments 48 PNG files",
        "a file name",
        ("skimage",),
    ),
    "bootstrap": Program(
        "bootstrap.py",
        "scipy.stats.bootstrap, 96 samples",
        "two arrays of 80-300 values",
        ("scipy",),
    ),
    "jit": Program(
        "jit_kernel.py",
        "a numba kernel defined in the script, 32 bands",
        "five numbers",
        ("numba",),
    ),
    "ode": Program(
        "ode_sweep.py",
        "solve_ivp over 144 parameter sets",
        "two numbers",
        ("scipy",),
    ),
    "genetic": Program(
        "genetic.py",
        "a genetic algorithm, fitness reads 800 KiB of globals",
        "a tour of 320 ints",
    ),
    "compress": Program(
        "compress.py",
        "zlib, bz2 and lzma over 12 chunks",
        "1 MiB of bytes",
    ),
    "callbacks": Program(
        "callbacks.py",
        "4 threads submit 400 jobs, add_done_callback",
        "an int",
    ),
    "big-arguments": Program(
        "big_arguments.py",
        "statistics of 16 frames",
        "a 32 MiB array",
    ),
    "big-results": Program(
        "big_results.py",
        "12 blocks of Monte Carlo paths",
        "returns a 31 MiB array",
    ),
}

# The pools of a first-pool run: the 1st is the first of its process, the others later.
FIRST_POOL_SYSTEMS = ["sharexec", "stdlib-fork", "stdlib-forkserver", "stdlib-spawn"]
# The goals of the programs and the pools, as ratios (see Judging below).
SLOWEST_RATIO = 1.10  # no program slower than the stdlib's default by more than 10%
GEOMEAN_RATIO = 0.90
LATER_POOLS_RATIO = 1.5  # later pools against the stdlib's fork


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("numpy", "scipy", "scikit-image", "numba", "loky", "cloudpickle", "sharexec"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["sharexec_commit"] = commit(ROOT)
    return out


# ---------------------------------------------------------------------------------------
# Running a script in a fresh process
# ---------------------------------------------------------------------------------------


class RunFailed(RuntimeError):
    """A program's process failed or printed no result."""


def run_script(script: str, *args: str, timeout: float) -> tuple[float, Any]:
    """Run ``bench/real/<script> *args`` in a fresh Python; its wall time and the JSON
    of the last line it printed."""
    command = [sys.executable, str(PROGRAM_DIR / script), *args]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RunFailed(
            f"{' '.join(command[1:])} exited with {done.returncode}:\n{done.stderr[-3000:]}"
        )
    return wall, json.loads(lines[-1])


def same(a: Any, b: Any) -> bool:
    """Whether two results agree: equal, floats to 1e-9 relative."""
    if isinstance(a, float) or isinstance(b, float):
        return (
            isinstance(a, int | float)
            and isinstance(b, int | float)
            and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def rotated(items: list[str], k: int) -> list[str]:
    k %= len(items)
    return items[k:] + items[:k]


def run_program(name: str, systems: list[str], args: argparse.Namespace) -> dict[str, Any]:
    program = PROGRAMS[name]
    entry: dict[str, Any] = {
        "program": name,
        "kind": program.kind,
        "travels": program.travels,
        "skipped": "",
        "result": None,
        "wall": {s: [] for s in systems},
        "main": {s: [] for s in systems},
    }
    missing = [m for m in program.requires if importlib.util.find_spec(m) is None]
    if missing:
        entry["skipped"] = f"needs {', '.join(missing)}: pip install sharexec[bench]"
        log(f"{name}: skipped ({entry['skipped']})")
        return entry
    options = ["--scale", f"{args.scale:g}"]
    # Untimed: files into the page cache, .pyc files written; its result is the reference.
    _, first = run_script(program.script, "--executor", "sharexec", *options, timeout=args.timeout)
    entry["result"] = first["result"]
    for rep in range(args.reps):
        for system in rotated(systems, rep):
            wall, out = run_script(
                program.script, "--executor", system, *options, timeout=args.timeout
            )
            if not same(out["result"], entry["result"]):
                raise AssertionError(
                    f"{name}: {system} returned {out['result']!r}, sharexec "
                    f"{entry['result']!r}: the executors must agree"
                )
            entry["wall"][system].append(wall)
            entry["main"][system].append(out["main_s"])
            log(f"  {name} [{rep + 1}/{args.reps}] {system:18} {wall:7.3f} s")
    return entry


def run_first_pools(args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """For each system, the pool times of each repetition (a fresh process each)."""
    options = ["--pools", str(args.pools)]
    for system in FIRST_POOL_SYSTEMS:  # untimed: .pyc files present, pages cached
        run_script("first_pool.py", "--executor", system, "--pools", "1", timeout=args.timeout)
    pools: dict[str, list[list[float]]] = {s: [] for s in FIRST_POOL_SYSTEMS}
    for rep in range(args.pool_reps):
        for system in rotated(FIRST_POOL_SYSTEMS, rep):
            _, times = run_script(
                "first_pool.py", "--executor", system, *options, timeout=args.timeout
            )
            pools[system].append(times)
            log(
                f"  pools [{rep + 1}/{args.pool_reps}] {system:18} first "
                f"{times[0] * 1e3:6.0f} ms, later " + " ".join(f"{t * 1e3:.0f}" for t in times[1:])
            )
    return pools


# ---------------------------------------------------------------------------------------
# Judging and the tables (from the JSON record alone: bench/render.py reuses them)
# ---------------------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired(ours: list[float], theirs: list[float]) -> float | None:
    """The median of the ratios of the runs of one repetition (close in time, so that a
    change of the machine's load falls on both)."""
    pairs = [a / b for a, b in zip(ours, theirs, strict=False) if b]
    return statistics.median(pairs) if pairs else None


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """Per program: the medians and ratios; over them: the geometric means and verdicts."""
    same_method = record["args"]["same_method"]
    rows = []
    for entry in record["programs"]:
        walls = {s: median(t) for s, t in entry["wall"].items()}
        mains = {s: median(t) for s, t in entry["main"].items()}
        rows.append(
            {
                "entry": entry,
                "wall": walls,
                "main": mains,
                "ratio": ratio(walls.get("sharexec"), walls.get("stdlib")),
                "paired": paired(
                    entry["wall"].get("sharexec", []), entry["wall"].get("stdlib", [])
                ),
                "main_ratio": ratio(mains.get("sharexec"), mains.get("stdlib")),
                "same_ratio": ratio(walls.get("sharexec"), walls.get(same_method))
                if same_method
                else None,
                "fork_ratio": ratio(walls.get("sharexec-fork"), walls.get("stdlib")),
            }
        )
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    same = [r["same_ratio"] for r in rows if r["same_ratio"] is not None]
    mains = [r["main_ratio"] for r in rows if r["main_ratio"] is not None]
    pairs = [r["paired"] for r in rows if r["paired"] is not None]
    forks = [r["fork_ratio"] for r in rows if r["fork_ratio"] is not None]
    return {
        "rows": rows,
        "geomean": geomean(ratios),
        "geomean_paired": geomean(pairs),
        "geomean_same": geomean(same),
        "geomean_main": geomean(mains),
        "geomean_fork": geomean(forks),
        "slowest": max(ratios) if ratios else None,
    }


def pool_medians(record: dict[str, Any]) -> dict[str, tuple[float, float | None]]:
    """Per system: the median first pool and the median of the later pools, seconds."""
    out = {}
    for system, reps in record.get("pools", {}).items():
        if reps:
            later = [t for times in reps for t in times[1:]]
            out[system] = (statistics.median(t[0] for t in reps), median(later))
    return out


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def fmt(x: float | None, digits: str = ".3g", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{digits}}{suffix}"


def verdict(ok: bool) -> str:
    return "met" if ok else "missed"


def programs_table(record: dict[str, Any]) -> str:
    same_method = record["args"]["same_method"]
    default = record["stdlib_default_method"]
    forks = record["args"].get("sharexec_fork", False)
    s = summary(record)
    head = [
        "program",
        "what it does",
        "each call carries",
        f"stdlib, {default} (s)",
        "sharexec (s)",
        "sharexec / stdlib",
        "paired",
        "the same, in main()",
    ]
    if same_method:
        method = same_method.removeprefix("stdlib-")
        head += [f"stdlib, {method} (s)", f"sharexec / stdlib {method}"]
    if forks:
        head += ["sharexec, fork (s)", f"sharexec fork / stdlib {default}"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "--:|" * (len(head) - 3)]
    for row in s["rows"]:
        entry = row["entry"]
        cells = [entry["program"], entry["kind"], entry["travels"]]
        if entry["skipped"]:
            cells += ["skipped: " + entry["skipped"]] + [""] * (len(head) - 4)
        else:
            cells += [
                fmt(row["wall"].get("stdlib")),
                fmt(row["wall"].get("sharexec")),
                fmt(row["ratio"], ".2f", "x"),
                fmt(row["paired"], ".2f", "x"),
                fmt(row["main_ratio"], ".2f", "x"),
            ]
            if same_method:
                cells += [fmt(row["wall"].get(same_method)), fmt(row["same_ratio"], ".2f", "x")]
            if forks:
                cells += [
                    fmt(row["wall"].get("sharexec-fork")),
                    fmt(row["fork_ratio"], ".2f", "x"),
                ]
        lines.append("| " + " | ".join(cells) + " |")
    last = ["**geometric mean**", "", "", "", "", fmt(s["geomean"], ".2f", "x")]
    last += [fmt(s["geomean_paired"], ".2f", "x")]
    last += [fmt(s["geomean_main"], ".2f", "x")]
    if same_method:
        last += ["", fmt(s["geomean_same"], ".2f", "x")]
    if forks:
        last += ["", fmt(s["geomean_fork"], ".2f", "x")]
    lines.append("| " + " | ".join(last) + " |")
    return "\n".join(lines) + "\n"


def programs_verdict(record: dict[str, Any]) -> str:
    s = summary(record)
    if s["geomean"] is None:
        return "No program ran.\n"
    slow = [
        f"{r['entry']['program']} {r['ratio']:.2f}x"
        for r in s["rows"]
        if r["ratio"] is not None and r["ratio"] > SLOWEST_RATIO
    ]
    return (
        f"Goal: no program slower than the standard library's default by more than "
        f"{(SLOWEST_RATIO - 1) * 100:.0f}% ({verdict(not slow)}"
        + (f": {', '.join(slow)}" if slow else "")
        + f"), and a geometric mean at or below {GEOMEAN_RATIO:g}x "
        f"({verdict(s['geomean'] <= GEOMEAN_RATIO)}: {s['geomean']:.2f}x).\n"
    )


def pools_table(record: dict[str, Any]) -> str:
    medians = pool_medians(record)
    if not medians:
        return "(not measured in this run)\n"
    names = [s for s in FIRST_POOL_SYSTEMS if s in medians]
    head = ["pool", *(f"{s} (ms)" for s in names), "sharexec / fork", "sharexec / forkserver"]
    head.append("goal")
    lines = ["| " + " | ".join(head) + " |", "|---|" + "--:|" * (len(head) - 2) + "---|"]
    pools = record["args"]["pools"]
    for k, label in (
        (0, "first pool of a process"),
        (1, f"later pools (the {pools - 1} after it)"),
    ):
        values = {s: medians[s][k] for s in names}
        ours, fork = values.get("sharexec"), values.get("stdlib-fork")
        forkserver = values.get("stdlib-forkserver")
        if k == 0:
            goal = (
                f"≤ stdlib forkserver: {verdict(ours <= forkserver)}"
                if ours is not None and forkserver is not None
                else ""
            )
        else:
            bound = ratio(ours, fork)
            goal = (
                f"≤ {LATER_POOLS_RATIO:g}x stdlib fork: {verdict(bound <= LATER_POOLS_RATIO)}"
                if bound is not None
                else ""
            )
        cells = [label, *(fmt(None if v is None else v * 1e3, ".0f") for v in values.values())]
        cells += [fmt(ratio(ours, fork), ".2f", "x"), fmt(ratio(ours, forkserver), ".2f", "x")]
        lines.append("| " + " | ".join([*cells, goal]) + " |")
    return "\n".join(lines) + "\n"


def run_line(record: dict[str, Any]) -> str:
    v = record["versions"]
    a = record["args"]
    return (
        f"{record['date']}: {record['cpus']} CPUs, Python {v['python']}, NumPy {v['numpy']}, "
        f"SciPy {v['scipy']}, scikit-image {v['scikit-image']}, numba {v['numba']}, loky "
        f"{v['loky']}, sharexec at commit `{v.get('sharexec_commit', v['sharexec'])}`; "
        f"2 workers, {plural(a['reps'], 'repetition')} of each program and "
        f"{a['pool_reps']} of the pools (medians), scale {a['scale']:g}; load before: "
        f"{record['load_before']}; after: {record['load_after']}; {record['wall_s']:.0f} s.\n"
    )


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="repetitions of each program (3)")
    p.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies each program's work")
    p.add_argument(
        "--same-method",
        default="forkserver",
        choices=["forkserver", "spawn", "none"],
        help="the stdlib's start method of the second column (default forkserver)",
    )
    p.add_argument(
        "--sharexec-fork",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run sharexec under fork, the stdlib's default (on)",
    )
    p.add_argument("--pool-reps", type=int, default=5, help="repetitions of the pools (5)")
    p.add_argument("--pools", type=int, default=5, help="pools per process (5)")
    p.add_argument("--no-pools", action="store_true", help="skip the first-pool part")
    p.add_argument("--timeout", type=float, default=600.0, help="per process, seconds")
    p.add_argument("--json", type=Path, help="default: bench/results/real-<date>.json")
    args = p.parse_args(argv)
    args.programs = [n for n in args.programs.split(",") if n]
    for name in args.programs:
        if name not in PROGRAMS:
            p.error(f"unknown program {name!r}: one of {', '.join(PROGRAMS)}")
    if args.pools < 2:
        p.error("--pools: at least 2 (the first pool and a later one)")
    args.same_method = None if args.same_method == "none" else f"stdlib-{args.same_method}"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    compile_sharexec()
    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.UTC)
    record: dict[str, Any] = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "date": f"{started_at:%Y-%m-%d %H:%M} UTC",
        "cpus": os.cpu_count(),
        "versions": versions(),
        "stdlib_default_method": multiprocessing.get_start_method(),
        "load_before": uptime(),
    }
    log(f"load before: {record['load_before']}")
    systems = ["stdlib", "sharexec"] + ([args.same_method] if args.same_method else [])
    systems += ["sharexec-fork"] if args.sharexec_fork else []
    record["programs"] = [run_program(name, systems, args) for name in args.programs]
    if not args.no_pools:
        record["pools"] = run_first_pools(args)
    record["load_after"] = uptime()
    record["wall_s"] = time.perf_counter() - started

    print(f"\n## Real programs: sharexec against the standard library ({record['date']})\n")
    print(run_line(record))
    print(programs_table(record))
    print(programs_verdict(record))
    print(
        "Times: the wall time of the program's whole process (its interpreter, imports, "
        "pool and exit), median. *paired*: the median of the ratios of the runs of one "
        "repetition (close in time). *the same, in main()*: the ratio of the medians of "
        "`main()` alone (from the script's imports done to its result; sharexec's "
        "import not included).\n"
    )
    if not args.no_pools:
        print(pools_table(record))
        print(
            "Pools: from `Executor(2)` to two distinct workers each having run a task, "
            "NumPy and sharexec imported before, a fresh process per repetition; later "
            "pools: the median of every pool after the first of its process.\n"
        )
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out = args.json or ROOT / "bench" / "results" / f"real-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"JSON: {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
