"""PyTorch tensors in sharexec's passes: moved into segments, sent by reference, rebuilt.

Imported only where torch already is: by the pass when ``torch`` is in ``sys.modules`` (an
object cannot be a tensor otherwise), by :func:`sharexec.share` and
:func:`sharexec.is_shared` given a tensor, and by a worker unpickling a call or a result
that holds one (its rebuild functions live here). ``import sharexec`` never imports it,
and a worker imports torch only for a task that carries a tensor.

Tensors follow torch's rules, not the copy rule of private NumPy arrays:
a CPU tensor sent to a task is *shared*, the sender's and the receiver's writes seen by
both, as through ``torch.multiprocessing``. What this module owns:

* which tensors sharexec carries itself (:func:`plain`): exact ``torch.Tensor`` and
  ``torch.nn.Parameter`` on the CPU, strided, with no negative bit, and not a non-leaf
  that requires grad. Every other (CUDA, sparse, quantized, nested, subclasses,
  storages of torch's own shared memory) goes to torch's reducer, registered with
  multiprocessing's ``ForkingPickler``, exactly as through the standard library;
* a tensor is reduced to its untyped storage and its geometry (:func:`reduce_tensor`),
  so that the pickler's memo sends a storage once per pass: two views of one storage
  arrive as views of one storage;
* a storage whose bytes lie in a sharexec segment travels by reference
  (:func:`rebuild_shared_storage`: segment name and offset), like a shared array;
* a private storage sent to a task is first **moved** into a segment (:func:`move`): its
  bytes written into fresh shared memory (as the segment is created: ``os.pwrite``, not a
  copy through a fresh mapping), then its data pointer swapped with the segment's
  (``UntypedStorage._swap_data_ptr_``), so that every tensor and view of that storage,
  in the sender too, now lives in the segment, as ``share_memory_()`` moves a storage
  into torch's shared memory. Storages of at most :data:`ARENA_MAX` bytes share
  segments (:class:`_Arena`): 2,000 small tensors take one segment, not 2,000 segments
  and descriptors. A fresh segment reads as zeros, so chunks of zeros are not copied
  (``torch.zeros(n)`` moves at the cost of reading it);
* a private storage in a *result* is copied as a buffer (:func:`rebuild_storage`): the
  backward pass puts large ones in a segment handed to the parent, small ones in-band.
  The parent's result is an ordinary private tensor.

A segment holding moved storages lives as long as any of them: each storage's data
pointer holds the segment's mapping (``torch.frombuffer`` keeps its buffer alive), and
the mapping holds the handle that unlinks it (``_tracking``). Nothing here unlinks.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

from . import _tracking
from ._segments import Mapping

# What other sharexec modules use.
__all__ = [
    "CAN_MOVE",
    "STORAGE",
    "TENSORS",
    "empty_storage",
    "in_segment",
    "is_shared",
    "move",
    "rebuild_shared_storage",
    "rebuild_storage",
    "reduce_tensor",
    "share",
]

# The exact types reduced here; torch registers its reducer for these with ForkingPickler
# (subclasses reduce themselves, down to their storages, which come here).
TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
STORAGE = torch.UntypedStorage

# Whether this torch can swap a storage's memory in place (an underscored method, which torch
# 2.13 has): if not, private tensors go through torch's own reducer.
CAN_MOVE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

ARENA_MAX = 256 << 10  # storages up to this size share arena segments when moved
_ARENA_BYTES = 4 << 20  # the size of an arena segment
_ALIGN = 64  # each storage in an arena starts on a cache line
_ZERO_CHUNK = 4 << 20  # chunks of a move that are all zeros are not copied


# ---------------------------------------------------------------------------------------
# Which tensors, and how they reduce
# ---------------------------------------------------------------------------------------


def plain(t: torch.Tensor) -> bool:
    """Whether sharexec carries ``t`` itself: a CPU strided tensor over its storage's
    bytes (not quantized or nested, no negative bit, a conjugate bit only on a plain
    tensor), not a non-leaf that requires grad (torch refuses those: its reducer says
    why)."""
    return (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and not t.is_neg()
        and not (t.is_conj() and type(t) is not torch.Tensor)
        and not (t.requires_grad and not t.is_leaf)
    )


def reduce_tensor(
    t: torch.Tensor,
) -> tuple[Callable[..., torch.Tensor], tuple[object, ...]] | None:
    """``t`` as its untyped storage (which the pickler reduces next, once per pass) and
    its geometry; None if torch's reducer must take it (see :func:`plain`).

    A conjugate view keeps its bit (torch's own reducer drops it: the receiver would see
    the values unconjugated).
    """
    if not plain(t):
        return None
    geometry = (t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()))
    return rebuild_tensor, (
        type(t),
        t.untyped_storage(),
        *geometry,
        t.requires_grad,
        t.is_conj(),
    )


def rebuild_tensor(
    cls: type,
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    conj: bool = False,
) -> torch.Tensor:
    """A tensor of class ``cls`` over ``storage`` (zero-copy), as torch's rebuild makes it."""
    t = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    if conj:
        t = t.conj()  # the same memory, read conjugated, as the sender's view did
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    t.requires_grad_(requires_grad)
    return t


def in_segment(storage: torch.UntypedStorage) -> tuple[Mapping, int] | None:
    """The shared sharexec mapping holding ``storage``'s bytes, and their offset in it."""
    low = storage.data_ptr()
    return _tracking.find_shared(low, low + storage.nbytes())


def empty_storage() -> torch.UntypedStorage:
    """An empty storage (nothing to share: torch's reducer sends these by type, too)."""
    return torch.UntypedStorage(0)


def rebuild_shared_storage(
    name: str, size: int, offset: int, nbytes: int, adopt: bool
) -> torch.UntypedStorage:
    """A storage over ``nbytes`` at ``offset`` in the shared segment ``name``, mapped once
    per process (``_tracking.attach_shared``); ``adopt``: it is now this process's to free."""
    mapping = _tracking.attach_shared(name, size, adopt)
    view = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return view.untyped_storage()


def rebuild_storage(buffer: memoryview | bytes | bytearray) -> torch.UntypedStorage:
    """A storage over a buffer of its own (a result's copy of its bytes), zero-copy."""
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


# ---------------------------------------------------------------------------------------
# Moving a private storage into shared memory, in place
# ---------------------------------------------------------------------------------------


class _Arena:
    """The segment that small storages are moved into, one after the other.

    Held weakly: the segment lives as long as a storage moved into it (each holds its
    mapping), and a new one is made when it is gone, full, or no longer this process's
    (handed to the parent with a worker's result). Reset in a forked child, which must
    not place storages in its parent's segment.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.mapping: weakref.ref[Mapping] | None = None
        self.used = 0  # bytes handed out of the current segment, e.g. 4096

    def take(self, nbytes: int, spill_to: str | None) -> tuple[Mapping, int]:
        """A place for ``nbytes`` never used before (it reads as zeros): mapping, offset."""
        with self.lock:
            mapping = self.mapping() if self.mapping is not None else None
            if mapping is None or self.used + nbytes > len(mapping) or not _tracking.owns(mapping):
                mapping = _tracking.new_shared(_ARENA_BYTES, spill_to)
                self.mapping, self.used = weakref.ref(mapping), 0
            offset = self.used
            self.used = -(-(offset + nbytes) // _ALIGN) * _ALIGN
            return mapping, offset


_arena = _Arena()
os.register_at_fork(after_in_child=_arena.reset)


def move(
    storage: torch.UntypedStorage,
    spill_to: str | None = None,
    copy: Callable[[np.ndarray, np.ndarray], None] = np.copyto,
) -> tuple[Mapping, int]:
    """Move a private CPU storage into a new place in shared memory, in place: every
    tensor over it, here, now uses the segment. Returns the mapping and the offset.

    A storage of at most :data:`ARENA_MAX` bytes is copied into an arena segment with
    ``copy(target, source)`` (the forward sink's copies); a larger one gets a segment of
    its own, written as it is created (``_segments.create``'s content: no page zeroed,
    then faulted in, before it is written). Either way chunks of zeros are skipped, since
    fresh shared memory reads as zeros. Raises :class:`~sharexec.SegmentError` if no
    segment can be had (shared memory and ``spill_to`` both full): the storage is left
    as it was.

    NumPy's copies and the kernel's, never torch's: torch copies large tensors on its
    OpenMP threads, and a process forked after GNU OpenMP ran a parallel region
    deadlocks in its own first one (a worker started with ``fork``). The standard
    library's road (torch's reducer) copies with a plain memcpy; so does this.
    """
    nbytes = storage.nbytes()
    source = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    runs = _nonzero_runs(source)
    if nbytes <= ARENA_MAX:
        mapping, offset = _arena.take(nbytes, spill_to)
        target = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset)
        for low, high in runs:
            copy(target[low:high], source[low:high])
        del target
    else:

        def content(write: Callable[[int, memoryview], None]) -> None:
            for low, high in runs:
                write(low, memoryview(source[low:high]))

        mapping, offset = _tracking.new_shared(nbytes, spill_to, content), 0
    # From now on the storage's memory is the segment's, and `old` holds the private
    # memory, freed when it goes at the end of this call.
    old = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    storage._swap_data_ptr_(old.untyped_storage())
    return mapping, offset


def _nonzero_runs(source: np.ndarray) -> list[tuple[int, int]]:
    """The byte ranges ``[low, high)`` of ``source`` to copy into fresh shared memory
    (which reads as zeros): all but its chunks of :data:`_ZERO_CHUNK` bytes that are all
    zeros, e.g. ``[(0, 4194304)]``.

    Writing fresh shared pages is what a move costs; reading costs far less. A chunk
    whose first eight bytes are not all zero is not scanned further, so ordinary data
    pays nothing.
    """
    n = len(source)
    words = source[: n - n % 8].view(np.uint64)
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for low in range(0, n, _ZERO_CHUNK):
        high = min(low + _ZERO_CHUNK, n)
        chunk = words[low // 8 : high // 8]
        zero = high % 8 == 0 and not chunk[0] and not chunk.any()  # whole words only
        if zero and start is not None:
            runs.append((start, low))
            start = None
        elif not zero and start is None:
            start = low
    if start is not None:
        runs.append((start, n))
    return runs


# ---------------------------------------------------------------------------------------
# The public side: sharexec.share(tensor), sharexec.is_shared(tensor)
# ---------------------------------------------------------------------------------------


def is_shared(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is shared: in a sharexec segment, or torch's own."""
    if t.device.type != "cpu" or t.layout != torch.strided:
        return bool(t.is_shared())
    storage = t.untyped_storage()
    return storage.nbytes() > 0 and (in_segment(storage) is not None or bool(t.is_shared()))


def share(t: torch.Tensor, spill_to: str | None = None) -> torch.Tensor:
    """Move ``t``'s storage into a sharexec segment, in place (see :func:`move`); ``t``
    itself, already shared or empty, is left as it is."""
    if t.requires_grad and not t.is_leaf:
        raise TypeError(
            "sharexec.share takes no non-leaf tensor that requires grad (autograd does not "
            "cross processes, and torch refuses to send one): share t.detach() instead"
        )
    if not plain(t):
        raise TypeError(
            "sharexec.share takes CPU tensors with a strided layout, not negative, "
            f"quantized or nested views: got a {t.layout} tensor on {t.device}"
        )
    if not CAN_MOVE:
        raise TypeError(f"torch {torch.__version__} cannot move a storage in place")
    storage = t.untyped_storage()
    if storage.nbytes() and in_segment(storage) is None and not t.is_shared():
        move(storage, spill_to)
    return t
