"""A default container: a 64 MB /dev/shm, perhaps a read-only root file system.

Large arguments and shared arrays that do not fit in /dev/shm live in anonymous shared
memory: the calls run as on the host (one copy, pooled, no fallback, no warning), and
nothing is left in /dev/shm or held by any process afterwards. Each scenario runs as its
own program in a private mount namespace (``container.py``); the crashes (a SIGKILL of
the parent or of a worker) are in ``test_faults.py``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile

import pytest
from conftest import method_id
from container import ROOTS, SCENARIOS, in_namespace, needs_root, printed, run

from sharexec import _segments
from sharexec.errors import SegmentError

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(
        not _segments.anonymous_supported(), reason="no memfd_create, or /proc is not mounted"
    ),
]

# The start methods whose workers are forks of a fork server (sharexec's warm server, or
# the standard library's), which binds its socket in multiprocessing's private folder.
FORK_SERVERS = (None, "forkserver")


def check_repeated(out) -> None:
    assert out.returncode == 0, out.stdout + out.stderr
    assert printed(out.stdout, "exact") is True
    assert printed(out.stdout, "kind") == "anonymous"  # 80 MB: more than /dev/shm holds
    stats = printed(out.stdout, "stats")
    # One copy of the argument, pooled and served again: as on the host.
    assert stats == {
        "fallbacks": 0,
        "bytes_copied": printed(out.stdout, "nbytes"),
        "segments_pooled": 1,
    }, stats
    assert printed(out.stdout, "warnings") == []
    assert printed(out.stdout, "left") == []
    assert printed(out.stdout, "held") == []  # every descriptor closed as its segment went


@needs_root
@pytest.mark.transport  # where the bytes go: the same whatever started the worker
def test_small_dev_shm_runs_as_on_the_host(start_method):
    check_repeated(run(start_method, "repeated"))


@needs_root
def test_workers_results_are_anonymous_and_left_nowhere(start_method):
    """A worker's large results and the shared arrays it returns, in a 64 MB /dev/shm:
    anonymous segments whose descriptors the worker passed to the parent (no file, no
    warning), and that no worker holds once the parent has them."""
    out = run(start_method, "results")
    assert out.returncode == 0, out.stdout + out.stderr
    assert printed(out.stdout, "exact") is True
    assert printed(out.stdout, "kinds") == ["anonymous"]
    assert printed(out.stdout, "fallbacks") == 0
    assert printed(out.stdout, "warnings") == []
    assert printed(out.stdout, "workers") >= 1
    assert printed(out.stdout, "worker_held") == []
    assert printed(out.stdout, "left") == []
    assert printed(out.stdout, "held") == []


@needs_root
@pytest.mark.parametrize("root", ["ro+tmp", "ro"])
def test_read_only_root(start_method, root):
    """Kubernetes' readOnlyRootFilesystem, with a writable /tmp or none: the same."""
    check_repeated(run(start_method, "repeated", root=root))


@needs_root
@pytest.mark.parametrize("root", ["rw", "ro"])
def test_fork_servers_bind_in_dev_shm_without_a_temporary_folder(start_method, root):
    """A fork server's socket goes to multiprocessing's private folder: in the temporary
    folder as usual; with none writable, in /dev/shm, made the same way (mode 0700) and
    removed at exit. Other start methods make no such folder."""
    out = run(start_method, "fork-server-folder", root=root)
    assert out.returncode == 0, out.stdout + out.stderr
    assert printed(out.stdout, "returncode") == 0, out.stdout
    assert printed(out.stdout, "answer") is True
    folder = printed(out.stdout, "folder")
    if start_method in FORK_SERVERS:
        parent = "/dev/shm" if root == "ro" else tempfile.gettempdir()
        assert isinstance(folder, str) and os.path.dirname(folder) == parent, folder
        assert os.path.basename(folder).startswith("pymp-"), folder
        assert printed(out.stdout, "mode") == 0o700
        assert printed(out.stdout, "sockets") >= 1  # the server's
    else:
        assert folder is None
    assert printed(out.stdout, "gone") is True  # once the program has exited
    assert printed(out.stdout, "pymp_left") == []


@needs_root
@pytest.mark.parametrize("method", FORK_SERVERS, ids=method_id)
def test_no_folder_for_a_fork_servers_socket_says_what_to_do(method):
    """Neither a temporary folder nor /dev/shm writable: making the executor fails at
    once, saying why and what to do (not with tempfile's bare "No usable temporary
    directory")."""
    setup = ROOTS["ro"] + "mount -o remount,ro /dev/shm && "
    out = in_namespace(SCENARIOS, method, "no-folder", setup=setup)
    assert out.returncode == 0, out.stdout + out.stderr
    kind, message = printed(out.stdout, "error")
    assert kind == "FileNotFoundError", message
    assert "binds its socket in a private folder" in message, message
    assert "No usable temporary directory" in message, message
    assert "/dev/shm is not writable either" in message, message
    assert "set TMPDIR to a writable folder" in message, message


@needs_root
@pytest.mark.parametrize("root", ["rw", "ro"])
def test_doctor_says_which_kind_and_why(root):
    """In a 64 MB /dev/shm: not a warning (what does not fit is anonymous), and the
    kind named; under a read-only root without /tmp, a warning that says what it costs."""
    out = run(None, "doctor", root=root)
    assert out.returncode == 0, out.stdout + out.stderr
    found = {topic: (status, detail) for topic, status, detail in printed(out.stdout, "findings")}
    assert found["shared memory"][0] == "ok"
    assert "small (Docker's default is 64 MB)" in found["shared memory"][1]
    assert found["segments"][0] == "ok"
    assert "larger ones go to anonymous shared memory (memfd)" in found["segments"][1]
    assert "workers pass theirs to the parent" in found["segments"][1]
    status, detail = found["fallback folder"]
    if root == "ro":
        assert status == "warning" and "is not writable" in detail, detail
        status, detail = found["fork servers"]
        assert status == "ok" and "socket in a private folder of /dev/shm" in detail, detail
    else:
        assert status == "ok", detail
        assert "fork servers" not in found  # multiprocessing's usual place


# ---------------------------------------------------------------------------------------
# Anonymous segments themselves (no namespace needed)
# ---------------------------------------------------------------------------------------


def held(name: str) -> bool:
    """Whether this process holds the anonymous segment ``name`` open."""
    label = name.split(":", 2)[2]
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{label} (deleted)":
                return True
        except OSError:
            continue
    return False


def test_another_process_maps_an_anonymous_segment_by_name():
    """Reached through /proc/<creator>/fd/<n> by a program that knows only its name; gone
    once unlinked, for it and for :func:`existing`."""
    data = memoryview(b"sharexec" * 1000)
    mapping = _segments.create_anonymous(1 << 20, lambda write: write(0, data))
    name = mapping.name
    assert _segments.anonymous(name) and _segments.existing([name]) == {name}
    code = (
        "import sys; from sharexec import _segments; "
        "m = _segments.attach(sys.argv[1], 1 << 20, private=False); "
        "print(bytes(m[:16]).decode()); m[:4] = b'SHAR'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, name], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "sharexecsharexec", done.stderr
    assert bytes(mapping[:8]) == b"SHARexec"  # written there, seen here
    _segments.unlink(name)
    assert not held(name)
    assert _segments.existing([name]) == set()
    with pytest.raises(SegmentError):
        _segments.attach(name, 1 << 20, private=True)
    assert bytes(mapping[:8]) == b"SHARexec"  # the mapping keeps the memory
    mapping.close()


def test_a_fork_servers_folder_falls_back_to_dev_shm():
    """Where tempfile finds no writable folder (here: its folder is made missing),
    multiprocessing's private folder is made in /dev/shm (mode 0700), multiprocessing
    finds it there, and it is removed at exit; with no fallback either, the error says
    what to do."""
    code = """
import os, sys, tempfile
from multiprocessing import util
from sharexec._loky import temp_folder
tempfile.tempdir = sys.argv[1]
print(temp_folder.fallback_parent())
folder = temp_folder.fork_server_folder()
print(folder, oct(os.stat(folder).st_mode & 0o777), util.get_temp_dir() == folder)
"""
    missing = "/nonexistent-sharexec-test"
    done = subprocess.run(
        [sys.executable, "-c", code, missing], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    parent, (folder, mode, found) = done.stdout.split("\n")[0], done.stdout.split()[1:]
    assert parent == "/dev/shm"
    assert os.path.dirname(folder) == "/dev/shm" and "/pymp-" in folder
    assert (mode, found) == ("0o700", "True")
    assert not os.path.exists(folder)  # removed at exit
    fails = code.replace("print(temp", "temp_folder.FALLBACK_PARENTS = (sys.argv[1],)\nprint(temp")
    done = subprocess.run(
        [sys.executable, "-c", fails, missing], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.split("\n")[0] == "", done.stdout  # fallback_parent: none is writable
    assert "FileNotFoundError" in done.stderr, done.stderr
    assert "set TMPDIR to a writable folder" in done.stderr, done.stderr


def test_a_reused_descriptor_is_not_taken_for_a_freed_segment():
    """A freed segment's descriptor number, taken by another file, never opens that one."""
    first = _segments.create_anonymous(4096)
    name = first.name
    _segments.unlink(name)
    other = os.memfd_create("not-sharexec")  # the lowest free number: the freed one
    try:
        assert name.startswith(f"memfd:{other}:")
        with pytest.raises(SegmentError) as raised:
            _segments.attach(name, 4096, private=False)
        assert raised.value.errno == errno.ENOENT
        assert _segments.existing([name]) == set()
    finally:
        os.close(other)
        first.close()


def test_a_forked_child_holds_no_descriptor_of_its_parent():
    """A forked child closes the anonymous segments' descriptors it inherited (they would
    keep the memory after the parent frees it); its mapping of them stays readable."""
    mapping = _segments.create_anonymous(4096, lambda write: write(0, memoryview(b"kept")))
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = not held(mapping.name) and bytes(mapping[:4]) == b"kept"
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert held(mapping.name)  # the parent's stays
    finally:
        _segments.unlink(mapping.name)
        mapping.close()


def test_out_of_descriptors_raises_the_soft_limit():
    """Each anonymous segment holds a descriptor: at the soft limit, it is raised toward
    the hard one; at the hard one, creating fails as out of descriptors (which the
    caller turns into pickling, with one warning)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 256:
        pytest.skip(f"the hard limit of open files is {hard}: too low to raise toward")
    code = """
import resource
from sharexec import _segments
from sharexec.errors import SegmentError
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
made = [_segments.create_anonymous(4096) for _ in range(100)]
print("raised", resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 64)
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
try:
    while True:
        made.append(_segments.create_anonymous(4096))
except SegmentError as exc:
    print("errno", exc.errno in _segments.OUT_OF_DESCRIPTORS, len(made) < 128)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["raised", "True", "errno", "True", "True"], done.stderr


def test_descriptors_pass_when_the_receivers_numbers_are_above_1024():
    """Anonymous segments raise the limit of open files, so the receiving socket and its
    connections may get numbers above 1,024, which ``select()`` refuses: they still
    pass."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit of open files is {hard}: no number above 1,024")
    code = """
import os, resource
from sharexec import _passing, _segments, _tracking, _transport
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
assert _passing.listen()
mapping = _segments.create_anonymous(4096, lambda write: write(0, memoryview(b"sent")))
fd = _segments.pass_on(mapping.name)
_passing.send(os.getpid(), fd, _segments.anonymous_label(mapping.name), next(_transport._tokens))
os.close(fd)
print(bytes(_tracking.adopt(mapping.name, 4096)[:4]).decode())
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["sent"], done.stderr[-2000:]


def test_a_descriptor_that_never_comes_fails_the_result_clearly(monkeypatch):
    """A result names a worker's anonymous segment whose descriptor never arrives (lost
    on its way): the parent waits a bounded time, then the result fails with an error
    that says so, and the pool goes on."""
    import pickle
    import time

    import numpy as np

    from sharexec import _passing, _wire

    monkeypatch.setattr(_passing, "WAIT_SECONDS", 0.3)
    assert _passing.listen()
    buffers: list = []
    payload = pickle.dumps(np.ones(512), protocol=5, buffer_callback=buffers.append)
    name = f"memfd:7:{_segments.new_name()}"  # a worker's segment, never passed
    started = time.monotonic()
    outcome = _wire.load_result(payload, [(name, 4096, 0, 4096)], [], token=-1)
    assert 0.3 <= time.monotonic() - started < 5
    assert isinstance(outcome, _wire.Failure)
    assert "did not arrive within 0.3 s" in str(outcome.error)


def test_passed_descriptors_are_taken_by_label_and_dropped_with_their_executor():
    """What a worker sends (here: this process, through its own outbox): taken by the
    segment's label under a name of the receiver's; one sent for an executor that
    reads no more results is closed, not kept."""
    from sharexec import _passing, _tracking, _transport

    kept, dropped_token = next(_transport._tokens), next(_transport._tokens)  # no executor's
    assert _passing.listen()
    mapping = _segments.create_anonymous(4096, lambda write: write(0, memoryview(b"sent")))
    label = _segments.anonymous_label(mapping.name)
    fd = _segments.pass_on(mapping.name)
    try:
        _passing.send(os.getpid(), fd, label, kept)
    finally:
        os.close(fd)
    adopted = _tracking.adopt(mapping.name, 4096)
    assert adopted.name != mapping.name and _segments.anonymous_label(adopted.name) == label
    assert bytes(adopted[:4]) == b"sent"
    assert _segments.existing([adopted.name]) == {adopted.name}  # others can open it
    dropped = _segments.create_anonymous(4096)
    fd = _segments.pass_on(dropped.name)
    try:
        _passing.send(os.getpid(), fd, _segments.anonymous_label(dropped.name), dropped_token)
    finally:
        os.close(fd)
    _passing.drop(dropped_token)
    with pytest.raises(SegmentError, match="did not arrive"):
        _passing.take(_segments.anonymous_label(dropped.name), 0.1)
    held = {
        os.readlink(f"/proc/self/fd/{n}")
        for n in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{n}")
    }
    assert not any(_segments.anonymous_label(dropped.name) in h for h in held)
    del adopted, mapping, dropped
