"""Every benchmark figure of the docs, rendered from committed runs (their results files).

The pages hold the figures in blocks between two markers::

    <!-- bench:NAME: rendered by bench/render.py from docs/bench-results.json -->
    ...
    <!-- /bench:NAME -->

and this script rewrites what lies between them from the results file the marker names,
so that the figures of every page come from the same run and cannot drift apart. Three
runs are published: ``docs/bench-results.json`` (``bench/run.py``, the suite against its
peers), ``docs/bench-torch-results.json`` (``bench/torch_bench.py``, PyTorch tensors) and
``docs/bench-real-results.json`` (``bench/real_programs.py``, whole programs).
The test suite (``tests/test_docs.py``) fails if a block differs from what this script
renders.

Usage::

    python bench/run.py --json docs/bench-results.json   # a new run, to publish
    python bench/torch_bench.py --json docs/bench-torch-results.json
    python bench/real_programs.py --json docs/bench-real-results.json
    python bench/render.py                                # rewrite every block
    python bench/render.py --check                        # exit 1 if a block is stale

Imports only the standard library (and ``run.py``, ``torch_bench.py`` and
``real_programs.py`` beside it, whose tables it reuses; none imports torch or sharexec at
import time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_programs  # beside this file
import torch_bench
from run import W1_MIB, Row, small_shm_table, table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "bench-results.json"
TORCH_RESULTS = ROOT / "docs" / "bench-torch-results.json"
REAL_RESULTS = ROOT / "docs" / "bench-real-results.json"
# The pages with rendered blocks.
PAGES = [
    ROOT / "docs" / "performance.md",
    ROOT / "docs" / "migration" / "from-processpoolexecutor.md",
    ROOT / "docs" / "migration" / "from-torch.md",
]
BLOCK = re.compile(
    r"(<!-- bench:(?P<name>[\w-]+): rendered by bench/render\.py from "
    r"(?P<source>docs/[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)",
    re.S,
)


class Run:
    """One run of bench/run.py, as its results file holds it."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        names = {f.name for f in dataclasses.fields(Row)}
        self.rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in record["rows"]]
        self.rows_by_key = {(r.workload, r.method, r.system, r.mib): r for r in self.rows}
        self.method = record["args"]["start_method"]

    def row(self, workload: str, system: str, mib: float | None = None, method: str = "") -> Row:
        return self.rows_by_key[(workload, method or self.method, system, mib)]

    def time(
        self, workload: str, system: str, mib: float | None = None, method: str = ""
    ) -> float:
        value = self.row(workload, system, mib, method).time
        assert value is not None, (workload, system, mib, method)
        return value

    def ratio(
        self, workload: str, system: str, mib: float | None = None, method: str = ""
    ) -> float:
        value = self.row(workload, system, mib, method).ratio
        assert value is not None, (workload, system, mib, method)
        return value

    def extra_mib(self, workload: str, system: str, mib: float | None = None) -> float:
        value = self.row(workload, system, mib).extra_bytes
        assert value is not None, (workload, system, mib)
        return value / 2**20

    def held_mib(self, workload: str, system: str, mib: float | None = None) -> float:
        value = self.row(workload, system, mib).held_bytes
        assert value is not None, (workload, system, mib)
        return value / 2**20


def mem(x: float) -> str:
    """Extra memory in MiB; below 1 MiB (negative: noise around the reference) as none."""
    return f"{x:.0f} MiB" if x >= 1 else "no measurable"


def s(x: float) -> str:
    """Seconds, three significant digits: ``0.0614``."""
    return f"{x:.3g}"


def vs(ratio: float) -> str:
    """sharexec's time over the standard library's, as the tables give it, and in words:
    "0.037 times the standard library's time (27 times faster)"."""
    words = times(ratio)
    return f"{ratio:.2g} times the standard library's time ({words})"


def times(ratio: float) -> str:
    """A ratio of sharexec's time to another's, in words: "38 times faster", "1.3 times
    the standard library's time"."""
    if ratio < 1:
        faster = 1 / ratio
        return f"{faster:.2g} times faster" if faster >= 10 else f"{faster:.1f} times faster"
    return f"{ratio:.2g} times slower"


def one_minute_load(uptime: str) -> str:
    """The 1-minute load average in ``uptime``'s output, e.g. ``"3.56"``."""
    return uptime.rpartition("load average:")[2].split(",")[0].strip()


def run_block(run: Run) -> str:
    r = run.record
    v = r["versions"]
    load = f"{one_minute_load(r['load_before'])} and {one_minute_load(r['load_after'])}"
    return (
        f"The figures on this page are from one run of `python bench/run.py` ("
        f"{run.method}, {r['args']['reps']} repetitions, scale {r['args']['scale']:g}) on "
        f"{r['date']}: Linux with {r['cpus']} CPUs, Python {v['python']}, NumPy "
        f"{v['numpy']}, loky {v['loky']}, joblib {v['joblib']}, sharexec at commit "
        f"`{v['sharexec_commit']}`. Its results file is "
        "[docs/bench-results.json](bench-results.json), and every figure of these pages is "
        "rendered from it by `bench/render.py` (the test suite checks that they agree). "
        + loaded(r, load)
    )


def busy(r: dict[str, Any]) -> bool:
    """Whether the machine had more runnable work than CPUs, before or after the run."""
    loads = [float(one_minute_load(r[k])) for k in ("load_before", "load_after")]
    return max(loads) > r["cpus"]


def loaded(r: dict[str, Any], load: str) -> str:
    """What the machine's load says about the figures."""
    if not busy(r):
        return (
            f"The machine was shared with other jobs (load average {load} before and after "
            f"the run, {r['wall_s']:.0f} s of wall time), so differences of less than "
            "about 10% are noise.\n"
        )
    return (
        f"**The machine was busy with other jobs** (load average {load} before and after "
        f"the run, on {r['cpus']} CPUs; {r['wall_s']:.0f} s of wall time): every system "
        "waited for the CPUs, small and CPU-bound workloads (start-up, W5) most, so their "
        "ratios say little, and close figures do not tell two systems apart. Re-run on "
        "a quiet machine and publish that run (see *Running it yourself*).\n"
    )


def floor_block(run: Run) -> str:
    lines = ["| floor | |", "|---|--:|"]
    lines += [f"| {k} | {v:.3g} |" for k, v in run.record["floor"].items()]
    return "\n".join(lines) + "\n"


def summary_block(run: Run) -> str:
    w1 = run.time("W1", "sharexec", W1_MIB)
    w1_std = run.time("W1", "stdlib", W1_MIB)
    w1_shm = run.time("W1", "shm", W1_MIB)
    w1s = [r for r in run.rows if r.workload == "W1s" and r.dispatch]
    dispatch = [statistics.median(r.dispatch) * 1e3 for r in w1s]
    sizes = sorted(r.mib for r in w1s if r.mib)
    w1s_main = run.time("W1s", "sharexec", W1_MIB)
    methods = [
        m
        for m in ("spawn", "forkserver", "fork")
        if ("start-up", m, "sharexec", None) in run.rows_by_key
    ]
    startup_text = ", ".join(
        f"{run.ratio('start-up', 'sharexec', method=m):.2g} times the standard library's "
        f"time under `{m}` ({run.time('start-up', 'sharexec', method=m) * 1e3:.0f} ms; "
        f"loky alone {run.ratio('start-up', 'loky', method=m):.2g} times)"
        for m in methods
    )
    shm_vs = {
        w: run.time(w, "shm", mib) / run.time(w, "sharexec", mib)
        for w, mib in (("W1", W1_MIB), ("W2", 512), ("W3", 64), ("W4", 512))
    }
    ahead = [w for w, r in shm_vs.items() if r <= 1]
    close = [w for w, r in shm_vs.items() if 1 < r < 1.1]
    shm_text = (
        "Hand-written shared memory (`shm`) is behind sharexec on every workload with "
        "arrays"
        + (f" (on {' and '.join(close)} by less than the noise)" if close else "")
        + ": it pays a fresh segment per call, where sharexec reuses warm ones and keeps "
        "them mapped in the workers."
        if not ahead
        else f"Hand-written shared memory (`shm`) was as fast or faster on {', '.join(ahead)}."
    )
    return (
        f"- **One large argument** (W1, {W1_MIB} MiB, 8 calls): "
        f"{vs(run.ratio('W1', 'sharexec', W1_MIB))}, which pickles it through a pipe for "
        f"each call ({s(w1)} s against {s(w1_std)} s), and "
        f"{times(w1 / w1_shm)} than hand-written shared memory ({s(w1_shm)} s). Shared once "
        f"beforehand (W1s), the same calls take {s(w1s_main)} s, and passing the array "
        f"costs {min(dispatch):.2g} to {max(dispatch):.2g} ms whatever its size, from "
        f"{sizes[0]:g} MiB to {sizes[-1]:g} MiB.\n"
        f"- **Mapping over chunks** (W2), **large results** (W3) and **filling one output "
        f"from many workers** (W4): {vs(run.ratio('W2', 'sharexec', 512))}, "
        f"{vs(run.ratio('W3', 'sharexec', 64))} and {vs(run.ratio('W4', 'sharexec', 512))}. "
        "W2's chunks go into shared memory as they are "
        f"dispatched ({mem(run.extra_mib('W2', 'sharexec', 512))} extra memory for a 512 MiB "
        f"array, against {mem(run.extra_mib('W2', 'joblib', 512))} for joblib and "
        f"{mem(run.extra_mib('W2', 'shm', 512))} for hand-written shared memory). W3 "
        f"needs {mem(run.extra_mib('W3', 'sharexec', 64))} of extra memory for 512 MiB of "
        f"results (the standard library {mem(run.extra_mib('W3', 'stdlib', 64))}).\n"
        f"- **Thousands of tiny tasks** (W5, no arrays): "
        f"{run.ratio('W5 submit', 'sharexec'):.2f} times the standard library's time by "
        f"`submit` and {run.ratio('W5 map', 'sharexec'):.2f} times by `map` (loky: "
        f"{run.ratio('W5 submit', 'loky'):.2f} and {run.ratio('W5 map', 'loky'):.2f} "
        "times). Queued calls of a function measured short travel several in one "
        "message (batching), and a call whose arguments are plain values is pickled by "
        "the standard pickler, without the array scan.\n"
        f"- **Pool start-up** costs {startup_text}.\n"
        f"- {shm_text}\n"
    )


def small_shm_block(run: Run) -> str:
    part = run.record.get("small_shm")
    if not part:
        return (
            "The published run did not measure this part (`bench/run.py --workloads "
            "...,small-shm`, as root).\n"
        )
    return (
        f"Start method {part['method']}; each side run {part['rounds']} times, "
        f"alternating, {part['reps']} repetitions each: the median of the runs' medians. "
        f"The namespace's /dev/shm is a {part['shm_size'].upper()}B tmpfs.\n\n"
        + small_shm_table(part)
    )


def held_block(run: Run) -> str:
    return (
        f"- W1 ({run.held_mib('W1', 'sharexec', W1_MIB):.0f} MiB held): the copy of the "
        "argument, kept warm in the executor's pool for the next copy; the pool is trimmed "
        "after 10 s without use.\n"
        f"- W3 ({run.held_mib('W3', 'sharexec', 64):.0f} MiB held): the segments of "
        "collected results, pooled to be lent to the next results of the same function; "
        "also trimmed after 10 s.\n"
        f"- W3's extra memory ({run.extra_mib('W3', 'sharexec', 64):.0f} MiB for 512 MiB of "
        "results) is the results plus the one result each worker is building: a function "
        "that returns `np.full(n, v)` makes its array in private memory before sharexec "
        "can copy it into shared memory.\n"
    )


def results_block(run: Run) -> str:
    main = [r for r in run.rows if r.method == run.method]
    return table(main, run.method) + "\n"


def other_methods_block(run: Run) -> str:
    others = [r for r in run.rows if r.method != run.method]
    return table(others, run.method) + "\n" if others else "(not measured in this run)\n"


def tiny_tasks_block(run: Run) -> str:
    submit = run.ratio("W5 submit", "sharexec")
    mapped = run.ratio("W5 map", "sharexec")
    if max(submit, mapped) <= 0.5:
        verdict = "cost a fraction of what they cost with the standard library"
    elif max(submit, mapped) <= 1:
        verdict = "cost no more than with the standard library"
    elif min(submit, mapped) > 1:
        verdict = "cost more than with the standard library"
    else:
        verdict = "cost about what they cost with the standard library"
    return (
        f"- **Tiny tasks** {verdict}: on the benchmark (W5, "
        f"10,000 tasks that carry no array) sharexec took {submit:.2f} times the standard "
        f"library's time by `submit` and {mapped:.2f} times by `map` (see "
        "[Performance](../performance.md), the run it names"
        + (", on a busy machine" if busy(run.record) else "")
        + "). Queued calls of a function measured short travel several in one message, "
        "and a call whose arguments are plain values skips the array scan.\n"
    )


# ---------------------------------------------------------------------------------------
# The tensor benchmark's run (bench/torch_bench.py)
# ---------------------------------------------------------------------------------------


class TorchRun:
    """One run of bench/torch_bench.py, as its results file holds it."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def median(self, kind: str, workload: str, system: str) -> float:
        return statistics.median(self.record[kind][workload][system])

    def ratio(self, kind: str, workload: str) -> float:
        """sharexec's median over the stdlib's (T3s: over the stdlib's T3)."""
        base = "T3" if workload == "T3s" else workload
        return self.median(kind, workload, "sharexec") / self.median(kind, base, "stdlib")


def torch_run_block(run: TorchRun) -> str:
    r = run.record
    v = r["versions"]
    a = r["args"]
    load = f"{one_minute_load(r['load_before'])} and {one_minute_load(r['load_after'])}"
    return (
        f"The figures below are from one run of `python bench/torch_bench.py` "
        f"({a['start_method']}, 2 workers, {a['reps']} repetitions, scale {a['scale']:g}) on "
        f"{r['date']}: Linux with {r['cpus']} CPUs, Python {v['python']}, torch "
        f"{v['torch']}, NumPy {v['numpy']}, loky {v['loky']}, sharexec at commit "
        f"`{v['sharexec_commit']}`; its results file is "
        "[docs/bench-torch-results.json](bench-torch-results.json). Medians in seconds "
        "(min-max), first of wall time, then of the CPU time of all processes (the parent "
        "and its workers: less swayed by other jobs than wall time). "
        + (
            f"**The machine was busy with other jobs** (load average {load} before and "
            f"after the run, on {r['cpus']} CPUs; {r['wall_s']:.0f} s of wall time): close "
            "figures do not tell two systems apart.\n"
            if busy(r)
            else f"The machine was shared with other jobs (load average {load} before and "
            f"after the run, {r['wall_s']:.0f} s of wall time), so differences of less than "
            "about 10% are noise.\n"
        )
    )


def torch_wall_block(run: TorchRun) -> str:
    return torch_bench.table(run.record, "wall")


def torch_cpu_block(run: TorchRun) -> str:
    return torch_bench.table(run.record, "cpu")


def _torch_ratios(run: TorchRun, workloads: list[str]) -> str:
    return "; ".join(
        f"{w} {run.ratio('wall', w):.2f} (CPU {run.ratio('cpu', w):.2f})" for w in workloads
    )


def torch_summary_block(run: TorchRun) -> str:
    measured = [w for w in ("T1", "T2", "T3", "T3s") if w in run.record["workloads"]]
    behind = [w for w in measured if run.ratio("wall", w) > 1]
    verdict = (
        "at or below the standard library's wall time on every workload"
        if not behind
        else f"behind the standard library's wall time on {', '.join(behind)}"
    )
    return (
        "- **PyTorch tensors** (their own benchmark, [below](#pytorch-tensors)), keeping "
        f"torch's semantics: sharexec is {verdict}. Its time over the standard library's, "
        f"wall (and CPU): {_torch_ratios(run, measured)}.\n"
    )


def torch_measured_block(run: TorchRun) -> str:
    measured = [w for w in ("T1", "T2", "T3", "T3s") if w in run.record["workloads"]]
    return (
        f"In the published run ({run.record['date']}"
        + (", on a busy machine" if busy(run.record) else "")
        + "), sharexec's time over the standard library's, wall (and CPU of all processes): "
        f"{_torch_ratios(run, measured)}. See "
        "[Performance](../performance.md#pytorch-tensors) for the tables and the machine "
        "they ran on.\n"
    )


# ---------------------------------------------------------------------------------------
# The real programs' run (bench/real_programs.py)
# ---------------------------------------------------------------------------------------


def real_summary_block(record: dict[str, Any]) -> str:
    s = real_programs.summary(record)
    rows = [r for r in s["rows"] if r["ratio"] is not None]
    slowest = max(rows, key=lambda r: r["ratio"])
    fastest = min(rows, key=lambda r: r["ratio"])
    default = record["stdlib_default_method"]
    same_method = (record["args"]["same_method"] or "").removeprefix("stdlib-")
    return (
        f"- **Real programs** ({len(rows)} scripts, each run whole in a fresh process, "
        f"[below](#real-programs)): against the standard library's executor with its "
        f"defaults ({default}), sharexec's time is {s['geomean']:.2f} times the standard "
        f"library's (geometric mean), from {fastest['ratio']:.2f} times "
        f"({fastest['entry']['program']}) to {slowest['ratio']:.2f} times "
        f"({slowest['entry']['program']})"
        + (
            f"; against the standard library under {same_method} "
            f"(no fork of the parent either), {s['geomean_same']:.2f} times"
            if s["geomean_same"] is not None
            else ""
        )
        + (
            f"; sharexec itself under {default}, {s['geomean_fork']:.2f} times"
            if s.get("geomean_fork") is not None
            else ""
        )
        + ".\n"
    )


def real_run_block(record: dict[str, Any]) -> str:
    v = record["versions"]
    a = record["args"]
    load = f"{one_minute_load(record['load_before'])} and {one_minute_load(record['load_after'])}"
    return (
        f"The figures below are from one run of `python bench/real_programs.py` (scale "
        f"{a['scale']:g}, {real_programs.plural(a['reps'], 'repetition')} of each program, "
        f"{a['pool_reps']} of the pools) on {record['date']}: Linux with {record['cpus']} "
        f"CPUs, Python {v['python']}, NumPy {v['numpy']}, SciPy {v['scipy']}, scikit-image "
        f"{v['scikit-image']}, numba {v['numba']}, loky {v['loky']}, sharexec at commit "
        f"`{v['sharexec_commit']}`; its results file is "
        "[docs/bench-real-results.json](bench-real-results.json). "
        + (
            f"**The machine was busy with other jobs** (load average {load} before and "
            f"after the run, on {record['cpus']} CPUs; {record['wall_s']:.0f} s of wall "
            "time): every process waited for the CPUs, so only ratios of the same run "
            "mean something, and close ones do not tell the two executors apart.\n"
            if busy(record)
            else f"The machine was shared with other jobs (load average {load} before and "
            f"after the run, {record['wall_s']:.0f} s of wall time), so differences of less "
            "than about 10% are noise.\n"
        )
    )


def real_programs_block(record: dict[str, Any]) -> str:
    return real_programs.programs_table(record) + "\n" + real_programs.programs_verdict(record)


def real_pools_block(record: dict[str, Any]) -> str:
    return real_programs.pools_table(record)


# Each block: the results file it renders from, and how.
BLOCKS: dict[str, tuple[Path, Callable[[Any], str]]] = {
    "summary": (RESULTS, summary_block),
    "run": (RESULTS, run_block),
    "floor": (RESULTS, floor_block),
    "results": (RESULTS, results_block),
    "other-methods": (RESULTS, other_methods_block),
    "held": (RESULTS, held_block),
    "small-shm": (RESULTS, small_shm_block),
    "tiny-tasks": (RESULTS, tiny_tasks_block),
    "torch-summary": (TORCH_RESULTS, torch_summary_block),
    "torch-run": (TORCH_RESULTS, torch_run_block),
    "torch-wall": (TORCH_RESULTS, torch_wall_block),
    "torch-cpu": (TORCH_RESULTS, torch_cpu_block),
    "torch-measured": (TORCH_RESULTS, torch_measured_block),
    "real-summary": (REAL_RESULTS, real_summary_block),
    "real-run": (REAL_RESULTS, real_run_block),
    "real-programs": (REAL_RESULTS, real_programs_block),
    "real-pools": (REAL_RESULTS, real_pools_block),
}


def load(path: Path = RESULTS) -> Run:
    return Run(json.loads(path.read_text(encoding="utf-8")))


def load_torch(path: Path = TORCH_RESULTS) -> TorchRun:
    return TorchRun(json.loads(path.read_text(encoding="utf-8")))


def load_real(path: Path = REAL_RESULTS) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return record


def load_all(
    results: Path = RESULTS, torch_results: Path = TORCH_RESULTS, real_results: Path = REAL_RESULTS
) -> dict[Path, Any]:
    """Every published run, by the results file its blocks name."""
    return {
        RESULTS: load(results),
        TORCH_RESULTS: load_torch(torch_results),
        REAL_RESULTS: load_real(real_results),
    }


def render(text: str, runs: dict[Path, Any]) -> str:
    """``text`` with each of its blocks rendered from the run its marker names."""

    def one(match: re.Match[str]) -> str:
        source, block = BLOCKS[match["name"]]
        named = ROOT / match["source"]
        if named != source:
            raise ValueError(
                f"block {match['name']!r} renders from {source.relative_to(ROOT)}, "
                f"its marker names {match['source']}"
            )
        return match[1] + block(runs[source]) + match[5]

    return BLOCK.sub(one, text)


def stale(runs: dict[Path, Any] | None = None) -> list[str]:
    """The pages (relative to the root) whose blocks differ from their rendering."""
    runs = load_all() if runs is None else runs
    return [
        str(page.relative_to(ROOT))
        for page in PAGES
        if render(text := page.read_text(encoding="utf-8"), runs) != text
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", type=Path, default=RESULTS)
    p.add_argument("--torch-results", type=Path, default=TORCH_RESULTS)
    p.add_argument("--real-results", type=Path, default=REAL_RESULTS)
    p.add_argument("--check", action="store_true", help="only tell whether a block is stale")
    args = p.parse_args(argv)
    runs = load_all(args.results, args.torch_results, args.real_results)
    if args.check:
        pages = stale(runs)
        for page in pages:
            print(f"{page}: figures differ from the results files; run python bench/render.py")
        return 1 if pages else 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        page.write_text(render(text, runs), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
