"""Fixtures shared by the whole suite: start methods, executors, and leak checks."""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Iterator

import faults_plugin
import pytest

import sharexec
from sharexec import _segments

START_METHODS = ["spawn", "fork", "forkserver", "loky"]


def pytest_configure(config: pytest.Config) -> None:
    faults_plugin.register(config)  # only with SHAREXEC_FAULTS_REPORT set (nox -s faults)


# Helper processes that outlive a pool by design (one of each per test session).
_HELPERS = ("resource_tracker", "forkserver import main", "sweeper_main")


def descendants(pid: int | None = None) -> dict[int, str]:
    """Every live descendant of ``pid`` (default: this process), with its command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: dict[int, str] = {}
    todo = [os.getpid() if pid is None else pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    found[child] = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            todo.append(child)
    return found


def workers_left() -> dict[int, str]:
    """Descendants that are not the long-lived helpers (resource trackers, fork servers)."""
    return {p: cmd for p, cmd in descendants().items() if not any(h in cmd for h in _HELPERS)}


def segments_now() -> set[str]:
    """The sharexec segments that exist now, less those of unrelated live processes.

    A segment's name carries its creator's pid: one made by a live process that is neither
    this one nor a descendant belongs to someone else on the machine (another test run).
    """
    ours = {os.getpid(), *descendants()}
    names = set()
    for name in _segments.listdir():
        pid = int(name.split("-")[1])
        if pid in ours or not os.path.exists(f"/proc/{pid}"):
            names.add(name)
    return names


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    """Every behaviour is tested under each start method."""
    return str(request.param)


@pytest.fixture
def mp_context(start_method: str) -> multiprocessing.context.BaseContext:
    """A multiprocessing context for the start method (loky's own for "loky")."""
    if start_method == "loky":
        from loky.backend.context import get_context

        return get_context("loky")
    return multiprocessing.get_context(start_method)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fails the test if it leaves a child process or a sharexec segment behind."""
    before = segments_now()
    yield
    gc.collect()
    assert_none_left(segments_now() - before)
    if workers_left():
        faults_plugin.crashed("processes left behind")
    assert not workers_left(), f"processes left behind: {workers_left()}"


def assert_none_left(left: set[str]) -> None:
    """Fails if segments were left; the fault report (nox -s faults) counts them."""
    faults_plugin.leaked(left)
    assert not left, f"segments left behind: {sorted(left)}"


@pytest.fixture
def executor(start_method: str, no_leaks: None) -> Iterator[sharexec.SharedProcessPoolExecutor]:
    """A 2-worker executor, shut down (waiting) on teardown; nothing may be left after."""
    ex = sharexec.SharedProcessPoolExecutor(2, mp_context=start_method)
    try:
        yield ex
    finally:
        ex.shutdown(wait=True)
        if ex._flags.broken is not None:
            faults_plugin.crashed("the pool was broken")
        assert ex._flags.broken is None, "the pool was broken"
