"""Run CPython 3.11's and 3.13's ProcessPoolExecutor tests against SharedProcessPoolExecutor.

The drop-in yardstick: CPython's ``test_concurrent_futures``, run with
:class:`sharexec.SharedProcessPoolExecutor` in place of
:class:`concurrent.futures.ProcessPoolExecutor`, passes every test of public behaviour.
This is a plain script (``nox -s compat`` runs it, under Python 3.11 and under 3.13), not
a pytest module. The suite run is the running Python's own: 3.11's, a single module, or
3.13's, a package since 3.12 (``test_process_pool``, ``test_shutdown``, ``test_wait``...).

Where the test code comes from
    Never from this repository. Python 3.13 (and any Python from 3.12 on that ships its
    test suite, as pyenv's builds do): the package ``test.test_concurrent_futures`` of
    the running interpreter, imported where the interpreter has it, with its own
    ``test.support``. Python 3.11: at run time, Debian's ``libpython3.11-testsuite`` package
    (``apt-get download``, then ``dpkg -x``) gives ``test_concurrent_futures.py``; when the
    running Python lacks a complete ``test.support``, ``libpython3.11-stdlib`` gives that.
    Both are unpacked once under ``.cache/cpython-tests/`` (git-ignored). ``--test-file``
    takes a local copy instead, e.g. ``Lib/test/test_concurrent_futures.py`` of a CPython
    3.11 checkout. The package ``test`` then seen by the tests (and by their workers and
    scripts) is an overlay, ``.cache/cpython-tests/overlay/test``, whose ``__path__`` is
    that file's folder followed by the folder of a complete ``test.support``.

How our class takes the stdlib's place, inside the loaded test modules only
    - ``ProcessPool{Fork,Forkserver,Spawn}Mixin.executor_type`` become our class: every
      ``self.executor`` and ``self.executor_type(...)`` of the process-pool tests (the
      mixins live in the 3.11 module itself, in ``util`` of the 3.13 package);
    - each module's global ``futures`` (``concurrent.futures``) becomes a view of that
      package whose ``ProcessPoolExecutor`` is ours, for the tests that name the class;
    - the scripts that tests run in a fresh interpreter (``assert_python_ok``) import our
      class ``from sharexec`` where they import it ``from concurrent.futures``.
    Nothing in sharexec or in ``concurrent.futures`` itself is patched.

Isolation and time
    Each test class (one per start method) runs in a child process of its own session,
    one test at a time under ``faulthandler.dump_traceback_later(timeout, exit=True)``: a
    test that hangs is dumped, counted as an error, and its class goes on in a new child
    from the next test (as it does when a child dies between two tests). As regrtest
    does, a test that leaves ``sys.stdout`` or ``sys.stderr`` replaced has them put back
    before the next one. Whatever a child leaves behind in its process group is killed and
    reported. Once the run's budget is spent no test is started: the rest count as errors.

Public and private
    A test is *private* when its own body reads an underscore attribute of an executor
    (``self.executor._processes``, ``e._processes``, ``executor._mp_context``...) or of
    ``concurrent.futures`` (``futures.process._RemoteTraceback``): it checks how the
    standard library is built, not how it behaves. Every other test is *public*. Only a
    public test that fails or errors makes the exit status non-zero (1); 2 means the run
    could not be set up. A private test can hide a public failure behind its private
    read: ``--alias-private`` gives our class the names ``_broken`` and ``_mp_context``
    (from loky's equivalents) so that such tests reach their public checks.

Usage::

    python tests/compat/run_cpython_suite.py                  # all of it, a few minutes
    python tests/compat/run_cpython_suite.py -k test_traceback --start-method spawn
    python tests/compat/run_cpython_suite.py ProcessPoolForkProcessPoolExecutorTest.test_map
    python3.13 tests/compat/run_cpython_suite.py test_process_pool  # one module of 3.13's
    python tests/compat/run_cpython_suite.py --list           # tests and their category
    python tests/compat/run_cpython_suite.py --stdlib         # control run: the stdlib's class
    python tests/compat/run_cpython_suite.py --alias-private  # do private tests hide failures?
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import fnmatch
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parents[2]
DEFAULT_CACHE = ROOT / ".cache" / "cpython-tests"
SUITE = "test.test_concurrent_futures"
# The Pythons whose suite this runs: 3.11's, a module fetched from Debian, and, from 3.12 on,
# the package the running interpreter ships (expected private tests are written out for
# 3.13's; another version runs, with notes on what differs).
DEBIAN_PYTHON = (3, 11)
PACKAGE_PYTHONS = (3, 12)  # and later
TESTSUITE_PACKAGE = "libpython3.11-testsuite"  # holds test/test_concurrent_futures.py
STDLIB_PACKAGE = "libpython3.11-stdlib"  # holds test/support/
DEB_TEST_DIR = Path("usr/lib/python3.11/test")

# Start method -> the module's mixin that makes the ProcessPoolExecutor variant of a test
# body (create_executor_tests crosses each body with these mixins, and with ThreadPoolMixin,
# whose classes are not ours to run).
MIXINS = {
    "fork": "ProcessPoolForkMixin",
    "forkserver": "ProcessPoolForkserverMixin",
    "spawn": "ProcessPoolSpawnMixin",
}

# Where our class is imported from in the scripts of assert_python_ok.
IMPORT_FROM = "sharexec"

# Time limits. A run takes at most about budget + timeout + STALL_GRACE, plus the setup:
# under 10 minutes with the defaults, on 2 cores, however the tests hang.
DEFAULT_TIMEOUT = 45.0  # per test; the deadlock tests wait support.SHORT_TIMEOUT (30 s)
DEFAULT_BUDGET = 420.0  # per run: no test starts after (a normal run takes about 5 minutes)
EXIT_TIMEOUT = 20.0  # for a child to exit once its tests are done
STALL_GRACE = 30.0  # a child silent for timeout + this is killed (its watchdog failed)


class SetupError(Exception):
    """The run could not be prepared (no apt-get, no package, wrong Python...)."""


def log(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------
# Fetching the test code: Debian packages, unpacked into the cache, and the overlay
# ---------------------------------------------------------------------------------------

OVERLAY_INIT = '''\
"""The package ``test`` as tests/compat/run_cpython_suite.py shows it to the suite.

Generated: test_concurrent_futures.py lives here; test.support and the rest come from
the folders after this one.
"""

__path__ = {path!r}
'''


@dataclass
class Sources:
    # Put first on sys.path: its package `test` holds the suite (3.11). None: the suite is
    # the running interpreter's own (3.12 and later), found where it ships it.
    overlay: Path | None
    test_file: str  # where the suite came from, for the header
    support: Path  # the folder of the complete test.support used


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def _unpack_deb(package: str, dest: Path, debs: Path) -> str:
    """Download Debian's ``package`` and unpack it into ``dest``, once; return the .deb name."""
    done = dest / ".unpacked-from"
    if done.exists():
        return done.read_text().strip()
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise SetupError(
                f"{tool} is needed to fetch Debian's {package}; elsewhere, pass "
                "--test-file with a CPython 3.11 Lib/test/test_concurrent_futures.py"
            )
    debs.mkdir(parents=True, exist_ok=True)
    for old in debs.glob(f"{package}_*.deb"):
        old.unlink()
    log(f"fetching {package} (apt-get download)")
    got = _run(["apt-get", "download", package], cwd=debs)
    if got.returncode != 0:
        # No package lists yet, or stale ones: refresh them once, then try again.
        log(f"apt-get download {package} failed; running apt-get update once")
        _run(["apt-get", "update"])
        got = _run(["apt-get", "download", package], cwd=debs)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if got.returncode != 0 or not found:
        raise SetupError(f"apt-get download {package} failed:\n{got.stderr.strip()}")
    shutil.rmtree(dest, ignore_errors=True)
    unpacked = _run(["dpkg", "-x", str(found[-1]), str(dest)])
    if unpacked.returncode != 0:
        raise SetupError(f"dpkg -x {found[-1].name} failed:\n{unpacked.stderr.strip()}")
    done.write_text(found[-1].name + "\n")
    return found[-1].name


def _support_folder(cache: Path) -> Path:
    """The folder of a complete package ``test`` (with test.support.script_helper)."""
    probe = _run(
        [
            sys.executable,
            "-c",
            "import test.support, test.support.script_helper; print(test.__path__[0])",
        ],
        cwd=cache,
    )
    if probe.returncode == 0:
        return Path(probe.stdout.strip().splitlines()[-1])
    log(f"this Python has no complete test.support; using Debian's {STDLIB_PACKAGE}")
    _unpack_deb(STDLIB_PACKAGE, cache / "stdlib", cache / "debs")
    return cache / "stdlib" / DEB_TEST_DIR


def _own_suite(cache: Path) -> Sources:
    """The running interpreter's own package ``test.test_concurrent_futures`` (3.12+)."""
    probe = _run(
        [
            sys.executable,
            "-c",
            "import importlib.util, test.support.script_helper as h, test.support as s; "
            f"spec = importlib.util.find_spec({SUITE!r}); "
            "print(spec.submodule_search_locations[0] if spec and "
            "spec.submodule_search_locations else ''); print(s.__path__[0])",
        ],
        cwd=cache,
    )
    lines = probe.stdout.strip().splitlines()
    if probe.returncode != 0 or len(lines) != 2 or not lines[0]:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        raise SetupError(
            f"Python {sys.version.split()[0]} ({sys.executable}) does not ship the package "
            f"{SUITE} with a complete test.support (a build without its test suite? "
            f"Debian's is in libpython{version}-testsuite):\n{probe.stderr.strip()}"
        )
    return Sources(
        overlay=None,
        test_file=f"{lines[0]} (Python {sys.version.split()[0]}'s own)",
        support=Path(lines[1]),
    )


def prepare_sources(cache: Path, test_file: Path | None) -> Sources:
    """Fetch what is missing into ``cache`` and (re)build the overlay package ``test``.

    From Python 3.12 on, nothing is fetched: the suite is the interpreter's own.
    """
    version = sys.version_info[:2]
    cache.mkdir(parents=True, exist_ok=True)
    if version >= PACKAGE_PYTHONS:
        if test_file is not None:
            raise SetupError(
                "--test-file is for Python 3.11's single-file suite; from 3.12 on, the "
                "suite is the running interpreter's own package"
            )
        return _own_suite(cache)
    if version != DEBIAN_PYTHON:
        raise SetupError(
            f"the suites run are CPython 3.11's and those of 3.12 and later; this is "
            f"Python {sys.version.split()[0]} ({sys.executable})"
        )
    if test_file is None:
        deb = _unpack_deb(TESTSUITE_PACKAGE, cache / "testsuite", cache / "debs")
        test_file = cache / "testsuite" / DEB_TEST_DIR / "test_concurrent_futures.py"
        origin = f"{deb} (Debian)"
    else:
        test_file = test_file.resolve()
        origin = str(test_file)
    if not test_file.is_file():
        raise SetupError(f"no test file at {test_file}")
    support = _support_folder(cache)
    overlay = cache / "overlay"
    package = overlay / "test"
    shutil.rmtree(overlay, ignore_errors=True)
    package.mkdir(parents=True)
    shutil.copyfile(test_file, package / "test_concurrent_futures.py")
    init = OVERLAY_INIT.format(path=[str(package), str(support)])
    (package / "__init__.py").write_text(init)
    return Sources(overlay=overlay, test_file=origin, support=support)


# ---------------------------------------------------------------------------------------
# Loading the suite with our class in place of the stdlib's (in a child process)
# ---------------------------------------------------------------------------------------


# What takes the place of the stdlib's class (``--stdlib``, ``--alias-private``).
MODES = ("ours", "stdlib", "aliased")

# --alias-private: the stdlib's private names that the private tests read, on a subclass of
# ours, as loky's equivalents. A diagnostic only: it shows whether a private test would
# pass but for the name, i.e. whether it hides a failure of public behaviour.
ALIASES = {
    "_broken": lambda self: self._flags.broken,
    "_mp_context": lambda self: self._context,
}


def load_suite(overlay: Path | None, mode: str) -> Any:
    """Import the suite, with our class in place of the stdlib's (``mode``).

    From ``overlay`` (3.11), or from where the interpreter ships it (``None``). A package
    suite (3.12+) has each of its modules imported, so that ``loadTestsFromName`` finds
    ``test_shutdown.SomeTest.test_x`` under it.
    """
    if overlay is not None:
        if "test" in sys.modules:
            raise SetupError("the package `test` is already imported: the overlay cannot apply")
        sys.path.insert(0, str(overlay))  # spawned workers inherit sys.path, hence `test` too
    import concurrent.futures
    import importlib
    import pkgutil
    import types

    from test import support

    support.verbose = 0  # as regrtest sets it (the module's default is 1)
    module = importlib.import_module(SUITE)
    if hasattr(module, "__path__"):
        for info in pkgutil.iter_modules(module.__path__):
            importlib.import_module(f"{SUITE}.{info.name}")
    modules = suite_modules(module)
    rewrites = {}
    if mode != "stdlib":
        from sharexec import SharedProcessPoolExecutor as executor

        if mode == "aliased":
            names = {name: property(get) for name, get in ALIASES.items()}
            executor = type(executor.__name__, (executor,), names)

        class FuturesView(types.ModuleType):
            """``concurrent.futures`` as the suite sees it: ``ProcessPoolExecutor`` is ours."""

            def __getattr__(self, name: str) -> Any:
                return getattr(concurrent.futures, name)

        view = FuturesView("concurrent.futures")
        view.ProcessPoolExecutor = executor  # type: ignore[attr-defined]
        for mixin in suite_mixins(modules).values():
            mixin.executor_type = executor
        for each in modules:
            if getattr(each, "futures", None) is concurrent.futures:
                each.futures = view
        old = f"from concurrent.futures import {executor.__name__}"
        rewrites[old] = f"from {IMPORT_FROM} import {executor.__name__}"

    # The scripts run in isolated mode (-I): they find the overlay through this line.
    prelude = "" if overlay is None else f"import sys; sys.path.insert(0, {str(overlay)!r})\n"

    def rewritten(run_script: Any) -> Any:
        def assert_python_ok(*args: Any, **env_vars: Any) -> Any:
            if len(args) >= 2 and args[0] == "-c":
                code = args[1]
                for old, new in rewrites.items():
                    code = code.replace(old, new)
                args = ("-c", prelude + code, *args[2:])
            return run_script(*args, **env_vars)

        return assert_python_ok

    for each in modules:
        if hasattr(each, "assert_python_ok"):
            each.assert_python_ok = rewritten(each.assert_python_ok)
    return module


def suite_modules(module: Any) -> list[Any]:
    """The suite's modules: the module itself (3.11), or each module of the package."""
    if not hasattr(module, "__path__"):
        return [module]
    prefix = module.__name__ + "."
    return [m for name, m in sorted(sys.modules.items()) if name.startswith(prefix)]


def suite_mixins(modules: list[Any]) -> dict[str, type]:
    """Start method -> the suite's mixin for it (in the 3.11 module; in 3.13's ``util``)."""
    found = {}
    for method, name in MIXINS.items():
        holders = [getattr(m, name) for m in modules if isinstance(getattr(m, name, None), type)]
        if not holders:
            raise SetupError(f"the suite defines no {name}")
        found[method] = holders[0]  # the modules that import it hold the same class
    return found


# Tests of the process pool that are not crossed with the mixins: class -> {test: method}.
# 3.13's FailingInitializerResourcesTest runs the spawn and forkserver variants of
# test_initializer (one of each), then checks that the stdlib's resource tracker stops
# with exit code 0: nothing leaked in it.
RUN_ALSO = {
    "test_init.FailingInitializerResourcesTest": {
        "test_spawn": "spawn",
        "test_forkserver": "forkserver",
    },
}


def short_name(cls: type) -> str:
    """A test class's name in test ids: ``Class`` (3.11), ``test_module.Class`` (3.12+)."""
    module = cls.__module__
    return cls.__qualname__ if module == SUITE else f"{module[len(SUITE) + 1 :]}.{cls.__name__}"


def process_pool_classes(module: Any) -> dict[str, tuple[type, dict[str, str]]]:
    """The suite's ProcessPoolExecutor test classes: name -> (class, {test: start method})."""
    import unittest

    modules = suite_modules(module)
    mixins = suite_mixins(modules)
    loader = unittest.TestLoader()
    found = {}
    for each in modules:
        for obj in vars(each).values():
            if not (isinstance(obj, type) and issubclass(obj, unittest.TestCase)):
                continue
            if obj.__module__ != each.__name__:
                continue  # imported from another module of the suite
            name = short_name(obj)
            for method, mixin in mixins.items():
                if issubclass(obj, mixin):
                    found[name] = (obj, dict.fromkeys(loader.getTestCaseNames(obj), method))
            if name in RUN_ALSO:
                found[name] = (obj, RUN_ALSO[name])
    return dict(sorted(found.items()))


# ---------------------------------------------------------------------------------------
# Public or private: what a test's own body reads
# ---------------------------------------------------------------------------------------

# The names under which the suite's test bodies hold an executor.
EXECUTOR_NAMES = re.compile(r"(self\.)?(executor|e|pool|workers)")
# The names under which they reach concurrent.futures' modules.
STDLIB_NAMES = {"futures", "futures.process", "futures._base", "futures.thread"}

# What the scan finds in the 3.11 suite, written out for the reader (the scan decides; a
# test here that the scan no longer finds, or the reverse, is reported as a note):
EXPECTED_PRIVATE_3_11 = {
    # Waits until `self.executor._broken` is set.
    "FailingInitializerMixin.test_initializer": "_broken",
    # Count or join the workers through `_processes`, join the `_executor_manager_thread`,
    # `_call_queue.join_thread()`.
    "ProcessPoolShutdownTest.test_processes_terminate": "_processes",
    "ProcessPoolShutdownTest.test_context_manager_shutdown": "_processes",
    "ProcessPoolShutdownTest.test_del_shutdown": "_executor_manager_thread, _processes, ...",
    "ProcessPoolShutdownTest.test_shutdown_no_wait": "_executor_manager_thread, _processes, ...",
    "ProcessPoolExecutorTest.test_killed_child": "_processes (to pick the worker to kill)",
    "ProcessPoolExecutorTest.test_traceback": "futures.process._RemoteTraceback (cause's type)",
    "ProcessPoolExecutorTest.test_saturation": "_max_workers, _processes",
    "ProcessPoolExecutorTest.test_idle_process_reuse_one": "_max_workers, _processes",
    "ProcessPoolExecutorTest.test_idle_process_reuse_multiple": "_max_workers, _processes",
    "ProcessPoolExecutorTest.test_max_tasks_per_child": "_processes",
    "ProcessPoolExecutorTest.test_max_tasks_per_child_defaults_to_spawn_context": "_mp_context",
    "ExecutorDeadlockTest.test_shutdown_deadlock_pickle": "_executor_manager_thread",
}
# Not private although an underscore shows: test_cancel_futures formats `fut._state` (a
# Future's) into an assertion message; the deadlock tests' _fail_on_deadlock reads
# `_processes` only once a test has already failed.
EXPECTED_PRIVATE = {
    (3, 11): EXPECTED_PRIVATE_3_11,
    # The same bodies (now in test_init, test_shutdown, test_process_pool, test_deadlock),
    # and three more.
    (3, 13): {
        **EXPECTED_PRIVATE_3_11,
        # Runs FailingInitializerMixin.test_initializer (which waits on `_broken`), then
        # checks that multiprocessing's resource tracker exits with 0. When the inner test
        # stops at its private read, the executor it made is torn down mid-test and the
        # tracker reports it: the outer outcome is the inner private read's (with
        # --alias-private, both pass). Reading the tracker's own `_stop()`/`_exitcode` is
        # not an executor's private name.
        "FailingInitializerResourcesTest.test_spawn": "_broken, through test_initializer",
        "FailingInitializerResourcesTest.test_forkserver": "_broken, through test_initializer",
        # Patches `futures.process._ExecutorManagerThread.run`, the stdlib's own thread.
        "ExecutorDeadlockTest.test_gh105829_should_not_deadlock_if_wakeup_pipe_full": (
            "futures.process._ExecutorManagerThread"
        ),
    },
}


# Public tests whose stdlib behaviour sharexec changes on purpose, each with how it fails
# (the first line of the failure must start so) and why. Reported in a column of their own;
# failing any other way counts as a public failure, and passing is a note (the deviation
# is gone: update this table and the docs).
DEVIATIONS = {
    # Its argument raises UnpicklingError when the worker rebuilds it. The stdlib breaks the
    # pool (BrokenProcessPool for this and every other future); sharexec fails only this
    # future, with the worker's error, and the pool goes on, as it already did for a result
    # that fails to rebuild (docs/migration/from-processpoolexecutor.md).
    "ExecutorDeadlockTest.test_error_at_task_unpickle": "_pickle.UnpicklingError",
}


def private_reads(test_class: type, method: str) -> list[str]:
    """The underscore attributes of an executor or of concurrent.futures that a test reads.

    The scan reads the test's own body (not its class's helpers: the deadlock tests'
    ``_fail_on_deadlock`` reads ``_processes`` only once a test has already failed). It
    also finds the tests a test runs itself: a test class of the suite named in its body
    or in a helper it calls (``self._test(...)``), instantiated with a test's name
    (``test_class('test_initializer')``), brings the private reads of that test, since its
    outcome decides this one's.
    """
    module = sys.modules[test_class.__module__]
    bodies = [(getattr(test_class, method), True)]
    reads: set[str] = set()
    classes: set[type] = set()
    names: set[str] = set()
    while bodies:
        body, own = bodies.pop()
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(body)))):
            if isinstance(node, ast.Attribute) and own and _is_private(node):
                reads.add(f"{ast.unparse(node.value)}.{node.attr}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func).startswith("self._"):
                helper = getattr(test_class, ast.unparse(node.func)[len("self.") :], None)
                if inspect.isfunction(helper):
                    bodies.append((helper, False))
            elif isinstance(node, ast.Name):
                named = getattr(module, node.id, None)
                if isinstance(named, type) and named is not test_class:
                    classes.add(named)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        for name in sorted(n for n in names if n.startswith("test_") and hasattr(cls, n)):
            body = getattr(cls, name).__qualname__
            reads |= {f"{read} (in {body}, which it runs)" for read in private_reads(cls, name)}
    return sorted(reads)


def _is_private(node: ast.Attribute) -> bool:
    """Whether ``node`` reads an underscore attribute of an executor or of the stdlib."""
    if not node.attr.startswith("_") or node.attr.startswith("__"):
        return False
    base = ast.unparse(node.value)
    return bool(EXECUTOR_NAMES.fullmatch(base)) or base in STDLIB_NAMES


def _overlay_args(sources: Sources) -> list[str]:
    return [] if sources.overlay is None else ["--overlay", str(sources.overlay)]


def discover(sources: Sources) -> list[dict[str, Any]]:
    """List the tests in a child process (so this one never imports the suite)."""
    got = _run([sys.executable, str(SCRIPT), "--child-discover", *_overlay_args(sources)])
    if got.returncode != 0:
        raise SetupError(f"could not load {SUITE}:\n{got.stdout}{got.stderr}")
    tests: list[dict[str, Any]] = json.loads(got.stdout.strip().splitlines()[-1])
    return tests


def child_discover(overlay: Path | None) -> None:
    module = load_suite(overlay, "stdlib")
    tests = []
    for name, (cls, methods) in process_pool_classes(module).items():
        for test, method in methods.items():
            tests.append(
                {
                    "id": f"{name}.{test}",
                    "cls": name,
                    "name": test,
                    "body": getattr(cls, test).__qualname__,  # e.g. WaitTests.test_20369
                    "start_method": method,
                    "private": private_reads(cls, test),
                }
            )
    print(json.dumps(tests))


# ---------------------------------------------------------------------------------------
# The child: runs some tests of one class, reporting each as a JSON line
# ---------------------------------------------------------------------------------------


def child_run(
    overlay: Path | None, mode: str, events: Path, timeout: float, deadline: float, ids: list[str]
) -> None:
    import faulthandler
    import unittest

    module = load_suite(overlay, mode)
    out = events.open("a", buffering=1)
    # The watchdog writes to the real stderr (the log), whatever a test does to sys.stderr:
    # 3.11's _raise_error_ignore_stderr, unpickled in the parent by
    # test_error_during_result_unpickle_in_result_handler, replaces it for good when the
    # result arrives before the test's captured_stderr() begins (a race the load on the
    # machine decides), and dump_traceback_later() then fails: sys.stderr has no fileno.
    watchdog = sys.__stderr__
    streams = sys.stdout, sys.stderr

    def emit(**event: Any) -> None:
        event["time"] = time.time()
        out.write(json.dumps(event) + "\n")
        out.flush()

    prefix = SUITE + "."

    class EventResult(unittest.TestResult):
        def _id(self, test: Any) -> str:
            name: str = test.id()
            return name[len(prefix) :] if name.startswith(prefix) else name

        def _outcome(self, test: Any, outcome: str, err: Any = None, detail: str = "") -> None:
            text = ""
            if err is not None:
                text = self._exc_info_to_string(err, test)
                lines = traceback.format_exception_only(err[0], err[1])
                detail = lines[0].strip() if lines else err[0].__name__
            if isinstance(test, unittest.TestCase):
                emit(
                    event="result",
                    test=self._id(test),
                    outcome=outcome,
                    detail=detail,
                    traceback=text,
                )
            else:  # an error of setUpModule, setUpClass or a cleanup: not a test's
                emit(
                    event="fixture", test=str(test), outcome=outcome, detail=detail, traceback=text
                )

        def startTest(self, test: Any) -> None:
            super().startTest(test)
            emit(event="start", test=self._id(test))
            # A hung test: dump every thread's traceback into the log and exit (code 1).
            faulthandler.dump_traceback_later(timeout, exit=True, file=watchdog)

        def stopTest(self, test: Any) -> None:
            # Until the next test starts, the same limit holds for the class and module
            # fixtures (tearDownClass, tearDownModule and its cleanups).
            faulthandler.dump_traceback_later(timeout, exit=True, file=watchdog)
            sys.stdout, sys.stderr = streams
            super().stopTest(test)
            if time.time() > deadline:
                self.stop()  # the run's budget is spent: start nothing more

        def addSuccess(self, test: Any) -> None:
            self._outcome(test, "passed")

        def addFailure(self, test: Any, err: Any) -> None:
            self._outcome(test, "failed", err)

        def addError(self, test: Any, err: Any) -> None:
            self._outcome(test, "error", err)

        def addSkip(self, test: Any, reason: str) -> None:
            self._outcome(test, "skipped", detail=reason)

        def addExpectedFailure(self, test: Any, err: Any) -> None:
            self._outcome(test, "passed")

        def addUnexpectedSuccess(self, test: Any) -> None:
            self._outcome(test, "failed", detail="unexpected success")

        def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:
            if err is not None:
                failed = issubclass(err[0], test.failureException)
                self._outcome(test, "failed" if failed else "error", err)

    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromName(test, module) for test in ids)
    suite.run(EventResult())
    emit(event="done")
    out.close()
    # What is left (joining threads and workers, atexit hooks) has EXIT_TIMEOUT to finish.
    faulthandler.dump_traceback_later(EXIT_TIMEOUT, exit=True, file=watchdog)


# ---------------------------------------------------------------------------------------
# The parent: one child per class, timeouts, stray processes, the report
# ---------------------------------------------------------------------------------------

SEVERITY = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
LABEL = {"failed": "FAIL", "error": "ERROR", "deviation": "AS DOCUMENTED"}
NOT_RUN = "not run: the run's budget (--budget) was spent"


@dataclass
class Outcome:
    """What became of one test: the worst of what was reported for it."""

    outcome: str = "error"
    detail: str = NOT_RUN
    traceback: str = ""
    extra: list[str] = field(default_factory=list)  # the other failures and errors
    reported: bool = False

    def judge_deviation(self, expected: str | None) -> list[str]:
        """Mark a documented deviation that failed as documented; notes for the report."""
        if expected is None:
            return []
        if self.outcome in ("failed", "error") and self.detail.startswith(expected):
            self.outcome = "deviation"
            return []
        if self.outcome == "passed":
            return [f"note: a documented deviation ({expected}) passed: update DEVIATIONS"]
        return []

    def add(self, outcome: str, detail: str, text: str) -> None:
        if not self.reported or SEVERITY[outcome] > SEVERITY[self.outcome]:
            if self.reported and self.outcome in ("failed", "error"):
                self.extra.append(f"{self.outcome}: {self.detail}")
            self.outcome, self.detail, self.traceback = outcome, detail, text
            self.reported = True
        elif outcome in ("failed", "error"):
            self.extra.append(f"{outcome}: {detail}")
            self.traceback += "\n" + text


def _group_members(pgid: int) -> list[tuple[int, str]]:
    """The live (non-zombie) processes of a process group, with their command lines."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid or fields[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        members.append((int(entry.name), cmdline.strip()[:120]))
    return members


def _reap_group(pgid: int) -> list[tuple[int, str]]:
    """Kill what a finished child left in its process group; return what that was."""
    if not Path("/proc").is_dir():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        return []
    left = _group_members(pgid)
    for _ in range(20):  # workers may be on their way out: give them a moment
        if not left:
            return []
        time.sleep(0.1)
        left = _group_members(pgid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return left


@dataclass
class Run:
    sources: Sources
    mode: str  # one of MODES
    timeout: float
    deadline: float
    logs: Path
    results: dict[str, Outcome] = field(default_factory=dict)
    fixture_errors: list[str] = field(default_factory=list)
    strays: list[str] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)  # test -> seconds

    def run_class(self, cls: str, tests: list[str]) -> None:
        """Run ``tests`` of class ``cls``, in as many children as hangs and crashes need."""
        log_path = self.logs / f"{cls}.log"
        events_path = self.logs / f"{cls}.events"
        pending = list(tests)
        while pending:
            left = self.deadline - time.time()
            if left <= 0:
                return  # what is pending stays "not run"
            events_path.unlink(missing_ok=True)
            cmd = [
                sys.executable,
                str(SCRIPT),
                "--child-run",
                *_overlay_args(self.sources),
                "--events",
                str(events_path),
                "--timeout",
                str(self.timeout),
                "--deadline",
                str(self.deadline),
                "--mode",
                self.mode,
                *pending,
            ]
            log_start = log_path.stat().st_size if log_path.exists() else 0
            with log_path.open("ab") as log_file:
                child = subprocess.Popen(
                    cmd,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=ROOT,
                )
                killed = self._watch(child, events_path)
            for pid, cmdline in _reap_group(child.pid):
                self.strays.append(f"{cls}: pid {pid} left running, killed: {cmdline}")
            with log_path.open("rb") as log_file:
                log_file.seek(log_start)
                output = log_file.read().decode(errors="replace")  # this child's
            started, finished, done = self._read_events(events_path)
            hung = [t for t in started if t not in finished]
            rest = [t for t in pending if t not in set(started)]
            if hung:
                self._record_hang(hung[0], child.returncode, killed, output)
            elif started and (killed or child.returncode != 0):
                if done:
                    where = "at exit"
                elif rest:  # between two tests: the rest goes on in a new child
                    where = f"before its next test, {rest[0]}"
                else:
                    where = "in the class or module teardown"
                if killed:
                    how = "was silent too long and was killed"
                elif "Timeout (" in output and child.returncode == 1:
                    how = "hung and was dumped by faulthandler"
                else:
                    how = f"exited with code {child.returncode}"
                self.fixture_errors.append(
                    f"{cls}: after its last test, the child {how} {where} (see {log_path})"
                )
            if not started and child.returncode != 0:
                tail = output.strip().splitlines()[-15:]
                for test in rest:
                    self.results[test].add(
                        "error",
                        f"the child exited with code {child.returncode} before the test",
                        "\n".join(tail),
                    )
                return
            if not hung and (done or not rest):
                return  # finished, or stopped at the deadline
            pending = rest  # after a hang, or a child that died between two tests

    def _watch(self, child: subprocess.Popen[bytes], events_path: Path) -> bool:
        """Wait for ``child``; kill its group if it is silent too long. Return if killed.

        The child's own watchdog (faulthandler) should end any hang first; this is for a
        hang it cannot see (a deadlock in C with the GIL held, a stuck interpreter exit).
        """
        last_size, last_progress = -1, time.monotonic()
        while True:
            try:
                child.wait(timeout=1)
                return False
            except subprocess.TimeoutExpired:
                pass
            size = events_path.stat().st_size if events_path.exists() else 0
            if size != last_size:
                last_size, last_progress = size, time.monotonic()
            elif time.monotonic() - last_progress > self.timeout + STALL_GRACE:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return True

    def _read_events(self, path: Path) -> tuple[list[str], set[str], bool]:
        """Record a child's events; return the tests started, those finished, and if done."""
        started: list[str] = []
        finished: set[str] = set()
        began: dict[str, float] = {}
        done = False
        if not path.exists():
            return started, finished, done
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "done":
                done = True
            elif event["event"] == "start":
                started.append(event["test"])
                began[event["test"]] = event["time"]
            elif event["event"] == "result" and event["test"] in self.results:
                finished.add(event["test"])
                self.durations[event["test"]] = event["time"] - began[event["test"]]
                outcome = self.results[event["test"]]
                outcome.add(event["outcome"], event["detail"], event["traceback"])
            else:
                self.fixture_errors.append(
                    f"{event['test']}: {event['outcome']}: {event['detail']}"
                )
        return started, finished, done

    def _record_hang(self, test: str, code: int | None, killed: bool, output: str) -> None:
        """Count a test during which its child hung or died as an error."""
        dumped = output.rfind("Timeout (")
        if killed:
            detail = "the child did not finish in time and was killed"
        elif dumped >= 0 and code == 1:
            detail = f"timed out after {self.timeout:g} s (faulthandler dump in the log)"
        else:
            detail = f"the child died during the test (exit code {code})"
        self.results[test].add("error", detail, output[dumped if dumped >= 0 else -6000 :])


COLUMNS = [
    ("public passed", "public", ("passed",)),
    ("public failed", "public", ("failed",)),
    ("public errors", "public", ("error",)),
    ("deviations", "public", ("deviation",)),
    ("private passed", "private", ("passed",)),
    ("private failed", "private", ("failed", "error")),
    ("skipped", None, ("skipped",)),
]


def summary_table(tests: list[dict[str, Any]], results: dict[str, Outcome]) -> str:
    methods = [m for m in MIXINS if any(t["start_method"] == m for t in tests)]
    counts: dict[str, collections.Counter[str]] = {m: collections.Counter() for m in methods}
    for test in tests:
        kind = "private" if test["private"] else "public"
        outcome = results[test["id"]].outcome
        for title, wanted_kind, outcomes in COLUMNS:
            if outcome in outcomes and wanted_kind in (None, kind):
                counts[test["start_method"]][title] += 1
    counts["total"] = sum(counts.values(), collections.Counter())
    titles = [title for title, _, _ in COLUMNS]
    rows = [["start method", *titles]]
    rows += [[m, *(str(counts[m][t]) for t in titles)] for m in [*methods, "total"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append(" | ".join(cells))
        if i == 0 or i == len(rows) - 2:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _names(test: dict[str, Any]) -> set[str]:
    """What selects a test: its id, class or name; in a package, its module, or its id or
    class without the module (``Class.test_x``)."""
    names = {test["id"], test["cls"], test["name"]}
    if "." in test["cls"]:
        module, cls = test["cls"].split(".", 1)
        names |= {module, cls, f"{cls}.{test['name']}"}
    return names


def select(tests: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The tests that the positional names, -k patterns and --start-method select."""
    chosen = tests
    if args.only:
        chosen = [t for t in chosen if bool(t["private"]) == (args.only == "private")]
    if args.start_method:
        chosen = [t for t in chosen if t["start_method"] in args.start_method]
    if args.tests:
        wanted = set(args.tests)
        chosen = [t for t in chosen if _names(t) & wanted]
    if args.patterns:

        def matches(test_id: str, pattern: str) -> bool:
            if any(c in pattern for c in "*?["):
                return fnmatch.fnmatchcase(test_id, pattern)
            return pattern in test_id

        chosen = [t for t in chosen if any(matches(t["id"], p) for p in args.patterns)]
    return chosen


def header(sources: Sources, mode: str) -> list[str]:
    """What is under test, for the top of the report; a SetupError if sharexec is missing."""
    under_test = "concurrent.futures.ProcessPoolExecutor (control run, --stdlib)"
    if mode != "stdlib":
        probe = _run(
            [
                sys.executable,
                "-I",  # the sharexec the children import: not one in the current folder
                "-c",
                "import loky, sharexec; print(sharexec.__version__, 'from', "
                "sharexec.__file__, '/ loky', loky.__version__)",
            ]
        )
        if probe.returncode != 0:
            raise SetupError(f"cannot import sharexec with {sys.executable}:\n{probe.stderr}")
        under_test = f"sharexec.SharedProcessPoolExecutor {probe.stdout.strip()}"
        if mode == "aliased":
            under_test += f" (--alias-private: {', '.join(ALIASES)} aliased)"
    return [
        f"Python        {sys.version.split()[0]} ({sys.executable})",
        f"suite         {SUITE} from {sources.test_file}",
        f"test.support  {sources.support}",
        f"executor      {under_test}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "tests",
        nargs="*",
        metavar="TEST",
        help="a test (Class.test_name), a class, a test name (in every class), or a module",
    )
    parser.add_argument(
        "-k",
        dest="patterns",
        action="append",
        default=[],
        help="only tests whose Class.test_name contains this, or matches it as a glob",
    )
    parser.add_argument("--start-method", action="append", choices=list(MIXINS))
    parser.add_argument("--only", choices=["public", "private"], help="one kind of test")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds for one test (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        help=f"seconds for the run: no test starts after (default {DEFAULT_BUDGET:g})",
    )
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--test-file",
        type=Path,
        help="Python 3.11: a local test_concurrent_futures.py instead of Debian's",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--stdlib",
        dest="mode",
        action="store_const",
        const="stdlib",
        help="control run: the stdlib's ProcessPoolExecutor, not ours",
    )
    which.add_argument(
        "--alias-private",
        dest="mode",
        action="store_const",
        const="aliased",
        help=f"diagnostic: ours, with {' and '.join(ALIASES)} read from loky's equivalents",
    )
    which.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--list", action="store_true", help="list the tests and exit")
    parser.add_argument(
        "--tracebacks", action="store_true", help="print the tracebacks of the failures"
    )
    parser.add_argument("--json", type=Path, help="also write the results here, as JSON")
    # Internal: the child processes.
    parser.add_argument("--child-discover", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--overlay", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--events", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.mode = args.mode or "ours"

    if args.child_discover:
        child_discover(args.overlay)
        return 0
    if args.child_run:
        child_run(args.overlay, args.mode, args.events, args.timeout, args.deadline, args.tests)
        return 0

    started = time.time()
    try:
        sources = prepare_sources(args.cache_dir.resolve(), args.test_file)
        all_tests = discover(sources)
        top = header(sources, args.mode)
    except SetupError as exc:
        print(f"run_cpython_suite: {exc}", file=sys.stderr)
        return 2
    tests = select(all_tests, args)
    if not tests:
        print("run_cpython_suite: no test selected", file=sys.stderr)
        return 2
    found = {t["body"] for t in all_tests if t["private"]}
    version = sys.version_info[:2]
    expected = EXPECTED_PRIVATE.get(version, {})
    notes = [] if version in EXPECTED_PRIVATE else [f"note: no EXPECTED_PRIVATE for {version}"]
    notes += [
        f"note: the scan finds {name} private, but EXPECTED_PRIVATE does not list it"
        for name in sorted(found - set(expected))
    ] + [
        f"note: EXPECTED_PRIVATE lists {name}, but the scan finds no private read in it"
        for name in sorted(set(expected) - found)
    ]
    if args.list:
        for test in tests:
            kind = "private" if test["private"] else "public"
            reads = ", ".join(test["private"])
            print(f"{test['start_method']:<10} {kind:<7} {test['id']}  {reads}".rstrip())
        print(*notes, sep="\n")
        return 0

    for line in top:
        log(line)
    log(f"{len(tests)} tests, {args.timeout:g} s each at most, {args.budget:g} s in all\n")
    suffix = f"{sys.version_info[0]}.{sys.version_info[1]}"  # each Python's run apart
    logs = args.cache_dir.resolve() / f"logs-{suffix}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    run = Run(sources, args.mode, args.timeout, started + args.budget, logs)
    by_class: dict[str, list[str]] = {}
    for test in tests:
        run.results[test["id"]] = Outcome()
        by_class.setdefault(test["cls"], []).append(test["id"])
    kinds = {t["id"]: ("private" if t["private"] else "public") for t in tests}
    deviations = {
        t["id"]: DEVIATIONS[t["body"]]
        for t in tests
        if t["body"] in DEVIATIONS and kinds[t["id"]] == "public"
    }
    for cls, ids in by_class.items():
        began = time.time()
        run.run_class(cls, ids)
        for test in ids:
            notes += run.results[test].judge_deviation(deviations.get(test))
        tally = collections.Counter(run.results[t].outcome for t in ids)
        said = ", ".join(f"{n} {o}" for o, n in sorted(tally.items()))
        log(f"{cls:<48} {said}  ({time.time() - began:.1f} s)")
        for test in ids:
            outcome = run.results[test]
            if outcome.outcome in LABEL:
                log(f"    {LABEL[outcome.outcome]:<5} {kinds[test]:<7} {test}: {outcome.detail}")

    failing = [t for t in tests if run.results[t["id"]].outcome in ("failed", "error")]
    failing.sort(key=lambda t: (kinds[t["id"]] != "public", t["name"], t["id"]))
    public_failed = sum(kinds[t["id"]] == "public" for t in failing)
    report: list[str] = ["", summary_table(tests, run.results), ""]
    if failing:
        report.append(
            f"Failing tests ({public_failed} public, {len(failing) - public_failed}"
            " private), with the first line of each failure:"
        )
        for test in failing:
            outcome = run.results[test["id"]]
            report.append(
                f"  {kinds[test['id']]:<7} {LABEL[outcome.outcome]:<5} {test['id']}: "
                f"{outcome.detail.splitlines()[0] if outcome.detail else ''}"
            )
            report += [f"      also {extra}" for extra in outcome.extra]
    deviated = [t for t in tests if run.results[t["id"]].outcome == "deviation"]
    if deviated:
        report += ["", "Documented deviations from the stdlib (DEVIATIONS), as expected:"]
        report += [f"  {t['id']}: {run.results[t['id']].detail}" for t in deviated]
    slowest = sorted(run.durations.items(), key=lambda item: -item[1])[:8]
    if slowest:
        report += ["", "Slowest tests:", *(f"  {d:6.1f} s  {t}" for t, d in slowest)]
    for title, items in (
        ("Errors outside any test (module/class fixtures, cleanups)", run.fixture_errors),
        ("Processes left behind by a child (killed)", run.strays),
        ("Notes", notes),
    ):
        if items:
            report += ["", f"{title}:", *(f"  {item}" for item in items)]
    for line in report:
        log(line)

    details = [
        f"{t['id']} [{kinds[t['id']]}] {run.results[t['id']].outcome}\n"
        f"{run.results[t['id']].traceback}"
        for t in failing
    ]
    details_path = args.cache_dir.resolve() / f"last-run-{suffix}.txt"
    details_path.write_text("\n".join([*report, "", "Tracebacks:", "", *details]) + "\n")
    if args.tracebacks:
        for text in details:
            log("\n" + text)
    if args.json:
        results = [
            {
                **t,
                "kind": kinds[t["id"]],
                "outcome": run.results[t["id"]].outcome,
                "detail": run.results[t["id"]].detail,
                "traceback": run.results[t["id"]].traceback,
            }
            for t in tests
        ]
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    public = [t for t in tests if kinds[t["id"]] == "public"]
    public_passed = sum(run.results[t["id"]].outcome == "passed" for t in public)
    public_skipped = sum(run.results[t["id"]].outcome == "skipped" for t in public)
    log("")
    log(f"Tracebacks: {details_path}; children's output: {logs}/")
    if failing:
        first = failing[0]
        log(f"Rerun one: python tests/compat/run_cpython_suite.py --tracebacks {first['id']}")
    log(f"Finished in {time.time() - started:.0f} s.")
    log(f"public: {public_passed} passed, {public_failed} failed, {public_skipped} skipped")
    return 1 if public_failed else 0


if __name__ == "__main__":
    sys.exit(main())
