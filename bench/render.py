"""Every benchmark figure of the docs, rendered from one committed run (its results file).

The pages hold the figures in blocks between two markers::

    <!-- bench:NAME: rendered by bench/render.py from docs/bench-results.json -->
    ...
    <!-- /bench:NAME -->

and this script rewrites what lies between them from the results file, so that the
figures of every page come from the same run and cannot drift apart. The test suite
(``tests/test_docs.py``) fails if a block differs from what this script renders.

Usage::

    python bench/run.py --json docs/bench-results.json   # a new run, to publish
    python bench/render.py                                # rewrite every block
    python bench/render.py --check                        # exit 1 if a block is stale

Imports only the standard library (and ``run.py`` beside it, whose table it reuses).
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

from run import W1_MIB, Row, table  # beside this file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "bench-results.json"
# The pages with rendered blocks.
PAGES = [
    ROOT / "docs" / "performance.md",
    ROOT / "docs" / "migration" / "from-processpoolexecutor.md",
]
SOURCE = "rendered by bench/render.py from docs/bench-results.json"
BLOCK = re.compile(
    r"(<!-- bench:(?P<name>[\w-]+): " + re.escape(SOURCE) + r" -->\n)(?P<body>.*?)"
    r"(<!-- /bench:(?P=name) -->)",
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
        "times). A call whose arguments are plain values is pickled by the standard "
        "pickler, without the array scan.\n"
        f"- **Pool start-up** costs {startup_text}.\n"
        f"- {shm_text}\n"
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
    if max(submit, mapped) <= 1:
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
        + "). A call whose arguments are "
        "plain values skips the array scan; for tasks of microseconds, give `map` a "
        "`chunksize` all the same.\n"
    )


BLOCKS: dict[str, Callable[[Run], str]] = {
    "summary": summary_block,
    "run": run_block,
    "floor": floor_block,
    "results": results_block,
    "other-methods": other_methods_block,
    "held": held_block,
    "tiny-tasks": tiny_tasks_block,
}


def load(path: Path = RESULTS) -> Run:
    return Run(json.loads(path.read_text(encoding="utf-8")))


def render(text: str, run: Run) -> str:
    """``text`` with each of its blocks rendered from ``run``."""

    def one(match: re.Match[str]) -> str:
        body = BLOCKS[match["name"]](run)
        return match[1] + body + match[4]

    return BLOCK.sub(one, text)


def stale(run: Run) -> list[str]:
    """The pages (relative to the root) whose blocks differ from their rendering."""
    return [
        str(page.relative_to(ROOT))
        for page in PAGES
        if render(text := page.read_text(encoding="utf-8"), run) != text
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", type=Path, default=RESULTS)
    p.add_argument("--check", action="store_true", help="only tell whether a block is stale")
    args = p.parse_args(argv)
    run = load(args.results)
    if args.check:
        pages = stale(run)
        for page in pages:
            print(f"{page}: figures differ from {args.results}; run python bench/render.py")
        return 1 if pages else 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        page.write_text(render(text, run), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
