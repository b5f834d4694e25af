"""Development sessions: ``nox`` runs tests, lint, typecheck and docs; ``nox -s demo`` the demo,
``nox -s clients`` the tests with real third-party clients (scipy, dask), ``nox -s compat``
runs CPython's own ProcessPoolExecutor tests against ours.

Each session installs what it needs into its own virtual environment (made with the
standard library's ``venv``, so neither uv nor virtualenv is required) under the Python
that runs nox. Arguments after ``--`` go to the session's command, e.g.
``nox -s tests -- -x -k transport`` or ``nox -s demo -- --size-mb 64``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck", "docs"]

ROOT = Path(__file__).parent
# What lint covers; the folders are skipped while they hold no Python file.
LINT_PATHS = ["sharexec", "tests", "noxfile.py", "examples", "bench", "docs/conf.py"]


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
    """Check style and formatting with ruff, and the package's layers with import-linter.

    Both are configured in pyproject.toml: ruff's rules, and the layers of
    docs/design.md (``lint-imports``: every import, function-level ones included,
    points down the layers).
    """
    session.install("ruff>=0.6", "import-linter>=2.1", ".")
    paths = _present(LINT_PATHS)
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
    session.run("lint-imports")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Type-check the package with ``mypy --strict``."""
    session.install(".", "mypy>=1.10")
    session.run("mypy", "--strict", "sharexec")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation into ``docs/_build/html``, with warnings as errors.

    Installs the ``docs`` extra. Starts from a clean slate (what a previous build
    generated is removed) and runs every example, for the gallery. Links into the Python
    and NumPy docs need the network: ``SHAREXEC_DOCS_INTERSPHINX=1 nox -s docs``.
    """
    session.install(".[docs]")
    for generated in ("_build", "generated", "auto_examples", "sg_execution_times.rst"):
        path = ROOT / "docs" / generated
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    session.run(
        "sphinx-build",
        "-W",
        "--keep-going",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )


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


@nox.session(name="bench-torch", default=False)
def bench_torch(session: nox.Session) -> None:
    """Run the tensor benchmark (``bench/torch_bench.py``): sharexec against the standard
    library's executor and ``torch.multiprocessing.Pool``; not a default session.

    Installs torch 2.13.0, the version CI tests (on these machines a CPU build on local
    disk, for Python 3.11); e.g. ``nox -s bench-torch -- --reps 9``.
    """
    session.install(".[bench]", "torch==2.13.0")
    session.run("python", "bench/torch_bench.py", *session.posargs)


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


# The fault suite of issue 4: what docs/reliability.md reports.
FAULT_TESTS = [
    "tests/test_faults.py",
    "tests/test_stress.py",
    "tests/test_errors.py",
    "tests/test_roundtrip.py",
]


@nox.session(default=False)
def faults(session: nox.Session) -> None:
    """Run the fault suite and print its table; fails unless every count is zero.

    ``tests/test_faults.py``, ``test_stress.py``, ``test_errors.py`` and
    ``test_roundtrip.py``, slow tests included (the >4 GiB round trip: several GB of
    memory and minutes). ``tests/faults_plugin.py`` records each test's outcome;
    ``tests/faults_report.py`` prints the table (scenario, runs, segments leaked,
    crashes, wrong results), also written to ``.nox/faults/tmp/faults.md``. As root with
    ``unshare``, pytest runs with a /dev/shm of its own (a private mount namespace), so
    that segments of other programs on the machine never count as leaks. Not a default
    session; e.g. ``nox -s faults -- -k "stress or sigkill"``.
    """
    import datetime
    import os
    import shutil
    import time

    session.install(".[test]")
    tmp = Path(session.create_tmp())
    report = tmp / "faults.jsonl"
    report.unlink(missing_ok=True)
    command = ["python", "-m", "pytest", "-m", "", *FAULT_TESTS, *session.posargs]
    private_shm = os.geteuid() == 0 and shutil.which("unshare") is not None
    if private_shm:
        mount = 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$0" "$@"'
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, *command]
    load_before, started = os.getloadavg()[0], time.monotonic()
    session.run(
        *command,
        env={"SHAREXEC_FAULTS_REPORT": str(report)},
        success_codes=list(range(6)),  # the report judges; pytest's status is in it
        external=True,
    )
    minutes = (time.monotonic() - started) / 60
    title = (
        f"{datetime.date.today()}, {len(os.sched_getaffinity(0))} CPUs, load average "
        f"{load_before:.1f} before and {os.getloadavg()[0]:.1f} after, {minutes:.1f} min, "
        f"{'a private' if private_shm else 'the shared'} /dev/shm"
    )
    session.run(
        "python",
        "tests/faults_report.py",
        str(report),
        "--output",
        str(tmp / "faults.md"),
        "--title",
        title,
    )
