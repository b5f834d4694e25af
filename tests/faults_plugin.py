"""Records the fault suite's outcomes, one JSON line per test, for ``nox -s faults``.

Active when ``SHAREXEC_FAULTS_REPORT`` names a file (tests/conftest.py registers it);
``tests/faults_report.py`` turns the file into the table of docs/reliability.md. Each test
run is one *scenario* (the test's name and parameters, start method left out: runs under
several start methods are runs of one scenario) and its failures are classified:

* **leaked**: segments a leak check found (:func:`leaked`, called by the checks of
  conftest.py and test_faults.py; a check that fails with "segments left behind: [...]"
  without it is counted from its message);
* **crash**: the test broke down rather than gave an answer: a crash the test reported
  (:func:`crashed`: a scenario exiting non-zero, a process outliving its scenario, a
  broken pool), ``BrokenProcessPool`` where none was expected, a timeout, or any
  exception that is not an assertion;
* **wrong**: any other failed assertion (a wrong value, a missing exception).

Without the variable, :func:`leaked` and :func:`crashed` only note into a record nobody
writes: the tests behave the same either way.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

ENV = "SHAREXEC_FAULTS_REPORT"
START_METHODS = ("spawn", "fork", "forkserver", "loky", "default")
LEAK_MESSAGE = "segments left behind"
# What the leak checks of test_roundtrip.py's class-scoped fixture say when a pool or a
# process misbehaved (it reports through assertions only).
CRASH_MESSAGES = ("the pool was broken", "processes left behind")

# The record of the test running now, e.g. {"scenario": "...", "leaked": 0, ...}.
_current: dict[str, Any] = {}


def leaked(names: set[str] | list[str]) -> None:
    """Note the segments a leak check found left (none is fine: nothing is noted)."""
    if names:
        _current["leaked"] = _current.get("leaked", 0) + len(names)


def crashed(reason: str) -> None:
    """Note that the test saw a crash (the assertion that follows fails the test)."""
    _current.setdefault("crash_reasons", []).append(reason)


def scenario_of(item: pytest.Item) -> tuple[str, str | None]:
    """``("test_faults.py::test_worker_dies_mid_task[sigkill]", "spawn")``."""
    name = item.originalname if isinstance(item, pytest.Function) else item.name
    if getattr(item, "cls", None) is not None:
        name = f"{item.cls.__name__}::{name}"
    method = None
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        ids = []
        for part in callspec.id.split("-"):
            if part in START_METHODS and method is None:
                method = part
            else:
                ids.append(part)
        if ids:
            name += f"[{'-'.join(ids)}]"
    return f"{item.path.name}::{name}", method


def _kind(exc: BaseException) -> str:
    """ "leak", "crash" or "wrong", for an exception that failed a test phase."""
    group = getattr(exc, "exceptions", None)
    if isinstance(group, (list, tuple)):  # an exception group: hypothesis, several failures
        kinds = {_kind(e) for e in group}
        return next(k for k in ("crash", "leak", "wrong") if k in kinds)
    if isinstance(exc, AssertionError):
        message = str(exc)
        if message.startswith(LEAK_MESSAGE):
            return "leak"
        if _current.get("crash_reasons") or message.startswith(CRASH_MESSAGES):
            return "crash"
        return "wrong"
    if isinstance(exc, pytest.fail.Exception) and str(exc).startswith("DID NOT RAISE"):
        return "wrong"  # pytest.raises: the expected exception never came
    # BrokenProcessPool, TimeoutError, subprocess.TimeoutExpired, pytest-timeout's
    # failure, any other error the test did not expect
    return "crash"


class Recorder:
    """The pytest plugin: one JSON line per test, and one at the end of the session."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        scenario, method = scenario_of(item)
        _current.clear()
        _current.update(
            scenario=scenario, method=method, nodeid=item.nodeid, leaked=0, crash=0, wrong=0
        )
        yield
        record = dict(_current)
        record.pop("crash_reasons", None)
        self._write(record)
        _current.clear()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        outcome = yield
        report = outcome.get_result()
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            _current["skipped"] = str(reason).removeprefix("Skipped: ")
            return
        if call.excinfo is None:
            if report.failed:  # a strict xfail that passed: not the expected behaviour
                _current["wrong"] = 1
                _current.setdefault("details", []).append(f"{call.when}: {report.longrepr}")
            return
        if not (report.failed or hasattr(report, "wasxfail")):
            return
        # a failure, or an expected one (xfail): both count, all zeros means no known bug
        exc = call.excinfo.value
        kind = _kind(exc)
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        _current.setdefault("details", []).append(
            f"{call.when}: {type(exc).__name__}: {first_line[:300]}"
        )
        if kind == "leak":
            if not _current["leaked"]:  # a check that did not call leaked()
                names = re.findall(r"'([^']*sharexec-[^']*)'", str(exc).splitlines()[0])
                _current["leaked"] = max(1, len(set(names)))
        elif kind == "crash":
            _current["crash"] = 1
        else:
            _current["wrong"] = 1
        if hasattr(report, "wasxfail"):
            _current["xfail"] = report.wasxfail

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self._write({"end": True, "exitstatus": int(exitstatus)})


def register(config: pytest.Config) -> None:
    """Register the recorder if ``SHAREXEC_FAULTS_REPORT`` is set (from conftest.py)."""
    path = os.environ.get(ENV)
    if path and not config.pluginmanager.has_plugin("sharexec-faults"):
        config.pluginmanager.register(Recorder(path), "sharexec-faults")
