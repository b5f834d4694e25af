"""Security: unguessable names, private modes, a private sweeper.

* Segment names are ``sharexec-<pid>-<namespace>.<random>`` (the creator's PID namespace;
  none where there is none), the random part 12 characters of the URL-safe base64
  alphabet (72 bits) from the operating system's CSPRNG: 1,000 names are all distinct,
  use the whole alphabet, and do not repeat after seeding Python's or NumPy's
  generators, nor in a forked child.
* Segments in /dev/shm are created with mode 0600, whatever the umask (the tests run with
  umask 0, so a mode asked for wider would show): a shared array's, the copy of an
  argument while a task holds it (stat-ed by the worker), a result's (stat-ed by the
  worker while it packs the result), a shared array a worker made and returned.
* Fallback files are 0600 in folders of mode 0700 (a real 1 MB /dev/shm in a private
  mount namespace; root only, as tests/test_faults.py does).
* The sweeper imports nothing from the user's working directory.
* The sweeper listens in the abstract socket namespace: no file in the file system. Any
  local user can read its address in /proc/net/unix and connect (abstract sockets have
  no permissions), so it hears only processes of its own user (root only: the test
  connects as user nobody and asks it to unlink a file).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import stat
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from test_faults import in_small_shm, needs_root

import sharexec
from sharexec import _segments, _session

pytestmark = pytest.mark.timeout(120)

RANDOM_PART = re.compile(r"[A-Za-z0-9_-]{12}")  # secrets.token_urlsafe(9): 72 bits
ALPHABET = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def random_part(name: str) -> str:
    prefix = f"{_segments.PREFIX}{os.getpid()}-{_segments.pid_namespace()}."
    assert name.startswith(prefix), name
    return name[len(prefix) :]


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def mapping_of(a: np.ndarray) -> _segments.Mapping:
    """The segment mapping an array's memory comes from (the end of its base chain)."""
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    assert isinstance(base, _segments.Mapping), f"not in a segment: {type(base)}"
    return base


@pytest.fixture
def umask_0() -> Iterator[None]:
    """No umask: a segment's mode is exactly the mode sharexec asks for."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


# ---------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------


def test_names_are_random_and_unguessable():
    names = [_segments.new_name() for _ in range(1000)]
    parts = [random_part(n) for n in names]
    assert len(set(names)) == 1000
    assert all(RANDOM_PART.fullmatch(p) for p in parts), parts[:5]
    # macOS's limit on a name (31 with the leading slash; no PID namespace there) holds
    # for any pid
    longest = f"/{_segments.PREFIX}{4_194_304}-{parts[0]}"
    assert len(longest) <= 31, longest
    # 12,000 characters: each of the 64 symbols appears, in every position of the name
    assert set("".join(parts)) == ALPHABET
    for i in range(12):
        assert len({p[i] for p in parts}) >= 56, f"position {i} is not uniform"
    # Not from a generator a program seeds: the same seeds give other names
    again = []
    for _ in range(2):
        random.seed(0)
        np.random.seed(0)
        again.append(_segments.new_name())
    assert again[0] != again[1]


def test_forked_child_draws_other_names(tmp_path):
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(write_end, " ".join(_segments.new_name() for _ in range(50)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        child = f.read().split()
    os.waitpid(pid, 0)
    mine = [_segments.new_name() for _ in range(50)]
    assert len(child) == 50
    # the random part is the last 12 characters (it may hold "-" itself)
    assert not {n[-12:] for n in child} & {n[-12:] for n in mine}


# ---------------------------------------------------------------------------------------
# Modes of live segments
# ---------------------------------------------------------------------------------------


def stat_my_argument(a: np.ndarray) -> tuple[str, int, int]:
    """In the worker: the segment of the copy this task received, and its mode and owner."""
    name = mapping_of(a).name
    st = os.stat(os.path.join(_segments.SHM_FOLDER, name))
    return name, stat.S_IMODE(st.st_mode), st.st_uid


class SegmentsProbe:
    """Pickled after a large result in the same reply: by then the worker has copied the
    result into its segment, and the probe records the mode of this worker's segments."""

    def __reduce__(self) -> Any:
        found = {}
        for name in _segments.listdir():
            if name.startswith(f"{_segments.PREFIX}{os.getpid()}-"):
                st = os.stat(os.path.join(_segments.SHM_FOLDER, name))
                found[name] = (stat.S_IMODE(st.st_mode), st.st_uid)
        return dict, (found,)


def make_result(n: int) -> tuple[np.ndarray, SegmentsProbe]:
    os.umask(0)  # forkserver workers do not inherit the test's umask
    return np.arange(n, dtype=np.float64), SegmentsProbe()


def make_shared_result(n: int) -> np.ndarray:
    os.umask(0)
    return sharexec.full(n, 3.0)


def test_segments_are_created_mode_0600(executor, umask_0):
    shared = sharexec.zeros(1_000_000)
    name = mapping_of(shared).name
    path = os.path.join(_segments.SHM_FOLDER, name)
    assert mode(path) == 0o600, oct(mode(path))
    assert os.stat(path).st_uid == os.geteuid()

    # the copy of a large private argument, while the task holds it
    arg_name, arg_mode, arg_uid = executor.submit(stat_my_argument, np.ones(1_000_000)).result()
    assert arg_name.startswith(_segments.PREFIX) and arg_name != name
    assert (arg_mode, arg_uid) == (0o600, os.geteuid()), oct(arg_mode)

    # a large result's segment, in the worker, while the result is being sent
    result, probe = executor.submit(make_result, 1_000_000).result()
    assert np.array_equal(result, np.arange(1_000_000, dtype=np.float64))
    assert mapping_of(result).name in probe, probe  # the probe saw the result's segment
    assert probe and all(m == (0o600, os.geteuid()) for m in probe.values()), probe

    # a shared array the worker made and handed over: it lives on in the parent
    made = executor.submit(make_shared_result, 1_000_000).result()
    assert sharexec.is_shared(made)
    made_path = os.path.join(_segments.SHM_FOLDER, mapping_of(made).name)
    assert mode(made_path) == 0o600, oct(mode(made_path))


# ---------------------------------------------------------------------------------------
# Fallback files and folders
# ---------------------------------------------------------------------------------------

FALLBACK = """
import glob, stat, warnings
from sharexec import _segments

def mode(path):
    return oct(stat.S_IMODE(os.stat(path).st_mode))

class SpillProbe:
    # pickled after a large result: the modes of this worker's spill folders and files
    def __reduce__(self):
        spill = os.environ["SHAREXEC_TEMP_FOLDER"]
        folders = glob.glob(os.path.join(spill, f"sharexec-{os.getpid()}-*"))
        files = [f for d in folders for f in glob.glob(os.path.join(d, "*"))]
        modes = [("folder", mode(d)) for d in folders] + [("file", mode(f)) for f in files]
        return sorted, (modes,)

def stat_argument(a):
    os.umask(0)
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    name = base.obj.name if isinstance(base, memoryview) else base.name
    return name, mode(name), mode(os.path.dirname(name)), np.arange(1_000_000.0), SpillProbe()

if __name__ == "__main__":
    os.umask(0)
    warnings.simplefilter("ignore", sharexec.SharexecWarning)
    # The files of the last fallback: the parent's anonymous segments (memfd) come first
    _segments._anonymous_supported = False
    spill = os.environ["SHAREXEC_TEMP_FOLDER"]
    # the module API: shared memory cannot hold 8 MB, so the segment is a file
    m = _tracking.new_private(8 << 20, spill_to=spill)
    print("api", os.path.isabs(m.name), mode(m.name), mode(os.path.dirname(m.name)))
    del m
    # through the executor: an argument spilled by the parent, a result by the worker
    with sharexec.SharedProcessPoolExecutor(2, mp_context=METHOD) as ex:
        fut = ex.submit(stat_argument, np.ones(1_000_000))
        name, file_mode, folder_mode, result, probe = fut.result()
    print("argument", os.path.isabs(name), file_mode, folder_mode)
    print("result", probe)
    print("exact", np.array_equal(result, np.arange(1_000_000.0)))
"""


@needs_root
def test_fallback_files_are_0600_in_folders_0700(start_method, tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    spill.chmod(0o777)  # the folder sharexec makes inside must be private all the same
    out = in_small_shm(tmp_path, FALLBACK, start_method, size="1m", spill=spill)
    assert out.returncode == 0, out.stderr
    assert "api True 0o600 0o700" in out.stdout, out.stdout
    assert "argument True 0o600 0o700" in out.stdout, out.stdout
    assert "result [('file', '0o600'), ('folder', '0o700')]" in out.stdout, out.stdout
    assert "exact True" in out.stdout, out.stdout
    deadline = time.monotonic() + 10  # the scenario's sweeper may still be finishing
    while list(spill.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(spill.iterdir()), "spill files left behind"


# ---------------------------------------------------------------------------------------
# The sweeper's socket
# ---------------------------------------------------------------------------------------


def unix_sockets() -> dict[int, str]:
    """Bound Unix sockets of this network namespace: inode -> path ("@…": abstract)."""
    found = {}
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) >= 8:
                found[int(fields[6])] = fields[7]
    return found


def test_sweeper_socket_is_abstract(no_leaks):
    address, _ = _session.sweeper_address()  # this process's sweeper, started if need be
    assert address.startswith(b"\0"), address  # the abstract namespace: no file
    assert re.fullmatch(rb"\0sharexec-sweeper-[0-9a-f]{24}", address), address  # 96 bits
    sweeper = _session._channel.sweeper_pid
    link = os.readlink(f"/proc/{sweeper}/fd/3")  # its listening socket
    inode = int(re.fullmatch(r"socket:\[(\d+)\]", link).group(1))
    assert unix_sockets()[inode] == "@" + address[1:].decode()


def _connect_as_nobody_and_claim(address: bytes, path: str) -> int:
    """Fork a child that drops to user nobody, connects to the sweeper and claims ``path``
    as a segment it owns, then exits: a sweeper that obeys it unlinks ``path``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(address)
            with contextlib.suppress(OSError):  # a sweeper hanging up on strangers: fine
                conn.sendall(f"R {path}\n".encode())
            conn.close()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="changing user needs root")
def test_sweeper_ignores_other_users(no_leaks, tmp_path):
    address, _ = _session.sweeper_address()
    assert "@" + address[1:].decode() in unix_sockets().values()  # anyone can read it
    private = tmp_path / "private"
    private.mkdir(mode=0o700)  # nobody cannot even look in here
    victim = private / f"{_segments.PREFIX}precious"
    victim.write_text("the owner's data")
    assert _connect_as_nobody_and_claim(address, str(victim)) == 0
    deadline = time.monotonic() + 2
    while victim.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert victim.exists(), "another user had the sweeper unlink the owner's file"


def test_the_sweeper_imports_nothing_from_the_working_directory(tmp_path):
    """A module in the user's working directory must not stand in for the standard
    library's in the sweeper (which ``python -c`` would import from there first)."""
    import subprocess
    import sys

    (tmp_path / "socket.py").write_text("raise SystemExit('socket.py of the working directory')\n")
    script = tmp_path / "scripts" / "make_shared.py"  # its folder, not the cwd, on sys.path
    script.parent.mkdir()
    script.write_text(
        "import sharexec\n"
        "from sharexec import _session\n"
        "a = sharexec.zeros(10)  # the sweeper starts, to hear of the segment\n"
        "assert _session._channel.sweeper_pid\n"
    )
    # The sweeper inherits stderr: run() returns once it has exited too (the parent gone).
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "working directory" not in done.stderr
