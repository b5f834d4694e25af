"""Shared-memory segments at the level of the operating system.

This module owns every system call sharexec makes about shared memory: naming a segment,
creating it with its space reserved, mapping it (shared, or private copy-on-write),
telling whether this process wrote into a private mapping (:func:`written`) or whether a
segment still exists (:func:`existing`), and unlinking it. It decides nothing about
lifetimes: :mod:`sharexec._tracking` says when to create, attach and unlink; besides it,
only the sweeper process (:mod:`sharexec._sweeper`, freeing what dead processes left)
and ``doctor --clean`` (stale segments of dead processes) call :func:`unlink`.

Platform: POSIX shared memory (``shm_open``), that is ``/dev/shm`` on Linux. Names are
``sharexec-<pid>-<namespace>.<random>``: a fixed prefix so stale segments can be found,
the creating process's id and, on Linux, its PID namespace (the inode number of
``/proc/self/ns/pid``: a pid means a process only within its namespace, and programs in
two namespaces may share one ``/dev/shm``), and 72 random bits, so they cannot be
guessed. Where there are no PID namespaces (macOS) the name is ``sharexec-<pid>-<random>``,
at most 30 characters with the leading slash, inside macOS's limit of 31;
:func:`creator` reads both (older versions of sharexec wrote the short form on Linux too).

A name that starts with ``memfd:`` is an *anonymous* segment instead (Linux): a
``memfd_create`` file, which no folder holds and whose size counts against the process's
memory limit, not against ``/dev/shm`` (64 MB by default in a container). Its name is
``memfd:<descriptor>:<label>``, the label a name as above (its creator and PID namespace,
72 random bits), also the file's own name in ``/proc``. The creator keeps the descriptor
open for as long as the segment lives (:func:`unlink` closes it, and so does the kernel at
its death: nothing is left to sweep); another process of its PID namespace opens it
through ``/proc/<creator>/fd/<descriptor>`` and checks that the file it got bears the
label (a descriptor number is reused once closed). A forked child closes the descriptors
it inherited (it would keep their memory alive); its mappings stay.

A name that is an absolute path is a *file-backed* segment: a file (mode 0600) in a
private folder (mode 0700) on disk, the last fallback. Every function here takes the
three kinds.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import mmap
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from .errors import SegmentError

try:
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

__all__ = [
    "ANONYMOUS",
    "OUT_OF_DESCRIPTORS",
    "PREFIX",
    "SHM_FOLDER",
    "Mapping",
    "adopt_anonymous",
    "anonymous",
    "anonymous_label",
    "anonymous_supported",
    "attach",
    "create",
    "create_anonymous",
    "creator",
    "existing",
    "listdir",
    "memory_limit",
    "new_folder",
    "new_name",
    "pass_on",
    "pid_namespace",
    "populate",
    "removals",
    "unlink",
    "written",
    "zero_from",
]

PREFIX = "sharexec-"
SHM_FOLDER = "/dev/shm"
ANONYMOUS = "memfd:"


class Mapping(mmap.mmap):
    """A mapping of one segment into this process; it holds no file descriptor.

    A subclass of :class:`mmap.mmap` only so it can carry its segment's name and address
    and be weakly referenced. Arrays built on it keep it alive; it is unmapped when the
    last of them is collected (see :func:`_map` for how it is made).
    """

    name: str
    address: int
    owner: object  # what must outlive this mapping, e.g. the tracking handle that unlinks
    private: bool  # copy-on-write: this process's writes stay its own


def _check_platform() -> None:
    if _posixshmem is None:  # pragma: no cover - Windows
        raise SegmentError(
            errno.ENOSYS, f"sharexec needs POSIX shared memory, not available on {sys.platform}"
        )


def new_name() -> str:
    """A fresh, unguessable segment name, saying which process makes it."""
    # What secrets.token_urlsafe(9) does, without the hashlib and OpenSSL that importing
    # secrets loads in every worker (a few ms of each start-up).
    token = base64.urlsafe_b64encode(os.urandom(9)).rstrip(b"=").decode()
    namespace = pid_namespace()
    if namespace is None:
        return f"{PREFIX}{os.getpid()}-{token}"
    return f"{PREFIX}{os.getpid()}-{namespace}.{token}"


# This process's PID namespace, with the pid it was read in, e.g. (4711, 4026531836): a
# forked child reads its own (a child forked after ``unshare(CLONE_NEWPID)`` is in another).
_namespace: tuple[int, int | None] = (0, None)


def pid_namespace() -> int | None:
    """This process's PID namespace: the inode number of ``/proc/self/ns/pid``, the
    ``4026531836`` of ``pid:[4026531836]``; None where there is none to read (not Linux,
    no ``/proc``)."""
    global _namespace
    pid = os.getpid()
    if _namespace[0] != pid:
        try:
            inode: int | None = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            inode = None
        _namespace = (pid, inode)
    return _namespace[1]


def creator(name: str) -> tuple[int, int | None] | None:
    """Who made the segment ``name`` (see :func:`new_name`): its pid and PID namespace,
    the namespace None if the name does not say (made where there is none, or by an
    older sharexec); None if ``name`` is no sharexec segment name."""
    if not name.startswith(PREFIX):
        return None
    pid, _, rest = name[len(PREFIX) :].partition("-")
    if not pid.isdigit() or not rest:
        return None
    # The random part never holds a dot: one after digits ends the namespace.
    namespace, dot, token = rest.partition(".")
    if dot and namespace.isdigit() and token:
        return int(pid), int(namespace)
    return int(pid), None


def _map(fd: int, name: str, size: int, private: bool, populate: bool = False) -> Mapping:
    """Map ``size`` bytes of the open segment ``fd``; the mapping keeps no descriptor.

    :class:`mmap.mmap` keeps a duplicate of the descriptor it maps, so closing ``fd``
    after mapping frees nothing: one descriptor per live segment (shared arrays, copies
    in flight, pooled segments, results kept), and at the usual soft limit of 1,024,
    results and the program's own ``open`` calls failed with EMFILE. A mapping needs no
    descriptor. From Python 3.13, ``trackfd=False`` says so; before, the object is made
    as an anonymous mapping of the right size (which holds no descriptor) and the
    segment is mapped over it at the same address (``MAP_FIXED``, libc's ``mmap`` by
    ctypes), so that the object's ``close`` and collection unmap the segment as its own.
    Both cost the same as a plain ``mmap.mmap`` (about 26 us for shm_open, map and close
    of 1 MiB, 5,000 times each, a load average of 8).
    """
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    if private:  # copy-on-write: this process's writes stay its own
        flags = mmap.MAP_PRIVATE
    elif populate:  # shared, every page mapped up front: one call instead of a fault each
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    else:
        flags = mmap.MAP_SHARED
    if sys.version_info >= (3, 13):
        mapping = Mapping(fd, size, flags=flags, prot=prot, trackfd=False)
        address = _address(mapping)
    else:
        # A placeholder: private anonymous memory, never touched, replaced at once.
        mapping = Mapping(-1, size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE, prot=prot)
        address = _address(mapping)
        _map_fixed(mapping, address, size, prot, flags, fd)
    mapping.name = name
    mapping.address = address
    mapping.owner = None
    mapping.private = private
    return mapping


# madvise(2): map every page of a range for writing, in one call (Linux 5.14 and later;
# not in the mmap module before Python 3.14).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else 0)


def populate(mapping: Mapping, offset: int, length: int) -> None:
    """Map every page of ``[offset, offset + length)`` of a shared ``mapping`` for writing,
    in one call: about 40 ms per 200 MB, where writing through pages not mapped yet takes
    a fault per page (130 ms more, here). Does nothing where the kernel cannot (before
    Linux 5.14, other systems): the writes then fault as before.
    """
    if not _MADV_POPULATE_WRITE or length <= 0:
        return
    start = offset - offset % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(
            _MADV_POPULATE_WRITE, start, min(length + offset - start, len(mapping) - start)
        )


def _address(mapping: Mapping) -> int:
    probe = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(probe)
    del probe  # releases the buffer export, so the mapping can be closed later
    return address


# Values of <sys/mman.h> that the mmap module does not offer before Python 3.13: the same
# on Linux (x86, ARM, RISC-V) and macOS. MAP_NORESERVE (Linux only): the placeholder is
# not counted against the commit limit.
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
_libc_mmap: Any = None


def _map_fixed(mapping: Mapping, address: int, size: int, prot: int, flags: int, fd: int) -> None:
    """Map ``fd`` over the placeholder ``mapping`` at ``address`` (closed if that fails)."""
    global _libc_mmap
    if _libc_mmap is None:
        libc_mmap = ctypes.CDLL(None, use_errno=True).mmap
        libc_mmap.restype = ctypes.c_void_p
        libc_mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        _libc_mmap = libc_mmap
    placed = _libc_mmap(address, size, prot, flags | _MAP_FIXED, fd, 0)
    if placed != address:
        err = ctypes.get_errno() or errno.ENOMEM
        mapping.close()  # unmaps whatever is left at the address
        raise OSError(err, os.strerror(err))


def _open(name: str, flags: int) -> int:
    if os.path.isabs(name):
        return os.open(name, flags | os.O_CLOEXEC, 0o600)
    if name.startswith(ANONYMOUS):
        return _open_anonymous(name, flags)
    _check_platform()
    return int(_posixshmem.shm_open("/" + name, flags, 0o600))


def _where(name: str) -> str:
    if name.startswith(ANONYMOUS):
        return "anonymous shared memory"
    return os.path.dirname(name) if os.path.isabs(name) else SHM_FOLDER


def anonymous(name: str) -> bool:
    """Whether ``name`` is an anonymous (``memfd_create``) segment's."""
    return name.startswith(ANONYMOUS)


def anonymous_supported() -> bool:
    """Whether this system makes anonymous segments that others can open: Linux 3.17
    and later, with ``/proc`` mounted (tried once per process: about 20 us)."""
    global _anonymous_supported
    if _anonymous_supported is None:
        _anonymous_supported = _try_anonymous()
    return _anonymous_supported


_anonymous_supported: bool | None = None


def _try_anonymous() -> bool:
    if not hasattr(os, "memfd_create"):  # pragma: no cover - not Linux
        return False
    try:
        fd = os.memfd_create(f"{PREFIX}probe", os.MFD_CLOEXEC)
    except OSError:
        return False
    try:
        os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC))
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def memory_limit() -> int:
    """The memory this process may use, which anonymous segments count against: the
    machine's, or its memory cgroup's limit where smaller (a container's: cgroup v2's
    ``memory.max``, v1's ``memory.limit_in_bytes``); 0 if unknown."""
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # pragma: no cover - not POSIX
        return 0
    cgroup = ""
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as lines:
        cgroup = next((line[3:].strip() for line in lines if line.startswith("0::")), "")
    for path in (
        f"/sys/fs/cgroup{cgroup.rstrip('/')}/memory.max",
        "/sys/fs/cgroup/memory.max",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    ):
        with contextlib.suppress(OSError, ValueError), open(path) as file:
            limit = min(limit, int(file.read()))  # "max" (no limit): ValueError
    return limit


def _split_anonymous(name: str) -> tuple[int, int, int | None, str]:
    """The descriptor, creator's pid and PID namespace, and label of an anonymous
    segment's name (:class:`SegmentError` if it is none)."""
    descriptor, _, label = name[len(ANONYMOUS) :].partition(":")
    made = creator(label)
    if not descriptor.isdigit() or made is None:
        raise SegmentError(errno.EINVAL, f"not a segment name: {name!r}")
    return int(descriptor), made[0], made[1], label


# The anonymous segments this process made and keeps open, by descriptor, e.g.
# {7: "memfd:7:sharexec-41-4026531836.Zm9vYmFy"}: what unlink may close, and what a
# forked child closes.
_anonymous: dict[int, str] = {}


def _open_anonymous(name: str, flags: int) -> int:
    """Open the anonymous segment ``name`` anew, through its creator's descriptor."""
    descriptor, pid, namespace, label = _split_anonymous(name)
    if namespace is not None and pid_namespace() not in (None, namespace):
        raise SegmentError(
            errno.ENOENT, f"segment {name!r} was made in another PID namespace: unreachable"
        )
    # flags carry no O_CREAT here: opening the creator's file never makes one.
    fd = os.open(f"/proc/{pid}/fd/{descriptor}", flags | os.O_CLOEXEC)
    try:
        if not _bears(os.readlink(f"/proc/self/fd/{fd}"), label):
            raise FileNotFoundError(errno.ENOENT, "the descriptor holds another file now")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _bears(target: str, label: str) -> bool:
    """Whether ``target``, where a descriptor leads, is the anonymous segment ``label``
    names: its file bears that label, but for the pid (the holder's in ``label``, the
    creator's in the file's name: the same unless a worker passed it on)."""
    prefix, suffix = f"/memfd:{PREFIX}", " (deleted)"
    if not (target.startswith(prefix) and target.endswith(suffix)):
        return False
    made = target[len(prefix) : -len(suffix)].partition("-")[2]
    return bool(made) and made == label[len(PREFIX) :].partition("-")[2]


def anonymous_label(name: str) -> str:
    """The label of the anonymous segment ``name``: the same in every process that
    holds it (see :func:`adopt_anonymous`)."""
    return _split_anonymous(name)[3][len(PREFIX) :].partition("-")[2]


def pass_on(name: str) -> int:
    """The descriptor of this process's anonymous segment ``name``, no longer this
    process's to close at :func:`unlink`: the caller passes it on, then closes it."""
    descriptor = _split_anonymous(name)[0]
    if _anonymous.get(descriptor) != name:
        raise SegmentError(errno.EBADF, f"this process does not hold segment {name!r}")
    del _anonymous[descriptor]
    return descriptor


def adopt_anonymous(fd: int, name: str, size: int) -> Mapping:
    """The anonymous segment ``name``, whose descriptor ``fd`` another process passed to
    this one, mapped shared; this process holds it now, under a name of its own (the
    same label, this process's pid) until :func:`unlink`. Closes ``fd`` if it fails."""
    own_label = f"{PREFIX}{os.getpid()}-{anonymous_label(name)}"
    own = f"{ANONYMOUS}{fd}:{own_label}"
    try:
        if not _bears(os.readlink(f"/proc/self/fd/{fd}"), own_label):
            raise SegmentError(errno.EINVAL, f"the descriptor passed is not segment {name!r}")
        mapping = _map(fd, own, max(size, 1), private=False)
    except BaseException:
        os.close(fd)
        raise
    _anonymous[fd] = own
    return mapping


def _memfd_create(label: str) -> int:
    """A new memfd; out of descriptors, the soft limit is raised toward the hard one once."""
    try:
        return os.memfd_create(label, os.MFD_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.EMFILE or not _raise_open_files_limit():
            raise
    return os.memfd_create(label, os.MFD_CLOEXEC)


def _raise_open_files_limit() -> bool:
    """Raise this process's soft limit of open files toward its hard limit (doubled, at
    least 1,024 more); False if it is at the hard limit already."""
    import resource  # POSIX only; needed only here

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft >= hard:
        return False
    new = max(2 * soft, soft + 1024)
    if hard != resource.RLIM_INFINITY:
        new = min(new, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (OSError, ValueError):  # pragma: no cover - refused
        return False
    return True


def _close_inherited() -> None:
    """In a forked child: close the anonymous segments' descriptors of the parent (its
    mappings of them stay); holding them would keep their memory after the parent frees
    them. Not the parent's to track either."""
    for fd in list(_anonymous):
        with contextlib.suppress(OSError):
            os.close(fd)
    _anonymous.clear()


os.register_at_fork(after_in_child=_close_inherited)


# What a new segment is given to hold before it is mapped: called with ``write(offset,
# data)``, which puts ``data`` (a buffer) at ``offset`` in the segment.
Content = Callable[[Callable[[int, memoryview], None]], None]


def create(size: int, name: str, content: Content | None = None) -> Mapping:
    """Create the segment ``name`` of ``size`` bytes (mode 0600) and map it shared.

    The space is reserved up front (``posix_fallocate``), so a full shared-memory folder
    fails here with :class:`SegmentError` instead of killing the process with SIGBUS at
    the first write. The pages read as zeros, but for what ``content`` writes first
    (``content(write)``): ``os.pwrite`` into the new file, before the rest is reserved.
    A page written so is allocated and filled in one step, where a copy through a fresh
    mapping has it zeroed by the reservation, then faulted in, then written (128 MiB of
    a tensor's bytes: about half the CPU). Where nothing reserves space (macOS), the
    content is written through the mapping.
    """
    size = max(size, 1)
    if not os.path.isabs(name):
        _check_room(size)
    try:
        fd = _open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
    except OSError as exc:
        raise _failed(exc, f"cannot create a segment in {_where(name)}") from exc
    try:
        return _fill(fd, name, size, content)
    except BaseException:
        unlink(name)  # never created, as far as anyone else knows
        raise
    finally:
        os.close(fd)


def create_anonymous(size: int, content: Content | None = None) -> Mapping:
    """Create an anonymous segment of ``size`` bytes and map it shared; the descriptor
    stays open in this process until :func:`unlink` (the segment's name says which).

    Reserved and filled as :func:`create` does; its space counts against this process's
    memory limit, whatever the size of the shared-memory folder.
    """
    size = max(size, 1)
    label = new_name()
    try:
        fd = _memfd_create(label)
    except OSError as exc:
        raise _failed(exc, "cannot create a segment in anonymous shared memory") from exc
    name = f"{ANONYMOUS}{fd}:{label}"
    try:
        mapping = _fill(fd, name, size, content)
    except BaseException:
        os.close(fd)
        raise
    _anonymous[fd] = name
    return mapping


def _check_room(size: int) -> None:
    """Fail at once where the shared-memory folder has less than ``size`` bytes free,
    rather than after writing into it what fits (a statvfs: about 2 us)."""
    try:
        stat = os.statvfs(SHM_FOLDER)
    except OSError:
        return  # no folder: shm_open says so
    free = stat.f_bavail * stat.f_frsize
    if stat.f_blocks and size > free:
        raise SegmentError(
            errno.ENOSPC,
            f"cannot reserve {size:,} bytes in {SHM_FOLDER}: {free:,} bytes free",
        )


def _fill(fd: int, name: str, size: int, content: Content | None) -> Mapping:
    """Reserve ``size`` bytes of the new segment ``fd``, write ``content``, map it."""
    reserves = hasattr(os, "posix_fallocate")
    try:
        if reserves:
            if content is not None:
                content(lambda offset, data: _write(fd, offset, data))
            os.posix_fallocate(fd, 0, size)
        else:  # pragma: no cover - macOS reserves nothing; ftruncate is all it has
            os.ftruncate(fd, size)
    except OSError as exc:
        raise _failed(exc, f"cannot reserve {size:,} bytes in {_where(name)}") from exc
    try:
        mapping = _map(fd, name, size, private=False)
    except OSError as exc:
        raise _failed(exc, f"cannot map a segment of {size:,} bytes") from exc
    if content is not None and not reserves:  # pragma: no cover - macOS
        content(lambda offset, data: _write_mapped(mapping, offset, data))
    return mapping


def zero_from(mapping: Mapping, start: int) -> None:
    """Zero the bytes of ``mapping`` from ``start`` to its end.

    For a segment served again (a pooled one, a lent one) with new content of ``start``
    bytes: whoever maps it can reach all of it (an array's ``.base``, a worker's mapping
    of the whole segment), and must never read the bytes it held before. A memset, at
    memory speed (the pages of a warm segment are mapped already), without the GIL.
    """
    if start < len(mapping):
        ctypes.memset(mapping.address + start, 0, len(mapping) - start)


def _write(fd: int, offset: int, data: memoryview) -> None:
    """Write all of ``data`` at ``offset`` in ``fd`` (a large write may be cut short)."""
    data = data.cast("B")
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _write_mapped(mapping: Mapping, offset: int, data: memoryview) -> None:  # pragma: no cover
    with memoryview(mapping) as view:
        view[offset : offset + data.nbytes] = data.cast("B")


# Out of file descriptors: this process's limit (EMFILE) or the system's (ENFILE). A
# segment needs one only while it is opened and mapped, but a file-backed one needs one
# too: this is no reason to spill to disk (see _tracking._create).
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def _failed(exc: OSError, doing: str) -> SegmentError:
    """The error for ``doing`` (e.g. "cannot create a segment in /dev/shm") failing with
    ``exc``, naming the limit that was hit where the cause is one."""
    code = exc.errno or 0
    why = os.strerror(code)
    if code == errno.EMFILE:
        why += f" (this process's limit of open files, {_open_files_limit()}, is reached)"
    elif code == errno.ENFILE:
        why += " (the system's limit of open files is reached)"
    elif code == errno.ENOMEM and doing.startswith("cannot map"):
        why += " (too many mappings? see vm.max_map_count)"
    return SegmentError(code, f"{doing}: {why}")


def _open_files_limit() -> str:
    try:
        import resource  # POSIX only; needed only here
    except ImportError:  # pragma: no cover - Windows
        return "unknown"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"{soft:,}; ulimit -n raises it"


def attach(name: str, size: int, private: bool, populate: bool = False) -> Mapping:
    """Map an existing segment: shared (writes are seen by every process mapping it) or
    private (copy-on-write: this process's writes stay its own).

    ``populate`` (shared only) maps every page at once, for a segment about to be
    written whole: writing a warm segment through a fresh mapping otherwise takes a page
    fault per page, about 2.5x the memcpy. Not for private mappings, where it would copy
    every page up front.
    """
    try:
        fd = _open(name, os.O_RDONLY if private else os.O_RDWR)
    except OSError as exc:
        raise _failed(exc, f"cannot attach segment {name!r}") from exc
    try:
        return _map(fd, name, max(size, 1), private, populate and not private)
    except OSError as exc:
        raise _failed(exc, f"cannot map segment {name!r}") from exc
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Remove a segment's name (or an empty fallback folder); its memory is freed once no
    process maps it. An anonymous segment's name goes with its creator's descriptor:
    closed here in the creator, nothing to do elsewhere (a dead creator's is closed)."""
    if name.startswith(ANONYMOUS):
        descriptor = _split_anonymous(name)[0]
        if _anonymous.get(descriptor) == name:
            del _anonymous[descriptor]
            os.close(descriptor)
        return
    with contextlib.suppress(FileNotFoundError):
        if not os.path.isabs(name):
            _posixshmem.shm_unlink("/" + name)
        elif os.path.isdir(name):
            os.rmdir(name)
        else:
            os.unlink(name)


def new_folder(parent: str) -> str:
    """A new private folder (mode 0700) for file-backed segments, inside ``parent``."""
    try:
        return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent)
    except OSError as exc:
        raise SegmentError(
            exc.errno, f"cannot create a folder for segments in {parent}: {exc.strerror}"
        ) from exc


def listdir() -> list[str]:
    """Names of the sharexec segments that exist now (Linux; empty elsewhere)."""
    try:
        return sorted(n for n in os.listdir(SHM_FOLDER) if n.startswith(PREFIX))
    except FileNotFoundError:  # pragma: no cover - no /dev/shm
        return []


def existing(names: list[str]) -> set[str]:
    """Which of these segments still have their name: a look at each (2 us, whatever the
    folder holds), or at the whole folder when they are many (a listdir grows with the
    folder: 15 us at 100 files)."""
    found = {n for n in names if n.startswith(ANONYMOUS) and _anonymous_exists(n)}
    names = [n for n in names if not n.startswith(ANONYMOUS)]
    if len(names) <= _STATS_PER_LISTDIR:
        return found | {n for n in names if os.path.exists(_path(n))}
    try:
        present = set(os.listdir(SHM_FOLDER))
    except OSError:  # pragma: no cover - no /dev/shm: then nothing is known to exist
        return found
    return found | {n for n in names if (os.path.exists(n) if os.path.isabs(n) else n in present)}


def _anonymous_exists(name: str) -> bool:
    """Whether the creator of the anonymous segment ``name`` still holds it open (a
    readlink of its descriptor: about 3 us)."""
    try:
        descriptor, pid, _, label = _split_anonymous(name)
        return _bears(os.readlink(f"/proc/{pid}/fd/{descriptor}"), label)
    except (OSError, SegmentError):
        return False


_STATS_PER_LISTDIR = 8


def _path(name: str) -> str:
    """Where a segment's name lives: a file's own path, or in the shared-memory folder."""
    return name if os.path.isabs(name) else os.path.join(SHM_FOLDER, name)


def removals() -> int | None:
    """A descriptor that turns readable when a name is removed from the shared-memory
    folder (inotify, non-blocking: read it empty after each wake); None where there is
    none, and the folder must be looked at instead."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
    except (OSError, AttributeError):  # pragma: no cover - no inotify (not Linux)
        return None
    if fd < 0:  # pragma: no cover - out of inotify instances
        return None
    if libc.inotify_add_watch(fd, os.fsencode(SHM_FOLDER), _IN_DELETE) < 0:
        os.close(fd)  # pragma: no cover - no such folder
        return None
    return int(fd)


_IN_DELETE = 0x200  # <sys/inotify.h>: a name was removed from the watched folder


# /proc/self/pagemap holds 8 bytes per virtual page; in their top byte, bit 63 (0x80) says
# present, bit 62 (0x40) swapped, bit 61 (0x20) a file page or shared anonymous memory. In
# a private mapping of a segment, a page this process wrote is an anonymous copy: present
# without bit 61, or swapped out. This table maps such a top byte to 1, any other to 0.
_OWN_PAGE = bytes(1 if (b & 0xA0) == 0x80 or b & 0x40 else 0 for b in range(256))


def written(mapping: Mapping) -> bool:
    """Whether this process wrote into a private mapping: any page of it is its own copy.

    True also when that cannot be told (no pagemap, a short read): the caller then must
    not trust the mapping to show the segment's content. About 0.3 ms per 128 MiB, and
    1.3 ms beside a worker summing another array.
    """
    page = mmap.PAGESIZE
    first = mapping.address // page
    pages = (mapping.address + len(mapping) + page - 1) // page - first
    want = pages * 8
    chunks = []
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        while want:
            chunk = os.pread(fd, want, (first + pages) * 8 - want)
            if not chunk:
                return True
            chunks.append(chunk)
            want -= len(chunk)
    except OSError:
        return True
    finally:
        os.close(fd)
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return 1 in data[7::8].translate(_OWN_PAGE)
