"""Every example runs, as a user would run it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import segments_now

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_and_leaves_nothing(path):
    before = segments_now()
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert segments_now() == before
