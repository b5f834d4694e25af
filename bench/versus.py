"""Before and after a change: ``python bench/versus.py --old PATH [run.py's options]``.

Runs ``bench/run.py`` (this checkout's) with sharexec imported from another checkout
(``--old``, a ``git worktree`` of the commit before the change) and from this one, in
alternation, one process each, ``--rounds`` times: what the machine's load does to one
round it does to both sides. Each round of each side reports its sharexec time and the
standard library's (run by the same process), so each row below gives, per workload, the
median of each side's times, the median over rounds of the ratio new / old (rounds
paired: 1.00 is no change, below is faster now), and the same ratio with each side's
time taken relative to the stdlib's of its own process (which adds the stdlib's noise).

Example: ``python bench/versus.py --old /tmp/old --rounds 5 --workloads W1,W2,W3,W4,W5
--reps 3 --no-memory``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from console import commit, log, uptime

HERE = Path(__file__).resolve().parent


def one_run(tree: Path, options: list[str]) -> dict[tuple[str, str], tuple[float, float]]:
    """One process of run.py with sharexec from ``tree``: per (workload, start method),
    sharexec's median time and the stdlib's."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "run.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        command = [sys.executable, str(HERE / "run.py"), "--systems", "stdlib,sharexec"]
        command += [*options, "--json", str(out), "--plot", str(Path(scratch) / "w1.png")]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())["rows"]
    times: dict[tuple[str, str], dict[str, float]] = {}
    for row in rows:
        if row["time"] is not None:
            times.setdefault((row["workload"], row["method"]), {})[row["system"]] = row["time"]
    return {
        key: (t["sharexec"], t["stdlib"])
        for key, t in times.items()
        if "sharexec" in t and "stdlib" in t
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="checkout of the code before")
    p.add_argument("--rounds", type=int, default=5)
    args, options = p.parse_known_args()
    new = HERE.parent
    print(f"old: {commit(args.old)} ({args.old}); new: {commit(new)}")
    print(f"load before: {uptime()}")
    sides: dict[str, list[dict[tuple[str, str], tuple[float, float]]]] = {"old": [], "new": []}
    for i in range(args.rounds):
        for side, tree in (("old", args.old), ("new", new)):
            log(f"round {i + 1}/{args.rounds}: {side}")
            sides[side].append(one_run(tree, options))
    print(f"load after:  {uptime()}")
    print(f"\n{args.rounds} rounds, run.py {' '.join(options)}\n")
    print("| workload | method | old (s) | new (s) | new / old | the same, each vs its stdlib |")
    print("|---|---|--:|--:|--:|--:|")
    for key in sides["new"][0]:
        pairs = [(o[key], n[key]) for o, n in zip(sides["old"], sides["new"], strict=True)]
        raw = statistics.median(n[0] / o[0] for o, n in pairs)
        relative = statistics.median((n[0] / n[1]) / (o[0] / o[1]) for o, n in pairs)
        print(
            f"| {key[0]} | {key[1]} | {statistics.median(o[0] for o, _ in pairs):.3g} "
            f"| {statistics.median(n[0] for _, n in pairs):.3g} | {raw:.2f} | {relative:.2f} |"
        )


if __name__ == "__main__":
    main()
