"""Development sessions: ``nox`` runs tests, lint, typecheck and docs; ``nox -s demo`` the demo,
``nox -s clients`` the tests with real third-party clients (scipy, dask), ``nox -s matrix``
the tests on every supported Python and on the oldest dependencies, ``nox -s compat``
CPython's own ProcessPoolExecutor tests against ours.

Each session installs what it needs into its own virtual environment (made with the
standard library's ``venv``, so neither uv nor virtualenv is required) under the Python
that runs nox, except the sessions named after a Python (``tests-3.12``, ``compat-3.13``):
those take that Python from pyenv (``$PYENV_ROOT``, else ``~/.pyenv``), or else from
``PATH`` (``python3.12``). A Python that is found nowhere fails its session, naming it: it
is never skipped. Arguments after ``--`` go to the session's command, e.g.
``nox -s tests -- -x -k transport`` or ``nox -s demo -- --size-mb 64``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck", "docs"]
# A session whose Python is missing fails (nox would skip it outside CI), and nox never
# downloads a Python of its own.
nox.options.error_on_missing_interpreters = True
nox.options.download_python = "never"

ROOT = Path(__file__).parent
# What lint covers; the folders are skipped while they hold no Python file.
LINT_PATHS = ["sharexec", "tests", "noxfile.py", "examples", "bench", "docs/conf.py"]

# The Pythons sharexec supports: the README's support policy, pyproject.toml's classifiers.
PYTHONS = ["3.11", "3.12", "3.13"]
# The runtime dependencies (pyproject.toml's `dependencies`), each pinned `name>=oldest`.
RUNTIME = ["numpy", "loky", "cloudpickle"]
# What a matrix session prints before its tests: what it tests.
SHOW_VERSIONS = (
    "import sys, numpy, loky, cloudpickle; "
    "print('Python', sys.version.split()[0], '/ numpy', numpy.__version__, "
    "'/ loky', loky.__version__, '/ cloudpickle', cloudpickle.__version__)"
)


def _present(paths: list[str]) -> list[str]:
    found = []
    for name in paths:
        path = ROOT / name
        if path.is_file() or (path.is_dir() and any(path.rglob("*.py"))):
            found.append(name)
    return found


def _python(version: str) -> str:
    """The interpreter for ``version`` ("3.12"): pyenv's newest 3.12.N, else "3.12" itself.

    nox looks for a bare version on ``PATH`` (``python3.12``) and fails the session with
    "Python interpreter 3.12 not found" if it is not there either.
    """
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = []
    for folder in (root / "versions").glob(f"{version}.*"):
        patch = folder.name[len(version) + 1 :]
        python = folder / "bin" / "python"
        if patch.isdigit() and python.is_file():  # not 3.13.0t, 3.12-dev, ...
            found.append((int(patch), str(python)))
    return max(found)[1] if found else version


def _oldest_pins() -> list[str]:
    """``numpy==2.0``, ... : the lower bound of each runtime dependency in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    pins = []
    for name in RUNTIME:
        found = re.search(rf'^\s*"{name}>=([0-9.]+)[,"]', text, re.MULTILINE)
        if found is None:
            raise ValueError(f"pyproject.toml gives {name} no lower bound (>=)")
        pins.append(f"{name}=={found.group(1)}")
    return pins


def _run_suite(session: nox.Session, *pins: str) -> None:
    """Install sharexec with its test extra (and ``pins``), say what is tested, run pytest."""
    session.install(".[test]", *pins)
    session.run("python", "-c", SHOW_VERSIONS, silent=False)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (``python -m pytest``) against an installed sharexec."""
    session.install(".[test]")
    session.run("python", "-m", "pytest", *session.posargs)


def _tests_on(version: str) -> None:
    """Define the session ``tests-<version>``."""

    def run(session: nox.Session) -> None:
        _run_suite(session)

    run.__doc__ = (
        f"Run the test suite on Python {version}, with the newest dependencies it gets.\n\n"
        "The newest releases that pyproject.toml's pins admit and that support this Python: "
        "what a user installing sharexec on it gets today."
    )
    nox.session(run, name=f"tests-{version}", python=_python(version), default=False)


for _version in PYTHONS:
    _tests_on(_version)


@nox.session(name="tests-oldest", python=_python(PYTHONS[0]), default=False)
def tests_oldest(session: nox.Session) -> None:
    """Run the test suite on Python 3.11 with the oldest dependencies the pins admit.

    numpy, loky and cloudpickle at pyproject.toml's lower bounds, read from it
    (``numpy>=2.0`` gives ``numpy==2.0``, i.e. 2.0.0), on the oldest supported Python,
    which each of them supports.
    """
    _run_suite(session, *_oldest_pins())


@nox.session(
    python=False, requires=[*(f"tests-{v}" for v in PYTHONS), "tests-oldest"], default=False
)
def matrix(session: nox.Session) -> None:
    """Run ``tests-3.11`` ... ``tests-3.13`` and ``tests-oldest``; fails if any failed."""
    session.log("every Python and the oldest dependencies: passed")


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

    Installs the ``bench`` extra (joblib, mpire, psutil, matplotlib, ...). Takes several
    minutes; e.g. ``nox -s bench -- --scale 0.25 --reps 3`` for a quicker run.
    """
    session.install(".[bench]")
    session.run("python", "bench/run.py", *session.posargs)


@nox.session(name="bench-real", default=False)
def bench_real(session: nox.Session) -> None:
    """Run real programs with sharexec and the standard library (``bench/real_programs.py``).

    Installs the ``bench`` extra (the programs use SciPy, scikit-image and numba). Each
    program runs in a fresh process per repetition, with each executor's defaults and
    the standard library under forkserver; then the first pool of a process. About ten
    minutes; e.g. ``nox -s bench-real -- --programs images,jit --reps 5``, or ``-- --json
    docs/bench-real-results.json`` then ``python bench/render.py`` to publish a run.
    """
    session.install(".[bench]")
    session.run("python", "bench/real_programs.py", *session.posargs)


@nox.session(name="bench-cluster", default=False)
def bench_cluster(session: nox.Session) -> None:
    """The cluster executor beside plain and expert Dask (``bench/cluster_bench.py``).

    Installs the ``dask`` and ``bench`` extras; e.g. ``nox -s bench-cluster -- --scale
    0.25``; ``-- --json docs/cluster-bench.json``, then ``-- --render``, publishes a run
    in the docs.
    """
    session.install(".[dask,bench]")
    session.run("python", "bench/cluster_bench.py", *session.posargs)


@nox.session(name="bench-torch", python=_python("3.11"), default=False)
def bench_torch(session: nox.Session) -> None:
    """Run the tensor benchmark (``bench/torch_bench.py``): sharexec against the standard
    library's executor and ``torch.multiprocessing.Pool``; not a default session.

    Under Python 3.11, with the ``bench`` and ``torch`` extras: torch 2.13, the version CI
    tests (on these machines a CPU build on local disk, for Python 3.11 only); e.g.
    ``nox -s bench-torch -- --reps 9``.
    """
    session.install(".[bench,torch]")
    session.run("python", "bench/torch_bench.py", *session.posargs)


# The Pythons whose own test_concurrent_futures nox -s compat runs.
COMPAT_PYTHONS = ["3.11", "3.13"]


def _compat_on(version: str) -> None:
    """Define the session ``compat-<version>``."""

    def run(session: nox.Session) -> None:
        session.install(".")
        session.run("python", "tests/compat/run_cpython_suite.py", *session.posargs)

    where = (
        "the suite fetched at run time from Debian's libpython3.11-testsuite (apt-get) "
        "into ``.cache/cpython-tests/``"
        if version == "3.11"
        else f"the package ``test.test_concurrent_futures`` that Python {version} ships"
    )
    run.__doc__ = (
        f"Run CPython {version}'s own ProcessPoolExecutor tests against ours.\n\n"
        f"``tests/compat/run_cpython_suite.py`` under Python {version}, with {where}."
    )
    nox.session(run, name=f"compat-{version}", python=_python(version), default=False)


for _version in COMPAT_PYTHONS:
    _compat_on(_version)


@nox.session(python=False, requires=[f"compat-{v}" for v in COMPAT_PYTHONS], default=False)
def compat(session: nox.Session) -> None:
    """Run CPython 3.11's and 3.13's own ProcessPoolExecutor tests against ours.

    ``tests/compat/run_cpython_suite.py``, in ``compat-3.11`` and ``compat-3.13``: the
    fork, forkserver and spawn variants of each Python's ``test_concurrent_futures``,
    under that Python (3.11's from Debian's libpython3.11-testsuite, via apt-get; 3.13's
    as pyenv's Python ships it). Not a default session. Each fails only if a test of
    public behaviour fails; e.g. ``nox -s compat -- -k test_traceback --tracebacks``.
    """
    session.log("CPython's own ProcessPoolExecutor tests, public behaviour: passed")


# The fault suite: what docs/reliability.md reports.
FAULT_TESTS = [
    "tests/test_faults.py",
    "tests/test_stress.py",
    "tests/test_errors.py",
    "tests/test_roundtrip.py",
]


# What `nox -s container` runs in a 64 MB /dev/shm: the transport tests (under the
# default start method and spawn, as everywhere), the fault tests' kills, crashes and
# fallbacks (under every method), and the container's own scenarios.
CONTAINER_TESTS = ["tests/test_transport.py", "tests/test_faults.py", "tests/test_container.py"]
CONTAINER_SELECTION = (
    "not test_faults or kill or dies or dead or frozen or small_dev_shm or no_room "
    "or out_of_descriptors or nested"
)


@nox.session(default=False)
def container(session: nox.Session) -> None:
    """Run the transport and fault tests as in a default container: pytest in a private
    mount namespace whose /dev/shm is a 64 MB tmpfs (Docker's and Kubernetes' default),
    where what does not fit goes to anonymous shared memory. Needs root and ``unshare``
    (fails without: it would test nothing). E.g. ``nox -s container -- -x``. Prints how
    long the tests took.
    """
    import os
    import shutil
    import time

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        session.error("nox -s container needs root and unshare (a private mount namespace)")
    session.install(".[test]")
    mount = 'mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm && exec "$0" "$@"'
    started = time.monotonic()
    session.run(
        *["unshare", "--mount", "--propagation", "private", "sh", "-c", mount],
        *["python", "-m", "pytest", *CONTAINER_TESTS, "-k", CONTAINER_SELECTION],
        *session.posargs,
        external=True,
    )
    session.log(f"the container's tests took {time.monotonic() - started:.0f} s")


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
