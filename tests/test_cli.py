"""The command line (``python -m sharexec``): it explains, and a user's mistake is one clear
line, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import sharexec
from sharexec import _demo
from sharexec._config import unknown_variables

pytestmark = pytest.mark.timeout(120)


def sharexec_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SHAREXEC_")}
    return subprocess.run(
        [sys.executable, "-m", "sharexec", *args],
        capture_output=True,
        text=True,
        timeout=110,
        env={**environ, **env},
    )


def test_version():
    out = sharexec_cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"sharexec {sharexec.__version__}"


@pytest.mark.parametrize("size", ["inf", "-inf", "nan", "0", "-5", "1e9", "ten"])
def test_demo_rejects_a_bad_size_in_one_line(size):
    out = sharexec_cli("demo", "--size-mb", size)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and not out.stdout
    assert "--size-mb" in out.stderr.strip().splitlines()[-1]


def test_demo_names_the_memory_a_size_needs():
    with pytest.raises(_demo.SizeError, match=r"needs about 7\.1 GiB .* 2\.0 GiB available"):
        _demo.check_size(1024, available=2 << 30)
    _demo.check_size(64, available=2 << 30)


def test_demo_help_states_the_peak_memory_of_the_default_size():
    out = sharexec_cli("demo", "--help")
    peak = _demo._gib(_demo.peak_bytes(_demo.DEFAULT_SIZE_MB))
    assert f"about {peak} of memory at its peak" in " ".join(out.stdout.split())


def test_demo_checks_the_environment_before_running_anything():
    out = sharexec_cli("demo", "--size-mb", "8", SHAREXEC_MIN_SHARE_BYTES="lots")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "SHAREXEC_MIN_SHARE_BYTES must be an integer, got 'lots'" in out.stderr
    assert "ProcessPoolExecutor" not in out.stdout  # nothing ran


def test_demo_says_what_it_measures_and_shows_progress():
    out = sharexec_cli("demo", "--size-mb", "8", SHAREXEC_MIN_SHARE_BYTE="1000")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    plan, _, rest = text.partition("... ")
    # Up front: the peak memory, and that this is the cost of moving data.
    assert "Peak memory: about 184 MiB (7x the array" in plan
    assert "not a parallel speed-up" in plan
    assert "did you mean SHAREXEC_MIN_SHARE_BYTES?" in plan
    # Progress through the stdlib's half, as through sharexec's.
    for name in ("ProcessPoolExecutor", "SharedProcessPoolExecutor"):
        assert f"{name}: 8/64 chunks summed" in rest and f"{name}: 64/64 chunks" in rest
    assert "sharexec/stdlib" in rest and "not a parallel speed-up" in rest


@pytest.mark.parametrize(
    ("stdlib", "shared", "shown"),
    [(1.0, 0.05, "0.05x (20.0x faster)"), (0.05, 0.0665, "1.33x (slower)"), (2.0, 2.0, "1.00x")],
)
def test_demo_gives_ratios_as_performance_md_does(stdlib, shared, shown):
    # sharexec's time over the stdlib's ("vs stdlib" in docs/performance.md).
    assert _demo._ratio(stdlib, shared).startswith(shown)


def test_doctor_reports_a_bad_value_and_a_misspelled_variable():
    out = sharexec_cli(
        "doctor", SHAREXEC_TEMP_FOLDER="/no/such/folder", SHAREXEC_MIN_SHARE_BYTE="1"
    )
    assert "Traceback" not in out.stderr
    assert out.returncode == 1  # an error among the findings
    lines = out.stdout.splitlines()
    assert any(
        "ERROR" in line and "SHAREXEC_TEMP_FOLDER must be an existing folder" in line
        for line in lines
    ), out.stdout
    assert any(
        "WARNING" in line
        and "SHAREXEC_MIN_SHARE_BYTE is not a sharexec variable" in line
        and "did you mean SHAREXEC_MIN_SHARE_BYTES?" in line
        for line in lines
    ), out.stdout


def test_unknown_variables_and_the_closest_known_one():
    environ = {
        "SHAREXEC_MIN_SHARE_BYTES": "1",  # known
        "SHAREXEC_FAULTS_REPORT": "x",  # the test suite's own
        "SHAREXEC_TEMPFOLDER": "/tmp",
        "SHAREXEC_COLOUR": "1",
        "OTHER": "1",
    }
    assert unknown_variables(environ) == [
        ("SHAREXEC_COLOUR", None),
        ("SHAREXEC_TEMPFOLDER", "SHAREXEC_TEMP_FOLDER"),
    ]
