"""The benchmark suites run to the end: ``bench/run.py`` and ``bench/real_programs.py`` at a
tiny scale.

Their figures are judged by a person reading a run on a quiet machine, never here. What is
checked is that every system runs every workload it supports under every start method,
so that ``nox -s bench`` does not stop halfway through a long run (it did: mpire had no
``start_pool``, then took the start method ``default`` for a real one), and that the real
programs run in fresh processes with each executor, agree, and come out as a table and a
JSON file. Needs the ``bench`` extra (joblib, mpire, psutil, matplotlib, ...).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

# Looked for, not imported: joblib, imported, registers its own copy of loky's context as
# the start method "loky", which the tests of plain processes after this one would get.
_missing = [
    m for m in ("joblib", "mpire", "psutil", "matplotlib") if not importlib.util.find_spec(m)
]
if _missing:
    pytest.skip(
        f"the bench's peers and instruments: pip install sharexec[bench] ({', '.join(_missing)})",
        allow_module_level=True,
    )

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_the_bench_runs_every_system_under_every_start_method(tmp_path):
    results = tmp_path / "run.json"
    command = [sys.executable, str(ROOT / "bench" / "run.py"), "--scale", "0.01"]
    command += ["--reps", "1", "--tasks", "200", "--no-memory"]
    command += ["--json", str(results), "--plot", str(tmp_path / "w1.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(results.read_text())["rows"]
    ran = {(r["system"], r["method"], r["workload"]) for r in rows if r["times"]}
    refused = {(r["system"], r["method"], r["workload"]) for r in rows if r["unsupported"]}
    for system in ("stdlib", "loky", "joblib", "mpire", "shm", "sharexec"):
        for method in ("spawn", "fork", "forkserver", "default"):
            if (system, method, "start-up") in refused:
                continue  # e.g. joblib under fork: loky's reusable executor refuses it
            assert (system, method, "start-up") in ran, (system, method)
            assert (system, method, "W1") in ran, (system, method)
    main = {(system, workload) for system, method, workload in ran if method == "spawn"}
    for workload in ("W2", "W3", "W4", "W5 map"):
        assert {s for s, w in main if w == workload} >= {"stdlib", "loky", "joblib", "mpire"}
    assert (tmp_path / "w1.png").stat().st_size > 0


@pytest.mark.timeout(300)
def test_the_real_programs_run_with_each_executor_and_are_reported(tmp_path):
    """Two programs (the ones that need only NumPy and the standard library) and the
    pools, once each: every executor ran each program in a process of its own, the
    results agreed (the run fails otherwise), and the table and the JSON say so."""
    results = tmp_path / "real.json"
    command = [sys.executable, str(ROOT / "bench" / "real_programs.py"), "--reps", "1"]
    command += ["--programs", "compress,genetic", "--scale", "0.1"]
    command += ["--pool-reps", "1", "--pools", "2", "--json", str(results)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    record = json.loads(results.read_text())
    systems = {"stdlib", "sharexec", "stdlib-forkserver", "sharexec-fork"}
    assert [p["program"] for p in record["programs"]] == ["compress", "genetic"]
    for program in record["programs"]:
        assert not program["skipped"]
        assert program["result"]["chunks" if program["program"] == "compress" else "best"]
        assert set(program["wall"]) == systems
        for system in systems:
            [wall] = program["wall"][system]
            assert wall > 0, (program["program"], system)
    pools = record["pools"]
    assert set(pools) == {"sharexec", "stdlib-fork", "stdlib-forkserver", "stdlib-spawn"}
    assert all(len(reps) == 1 and len(reps[0]) == 2 for reps in pools.values())
    assert record["load_before"] and record["load_after"] and record["versions"]["sharexec"]
    for line in (
        "| compress |",
        "| genetic |",
        "**geometric mean**",
        "| first pool of a",
        "fork / stdlib",
    ):
        assert line in done.stdout, line


def test_real_program_results_agree_only_when_equal():
    """The check that stops a run whose executors disagree: exact, floats to 1e-9."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import real_programs
    finally:
        sys.path.remove(str(ROOT / "bench"))
    same = real_programs.same
    assert same({"n": 3, "x": [1.5, "a"]}, {"n": 3, "x": [1.5 * (1 + 1e-12), "a"]})
    assert not same({"n": 3}, {"n": 4})
    assert not same({"x": 1.5}, {"x": 1.5001})
    assert not same({"x": [1, 2]}, {"x": [1, 2, 3]})
    assert not same({"x": 1.0}, {"y": 1.0})
