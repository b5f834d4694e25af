"""Every example runs, as a user would run it, in its fast mode (``--fast``: small sizes).

``python -m pytest -m slow tests/test_examples.py`` also runs them at their default sizes.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import segments_now

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))
BY_NAME = {p.stem: p for p in EXAMPLES}

# Examples that need an optional package (the ``clients`` extra): skipped without it.
REQUIRES = {"pandas_groupby": "pandas"}

MODES = [
    pytest.param(["--fast"], id="fast"),
    pytest.param([], id="default", marks=pytest.mark.slow),
]


def run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=170)


def run_without(module: str, path: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """Run the example ``path --fast`` as its own script, as if ``module`` were not installed."""
    code = (
        "import runpy, sys\n"
        f"sys.modules[{module!r}] = None  # import {module} raises ImportError\n"
        f"sys.argv = [{str(path)!r}, '--fast']\n"
        f"runpy.run_path({str(path)!r}, run_name='__main__')\n"
    )
    return run(["-c", code])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_and_leaves_nothing(path, mode):
    if path.stem in REQUIRES:
        pytest.importorskip(REQUIRES[path.stem])
    before = segments_now()
    out = run([str(path), *mode])
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout  # one summary line
    assert segments_now() == before


def test_every_example_has_a_fast_mode():
    for path in EXAMPLES:
        assert "--fast" in path.read_text(), path.name


@pytest.mark.timeout(60)
def test_pandas_example_without_pandas_says_so_and_fails():
    out = run_without("pandas", BY_NAME["pandas_groupby"])
    assert out.returncode != 0
    assert "needs pandas" in out.stderr
    assert not out.stdout


@pytest.mark.timeout(60)
def test_progress_bar_without_tqdm_prints_its_own_progress_line():
    before = segments_now()
    out = run_without("tqdm", BY_NAME["progress_bar"])
    assert out.returncode == 0, out.stderr
    assert "sorting: 6/6 tasks" in out.stderr  # the stand-in's line, on stderr
    assert len(out.stdout.strip().splitlines()) == 1, out.stdout
    assert segments_now() == before
