"""Development sessions: ``nox`` runs tests, lint and typecheck; ``nox -s demo`` the demo,
``nox -s clients`` the tests with real third-party clients (scipy, dask), ``nox -s compat``
runs CPython's own ProcessPoolExecutor tests against ours.

Each session installs what it needs into its own virtual environment (made with the
standard library's ``venv``, so neither uv nor virtualenv is required) under the Python
that runs nox. Arguments after ``--`` go to the session's command, e.g.
``nox -s tests -- -x -k transport`` or ``nox -s demo -- --size-mb 64``.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck"]

ROOT = Path(__file__).parent
# What lint covers; the folders are skipped while they hold no Python file.
LINT_PATHS = ["sharexec", "tests", "noxfile.py", "examples", "bench"]


def _present(paths: list[str]) -> list[str]:
    found = []
    for name in paths:
        path = ROOT / name
        if path.is_file() or (path.is_dir() and any(path.rglob("*.py"))):
            found.append(name)
    return found


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (``python -m pytest``) against an installed sharexec."""
    session.install(".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def clients(session: nox.Session) -> None:
    """Run the tests with real third-party clients (scipy, dask): the ``clients`` extra."""
    session.install(".[test,clients]")
    session.run(
        "python",
        "-m",
        "pytest",
        "tests/test_clients.py",
        "tests/test_pickle5.py",
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """Check style and formatting with ruff (configured in pyproject.toml)."""
    session.install("ruff>=0.6")
    paths = _present(LINT_PATHS)
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)


@nox.session
def typecheck(session: nox.Session) -> None:
    """Type-check the package with ``mypy --strict``."""
    session.install(".", "mypy>=1.10")
    session.run("mypy", "--strict", "sharexec")


@nox.session
def demo(session: nox.Session) -> None:
    """Run ``python -m sharexec demo`` (sharexec against the stdlib executor)."""
    session.install(".")
    session.run("python", "-m", "sharexec", "demo", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Run the benchmark suite against its peers (``bench/run.py``); not a default session.

    Installs the ``bench`` extra (joblib, psutil, matplotlib). Takes several minutes; e.g.
    ``nox -s bench -- --scale 0.25 --reps 3`` for a quicker run.
    """
    session.install(".[bench]")
    session.run("python", "bench/run.py", *session.posargs)


@nox.session(python="3.11", default=False)
def compat(session: nox.Session) -> None:
    """Run CPython 3.11's own ProcessPoolExecutor tests against SharedProcessPoolExecutor.

    ``tests/compat/run_cpython_suite.py``: the fork, forkserver and spawn variants of
    ``test_concurrent_futures``, fetched at run time from Debian's libpython3.11-testsuite
    (apt-get) into ``.cache/cpython-tests/``. Under Python 3.11 whatever runs nox, since the
    suite is 3.11's; not a default session. Fails only if a test of public behaviour fails;
    e.g. ``nox -s compat -- -k test_traceback --tracebacks``.
    """
    session.install(".")
    session.run("python", "tests/compat/run_cpython_suite.py", *session.posargs)
