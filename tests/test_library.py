"""For library authors: get_executor, statistics, logging, doctor."""

from __future__ import annotations

import gc
import logging
import os
import secrets
import threading
import time

import numpy as np
import pytest
import workers
from loky import cpu_count
from test_cli import sharexec_cli
from test_lifetime import callbacks_done

import sharexec
from sharexec import _segments

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def process_wide(no_leaks):
    """get_executor()'s executor is shut down after the test, so nothing is left."""
    yield
    from sharexec import _executor

    if _executor._process_wide is not None:
        _executor._process_wide.shutdown(wait=True)
        _executor._process_wide = None


def test_get_executor_is_one_per_process_even_from_threads(process_wide):
    got = []
    barrier = threading.Barrier(8)

    def ask():
        barrier.wait(30)
        got.append(sharexec.get_executor(2))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 8 and len({id(ex) for ex in got}) == 1
    assert sharexec.get_executor() is got[0]  # no size asked: the current one
    assert got[0].submit(workers.total, np.ones(300_000)).result() == 300_000.0


def test_get_executor_is_replaced_when_resized_shut_down_or_broken(process_wide):
    first = sharexec.get_executor(2)
    assert first.submit(workers.identity, 1).result() == 1
    second = sharexec.get_executor(1)
    assert second is not first and second._max_workers == 1
    assert second.submit(workers.identity, 2).result() == 2
    second.shutdown()
    third = sharexec.get_executor()
    assert third is not second and third.submit(workers.identity, 3).result() == 3
    broken = third.submit(os._exit, 1)
    with pytest.raises(Exception, match="terminated"):
        broken.result()
    fourth = sharexec.get_executor()
    assert fourth is not third and fourth.submit(workers.identity, 4).result() == 4


def test_workers_of_get_executor_limit_blas_and_openmp_threads(process_wide, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")  # the user's choice is kept
    ex = sharexec.get_executor(2)
    env = ex.submit(workers.environment).result()
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == str(max(1, cpu_count() // 2))
    assert env["MKL_NUM_THREADS"] == "3"


def test_statistics_show_what_was_shared(executor):
    a = np.ones(1_000_000)  # 8 MB, private
    shared = sharexec.zeros(100_000)  # 800 kB, shared
    futures = [executor.submit(workers.hold_nothing, a, shared) for _ in range(3)]
    released = [callbacks_done(f) for f in futures]  # sharexec's own callback ran first
    for f, done in zip(futures, released, strict=True):
        assert f.result() == 2 and done.wait(60)
    stats = executor.statistics()
    assert isinstance(stats, sharexec.Statistics)
    assert stats.tasks_submitted == stats.tasks_done == 3
    assert stats.bytes_by_reference == 3 * shared.nbytes
    assert stats.bytes_copied + stats.bytes_reused == 3 * a.nbytes
    assert stats.bytes_copied >= a.nbytes
    assert stats.fallbacks == 0
    assert stats.segments_live >= 1 and stats.bytes_in_shared_memory >= shared.nbytes
    with pytest.raises(AttributeError):
        stats.tasks_done = 0  # frozen


def test_segments_are_logged_and_nothing_printed(executor, caplog, capsys):
    with caplog.at_level(logging.DEBUG, logger="sharexec"):
        a = sharexec.zeros(10)
        name = next(r.args[0] for r in caplog.records if "created shared" in r.getMessage())
        del a
        gc.collect()
        assert any(
            r.args and r.args[0] == name and "unlinked" in r.getMessage() for r in caplog.records
        )
        assert executor.submit(workers.total, np.ones(300_000)).result() == 300_000.0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def _fake_name(what: str, pid: int = 4_194_304) -> str:
    """A segment name made in this PID namespace by ``pid`` (by default none: a pid above
    Linux's pid_max default), unique to this test run: another checkout's suite may run
    the same test at the same time."""
    here = _segments.pid_namespace()
    return f"sharexec-{pid}-{here}.{what}{os.getpid()}x{secrets.token_hex(4)}"


def test_doctor_reports_and_cleans_stale_segments(no_leaks):
    # A stale segment is garbage by design, so another checkout's `doctor --clean` may
    # remove ours first: then the attempt proves nothing and is made again.
    for _attempt in range(3):
        stale = _fake_name("doctor")
        _segments.create(4096, stale).close()
        hour_ago = time.time() - 3600  # unchanged for long: not a segment in flight
        os.utime(os.path.join(_segments.SHM_FOLDER, stale), (hour_ago, hour_ago))
        try:
            run = sharexec_cli("doctor")
            assert run.returncode == 0, run.stderr
            for topic in ("platform", "shared memory", "fallback folder", "start methods"):
                assert topic in run.stdout
            cleaned = sharexec_cli("doctor", "--clean")
            assert cleaned.returncode == 0, cleaned.stderr
            if stale not in run.stdout and stale not in _segments.listdir():
                continue  # removed by another program before our doctor saw it
            assert stale in run.stdout and "WARNING" in run.stdout
            if f"removed {stale}" not in cleaned.stdout and stale not in _segments.listdir():
                continue  # removed by another program between our two runs
            assert f"removed {stale}" in cleaned.stdout
            assert stale not in _segments.listdir()
            return
        finally:
            _segments.unlink(stale)
    pytest.fail("three stale segments in a row were removed by another program first")


def test_doctor_never_calls_stale_what_may_still_be_used(no_leaks):
    """A dead creator is not enough: another program on the machine may still use the
    segment (a parent holding a result its dead worker made), or hand it over now. And
    a pid in use keeps a segment, even if its creator is dead and a process that got its
    pid since runs: that cannot be told apart from its creator alive."""
    from sharexec._doctor import stale_segments

    recent = _fake_name("recent")  # just made: may be in flight
    mapped = _segments.create(4096, _fake_name("mapped"))  # a live process maps it
    reused = _fake_name("reused", pid=1)  # as if its creator had had init's pid
    _segments.create(4096, recent).close()
    _segments.create(4096, reused).close()
    hour_ago = time.time() - 3600
    for name in (mapped.name, reused):
        os.utime(os.path.join(_segments.SHM_FOLDER, name), (hour_ago, hour_ago))
    try:
        names = {name for name, _ in stale_segments()}
        assert recent not in names and mapped.name not in names and reused not in names
    finally:
        for name in (recent, mapped.name, reused):
            _segments.unlink(name)
        mapped.close()


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "not-alone"])
def test_doctor_judges_an_older_name_only_with_no_other_pid_namespace_in_sight(
    alone, monkeypatch, no_leaks
):
    """A name of an older sharexec says no PID namespace: its pid means a process only
    where every process of the machine is in sight and in one namespace."""
    from sharexec import _doctor

    monkeypatch.setattr(_doctor, "INITIAL_PID_NAMESPACE", _segments.pid_namespace())
    monkeypatch.setattr(_doctor, "_nested_in_sight", lambda: not alone)
    for _attempt in range(3):  # another program's doctor may remove it first
        old = f"sharexec-4194304-older{os.getpid()}x{secrets.token_hex(4)}"
        _segments.create(4096, old).close()
        hour_ago = time.time() - 3600
        os.utime(os.path.join(_segments.SHM_FOLDER, old), (hour_ago, hour_ago))
        try:
            found = _doctor.survey()
        finally:
            _segments.unlink(old)
        stale = [name for name, _ in found.stale]
        kept = {name: why for name, _, why in found.kept}
        if old not in stale and old not in kept:
            continue
        if alone:
            assert old in stale
        else:
            assert old not in stale and "named by an older sharexec" in kept[old]
        return
    pytest.fail("three segments in a row were removed by another program first")


def test_segment_names_say_their_creator_and_its_pid_namespace():
    name = _segments.new_name()
    here = os.stat("/proc/self/ns/pid").st_ino
    assert name.startswith(f"sharexec-{os.getpid()}-{here}.")
    assert _segments.creator(name) == (os.getpid(), here)
    # an older sharexec's name (its random part may hold "-" but never "."): no namespace
    assert _segments.creator("sharexec-41-Zm9v-YmFy_123") == (41, None)
    assert _segments.creator("sharexec-41-4026531836.Zm9v-YmFy") == (41, 4026531836)
    assert _segments.creator("sharexec-sweeper-x") is None
    assert _segments.creator("other-41-x") is None
