"""The fault table: turns the JSON lines of tests/faults_plugin.py into markdown.

    python tests/faults_report.py faults.jsonl [--output table.md] [--title TEXT]

One row per scenario (the runs under every start method added up): runs, segments
leaked, crashes, wrong results; a total row; then the tests that did not run and the
failures, one line each. Exits 1 if any count is not zero, or if the test session did not
finish or failed otherwise (e.g. a collection error), so ``nox -s faults`` fails with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = ("runs", "segments leaked", "crashes", "wrong results")


def load(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The test records, and the end-of-session record (None if the session died)."""
    records, end = [], None
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record.get("end"):
                end = record
            else:
                records.append(record)
    return records, end


def table(records: list[dict[str, Any]]) -> tuple[list[str], dict[str, list[int]]]:
    """The markdown lines of the table, and the counts per scenario."""
    rows: dict[str, list[int]] = {}
    for r in records:
        row = rows.setdefault(r["scenario"], [0, 0, 0, 0])
        if r.get("skipped") is None:
            row[0] += 1
        row[1] += r.get("leaked", 0)
        row[2] += r.get("crash", 0)
        row[3] += r.get("wrong", 0)
    rows = {k: v for k, v in rows.items() if v != [0, 0, 0, 0]}  # never ran: listed apart
    totals = [sum(column) for column in zip(*rows.values(), strict=True)] or [0, 0, 0, 0]
    width = max([len("scenario"), *(len(f"`{s}`") for s in rows)])
    lines = [
        f"| {'scenario':<{width}} | " + " | ".join(COLUMNS) + " |",
        f"|{'-' * (width + 2)}|" + "|".join("-" * (len(c) + 1) + ":" for c in COLUMNS) + "|",
    ]
    for scenario, row in [*rows.items(), ("**total**", totals)]:
        name = scenario if scenario.startswith("**") else f"`{scenario}`"
        cells = " | ".join(f"{n:>{len(c)}}" for n, c in zip(row, COLUMNS, strict=True))
        lines.append(f"| {name:<{width}} | {cells} |")
    return lines, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", type=Path)
    parser.add_argument("--output", type=Path, help="also write the markdown here")
    parser.add_argument("--title", help="a line printed above the table")
    args = parser.parse_args(argv)

    records, end = load(args.jsonl)
    lines, rows = table(records)
    out = [args.title, ""] if args.title else []
    out += lines
    skipped: dict[str, tuple[int, str]] = {}
    for r in records:
        if r.get("skipped") is not None:
            count, _ = skipped.get(r["scenario"], (0, ""))
            skipped[r["scenario"]] = (count + 1, r["skipped"])
    if skipped:
        out += ["", "Not run:"]
        for scenario, (n, why) in skipped.items():
            out.append(f"- `{scenario}` ({n} run{'s' if n != 1 else ''}): {why}")
    failures = [r for r in records if r.get("leaked") or r.get("crash") or r.get("wrong")]
    if failures:
        out += ["", "Failures:"]
        for r in failures:
            known = f" (known: xfail: {r['xfail']})" if r.get("xfail") else ""
            out.append(f"- `{r['nodeid']}`{known}: " + " / ".join(r.get("details", [])))
    problems = []
    if end is None:
        problems.append("the test session did not finish (it crashed or was killed)")
    elif end["exitstatus"] not in (0, 1):  # 1: tests failed, which the table shows
        problems.append(f"pytest exited with status {end['exitstatus']}")
    elif end["exitstatus"] == 1 and not failures:
        problems.append("pytest reported failures the table does not show")
    if not rows:
        problems.append("no test ran")
    if problems:
        out += ["", *(f"**{p}**" for p in problems)]
    text = "\n".join(out) + "\n"
    sys.stdout.write(text)
    if args.output:
        args.output.write_text(text)
    return 1 if failures or problems else 0


if __name__ == "__main__":
    sys.exit(main())
