"""The suite's own leak check (``no_leaks``, ``segments_now`` in conftest.py) judges only
what its test session made, and still catches every leak of its own.

A tiny test file runs in a pytest session of its own (a subprocess, with copies of this
suite's conftest.py and its helpers), beside segments that stand for another program on
the machine: one left by a dead process that was never the session's (another checkout's
killed worker) and one of a live process outside it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SESSION_SITE, segments_now, session_members

from sharexec import _segments

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).parent

# Run by the inner session; NAMES (a file) collects every segment it made, as "what
# name" lines, so that the outer test checks each and removes them whatever happens.
INNER_TESTS = """
import os, subprocess, sys, textwrap
from sharexec import _tracking

NAMES = os.path.join(os.path.dirname(__file__), "names.txt")
KEEP = []

def made(what, name):
    with open(NAMES, "a") as f:
        f.write(f"{what} {name}\\n")

# A process that creates a segment, prints its name and exits without removing it
# (nothing tracks it: no sweeper hears of it).
LEAVE_ONE = (
    "from sharexec import _segments\\n"
    "name = _segments.new_name()\\n"
    "_segments.create(4096, name).close()\\n"
    "print(name, flush=True)\\n"
)

def run(code, env=None):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env, check=True)
    return out.stdout.split()

def stranger_env():
    # Another program on the machine: not started under this session's recorder.
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_SHAREXEC_MEMBERS"}
    env.pop("PYTHONPATH", None)
    return env

def test_leaks_one_of_its_own(no_leaks):
    mapping = _tracking.new_shared(4096)
    made("own", mapping.name)
    KEEP.append(mapping)  # alive after the test: a leak

def test_a_dead_process_of_the_session_leaks_one(no_leaks):
    made("member", run(LEAVE_ONE)[0])  # its creator is dead by the check: still ours

def test_a_dead_strangers_segment_is_not_a_leak(no_leaks):
    made("dead-stranger", run(LEAVE_ONE, stranger_env())[0])

def test_a_live_strangers_segment_is_not_a_leak(no_leaks):
    # Not a descendant (its parent exits at once) and not recorded, alive during the
    # check: it makes a segment and waits to be ended.
    stranger = LEAVE_ONE + "import time; time.sleep(100)\\n"
    launcher = (
        "import subprocess, sys\\n"
        f"p = subprocess.Popen([sys.executable, '-c', {stranger!r}], stdout=subprocess.PIPE,"
        " stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)\\n"
        "print(p.stdout.readline().decode().strip(), p.pid)\\n"
    )
    name, pid = run(launcher, stranger_env())
    made("pid", pid)
    made("live-stranger", name)

def test_nothing_left(no_leaks):
    pass
"""


@pytest.fixture
def inner_session(tmp_path: Path) -> Path:
    """A folder holding this suite's conftest.py and helpers, for a session of its own."""
    for name in ("conftest.py", "faults_plugin.py"):
        shutil.copy(HERE / name, tmp_path / name)
    shutil.copytree(SESSION_SITE, tmp_path / SESSION_SITE.name)
    return tmp_path


def test_the_leak_check_sees_its_own_leaks_and_nothing_else(inner_session):
    (inner_session / "test_inner.py").write_text(INNER_TESTS)
    names_file = inner_session / "names.txt"
    before = segments_now()
    made: dict[str, str] = {}
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-q",
                "--rootdir",
                str(inner_session),
                str(inner_session / "test_inner.py"),
            ],
            cwd=inner_session,
            capture_output=True,
            text=True,
            timeout=110,
        )
        report = out.stdout + out.stderr
        made = dict(line.split() for line in names_file.read_text().splitlines())
        assert set(made) == {"own", "member", "dead-stranger", "pid", "live-stranger"}, report
        summary = report.strip().splitlines()[-1]
        assert "5 passed, 2 errors" in summary, report
        errors = sorted(line for line in report.splitlines() if line.startswith("ERROR "))
        assert len(errors) == 2, report
        assert "test_a_dead_process_of_the_session_leaks_one" in errors[0], report
        assert "test_leaks_one_of_its_own" in errors[1], report
        for what in ("own", "member"):  # each named in its failure
            assert f"segments left behind: ['{made[what]}']" in report, report
        # This session, too, counts the inner one's leftovers as its own, and no other.
        left = segments_now() - before
        assert made["member"] in left
        assert made["dead-stranger"] not in left and made["live-stranger"] not in left
    finally:
        for what, entry in made.items():
            if what == "pid":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry), signal.SIGKILL)
            else:
                _segments.unlink(entry)


def _segment(name: str) -> str:
    """Make an empty segment file named ``name`` (as its creator would); its path."""
    path = os.path.join(_segments.SHM_FOLDER, name)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    return path


def test_a_pid_the_session_had_is_a_strangers_once_its_process_was_gone():
    # A process of this session, recorded as it started, that has exited since.
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(done.stdout)
    assert pid in session_members()
    before = segments_now()
    # Another program got that pid (pids wrap around) and made a segment.
    path = _segment(f"sharexec-{pid}-madeByAStranger")
    try:
        assert os.path.basename(path) in segments_now()  # a dead member's name, alone
        assert segments_now() - before == set()  # but it was gone before: not made since
    finally:
        os.unlink(path)


def test_a_member_that_makes_a_segment_and_dies_during_a_test_still_counts():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=-1)
    before = segments_now()
    path = _segment(f"sharexec-{child.pid}-madeByAWorker")  # as if the child made it
    try:
        child.communicate(b"")  # it exits: a worker killed after making its segment
        assert segments_now() - before == {os.path.basename(path)}
    finally:
        os.unlink(path)
