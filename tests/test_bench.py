"""The benchmark suite runs to the end with every peer: ``bench/run.py`` at a tiny scale.

Its figures are judged by a person reading a run on a quiet machine, never here. What is
checked is that every system runs every workload it supports under every start method,
so that ``nox -s bench`` does not stop halfway through a long run (it did: mpire had no
``start_pool``, then took the start method ``default`` for a real one). Needs the
``bench`` extra (joblib, mpire, psutil, matplotlib).
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
