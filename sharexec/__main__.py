"""The command line: ``python -m sharexec <command>``.

Commands
--------
demo
    Time a workload over a large NumPy array with the standard library's
    ``ProcessPoolExecutor`` and with ``sharexec.SharedProcessPoolExecutor``, side by side,
    and print both times and their ratio (the workload itself lives in ``_demo``). It
    checks its size and the ``SHAREXEC_*`` variables, and says what it will cost, before
    running anything.
doctor
    Report the platform, the shared-memory folder and its free space, invalid or unknown
    ``SHAREXEC_*`` variables, the start methods and any stale segments (the facts come
    from ``_doctor``); ``--clean`` removes those, and names each segment it keeps that
    it cannot judge (another PID namespace's), with the reason. ``--imports PACKAGE ...``
    imports those packages, makes a pool and says which of them its workers find imported
    (the warm server imports a program's packages; it leaves out one whose import
    starts a thread).

``--version`` prints sharexec's version. A mistake of the user's (a bad size, a bad
variable) is one line on stderr and exit code 2, never a traceback.

This is the only module of sharexec that prints. Spawned workers re-import it as
``__mp_main__``, so it does nothing at import time beyond defining functions.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _size_mb(text: str) -> float:
    from ._demo import SizeError, check_size

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        check_size(value)
    except SizeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``python -m sharexec``."""
    parser = argparse.ArgumentParser(
        prog="python -m sharexec",
        description=(
            "sharexec: a drop-in ProcessPoolExecutor that moves large NumPy arrays "
            "through shared memory."
        ),
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"sharexec {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="time a workload with the stdlib executor and with sharexec, side by side",
        description=(
            "Run sum(ex.map(chunk_sum, np.array_split(a, 64))) and "
            "ex.submit(np.sqrt, a).result() over a large float64 array, first with "
            "concurrent.futures.ProcessPoolExecutor, then with "
            "sharexec.SharedProcessPoolExecutor (2 workers, start method 'spawn', warm "
            "pools), check the results against the serial computation and print the "
            "times. It measures the cost of moving the data between processes, not a "
            "parallel speed-up. At the default size the stdlib executor takes up to a "
            "minute, and the demo needs about 7.1 GiB of memory at its peak (7x the "
            "array); --size-mb 64 runs in seconds."
        ),
    )
    demo.add_argument(
        "--size-mb",
        type=_size_mb,
        default=1024,
        metavar="MIB",
        help="size of the array in MiB (default: %(default)s, i.e. 134,217,728 float64)",
    )
    doctor = commands.add_parser(
        "doctor",
        help="check this machine: shared memory, fallback folder, stale segments",
        description="Report what sharexec finds on this machine, and what to fix.",
    )
    doctor.add_argument(
        "--clean",
        action="store_true",
        help="remove segments left by processes surely dead; keep (and name) the rest",
    )
    doctor.add_argument(
        "--imports",
        nargs="+",
        default=[],
        metavar="PACKAGE",
        help="import these, make a pool, and say which its workers find imported",
    )
    return parser


def _doctor(clean: bool, imports: list[str]) -> int:
    from ._doctor import examine, preload_findings, remove_stale

    if clean:
        found = remove_stale()
        for name, _ in found.stale:
            print(f"removed {name}")
        for name, _, why in found.kept:
            print(f"kept {name}: {why}")
    findings = examine()
    if imports:
        findings.extend(preload_findings(imports))
    width = max(len(f.topic) for f in findings)
    for f in findings:
        mark = {"ok": "ok", "warning": "WARNING", "error": "ERROR"}[f.status]
        print(f"{f.topic:<{width}}  {mark:<7}  {f.detail}")
    return 1 if any(f.status == "error" for f in findings) else 0


def _demo(size_mb: float) -> int:
    from ._config import check_variables, describe_unknown, unknown_variables
    from ._demo import DemoError, format_report, plan, run_demo

    errors = check_variables()
    if errors:  # before anything runs: an executor would refuse them half-way through
        for error in errors:
            print(f"python -m sharexec demo: error: {error}", file=sys.stderr)
        return 2
    for name, closest in unknown_variables():
        print(f"python -m sharexec demo: warning: {describe_unknown(name, closest)}")

    def progress(text: str) -> None:
        print(f"... {text}", flush=True)

    print(plan(size_mb))
    print()
    try:
        report = run_demo(size_mb, progress=progress)
    except DemoError as error:
        print(f"python -m sharexec demo: FAILED: {error}", file=sys.stderr)
        return 1
    print()
    print(format_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args.size_mb)
    if args.command == "doctor":
        return _doctor(args.clean, args.imports)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
