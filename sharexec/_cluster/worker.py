"""What runs of the cluster executor in a Dask worker (and on its scheduler).

:func:`_run` rebuilds a call over its blobs (copy-on-write through the worker's kept
mappings), runs it, and returns its outcome with what it changed of each shared slot
(:func:`_changes`) as an :class:`Outcome`; a task's exception travels as a
``_wire.Raised``, as from a local worker. :func:`_worker_holds` and
:func:`_scheduler_holds` count what the cluster still holds of an executor (shutdown
waits for none).
"""

from __future__ import annotations

import pickle
import threading
from typing import NamedTuple, Protocol

import numpy as np

from .. import _kept, _segments, _tracking
from .._wire import Failure, Raised
from .blobs import _HostBytes


class Change(NamedTuple):
    """What a task changed of one shared slot: the elements whose bytes differ."""

    slot: int  # in the order the call's pass met the slots, e.g. 0
    mask: np.ndarray | None  # np.packbits of which elements changed; None: all of them
    values: np.ndarray  # the new values of those elements, in order


class Outcome(NamedTuple):
    """What a task sends back to the client: how the call ended, and its changes."""

    result: object  # what the call returned (None if it raised)
    # The call's exception, if it raised: a Raised, rebuilt a Failure in the client.
    raised: Raised | Failure | None
    changes: list[Change]  # of the shared slots it changed, e.g. [Change(0, None, …)]


class _Keys(Protocol):
    """What the scheduler and a worker hold of tasks, by key (only the keys are read)."""

    tasks: dict[object, object]


class _Worker(Protocol):
    state: _Keys


# In the thread unpickling a call: the shared slots it rebuilt, e.g. [(0, snapshot, copy)]
# (slots), and the ids of the buffers of zeros it was given (zeros, e.g. {140213}).
_unpacking = threading.local()


def _slot(index: int, snapshot: np.ndarray) -> np.ndarray:
    """Rebuilt in the task: its own copy of a shared view's values at dispatch.

    A snapshot sent as a blob is already the task's own (a copy-on-write mapping, or
    zeros made for it): the task writes into it, and the values it started from are read
    from the blob's segment (or are zeros). A small one, unpickled from the payload, is
    copied.
    """
    mapping: object = snapshot.base
    working: np.ndarray
    # numpy: ndarray, memoryview, ours; or the zeros given
    while isinstance(mapping, (np.ndarray, memoryview)) and id(mapping) not in _unpacking.zeros:
        mapping = mapping.base if isinstance(mapping, np.ndarray) else mapping.obj
    if id(mapping) in _unpacking.zeros:
        before, working = np.zeros(snapshot.shape, snapshot.dtype), snapshot
    elif isinstance(mapping, _segments.Mapping) and mapping.private:
        offset = snapshot.__array_interface__["data"][0] - mapping.address
        held = _tracking.attach_held(mapping.name, len(mapping))
        before = np.ndarray(snapshot.shape, snapshot.dtype, held, offset, snapshot.strides)
        working = snapshot
    else:
        before, working = snapshot, snapshot.copy()
    _unpacking.slots.append((index, before, working))
    return working


def _changes(index: int, before: np.ndarray, after: np.ndarray) -> Change | None:
    """What changed between two arrays of one shape, the slot ``index``'s: None, every
    value, or those of a mask, compared byte for byte (NaN, -0.0)."""
    size = before.dtype.itemsize
    word = next(w for w in (8, 4, 2, 1) if size % w == 0)  # compared a word at a time
    old = before.reshape(-1).view(f"u{word}")
    new = np.ascontiguousarray(after).reshape(-1).view(f"u{word}")
    differ = old != new
    mask = differ if word == size else differ.reshape(-1, size // word).any(axis=1)
    if not mask.any():
        return None
    if mask.all():
        return Change(index, None, after)
    return Change(index, np.packbits(mask), after.reshape(-1)[mask])


def _run(payload: bytes, blobs: list[_HostBytes]) -> Outcome:
    """A call, in a Dask worker: its outcome, ``raised`` a ``_wire.Raised`` (the client
    gets a ``_wire.Failure``), with what the call changed of each shared slot."""
    _kept.kept.drop_unlinked()  # the mappings kept of segments freed since
    buffers = [b.private() for b in blobs]
    kept = [b.name for b in blobs if b.name is not None]  # mapped through KeptMappings
    _unpacking.slots = []
    _unpacking.zeros = {id(buffer) for b, buffer in zip(blobs, buffers, strict=True) if b.zeros}
    try:
        fn, args, kwargs = pickle.loads(payload, buffers=buffers)
        slots = _unpacking.slots
    finally:
        _unpacking.slots, _unpacking.zeros = [], set()
    del blobs, buffers
    result: object = None
    raised = None
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # as the standard library's worker (SystemExit too)
        raised = Raised(exc)  # rebuilt apart in the client (_wire.load_raised)
    del fn, args, kwargs
    changes = [_changes(index, before, after) for index, before, after in slots]
    del slots
    _kept.kept.after_task(kept)  # unwritten and no view left: the next task reuses them
    return Outcome(result, raised, [c for c in changes if c is not None])


def _scheduler_holds(token: str, dask_scheduler: _Keys | None = None) -> int:
    """On the scheduler: how many tasks of the executor marked ``token`` it knows."""
    assert dask_scheduler is not None  # given by Client.run_on_scheduler
    return sum(token in str(key) for key in dask_scheduler.tasks)


def _worker_holds(token: str, dask_worker: _Worker | None = None) -> int:
    """In a worker: how many keys of the executor marked ``token`` it holds or runs."""
    assert dask_worker is not None  # given by Client.run
    return sum(token in str(key) for key in dask_worker.state.tasks)
