"""The cluster executor's sink for the one pass (``_reduction.dumps``), and its reducers.

A call goes to the cluster through the same pass as to a local worker: the same
``reducer_override`` (arrays at any depth, gappy views copied compactly, torch storages
as their bytes), the same ``buffer_callback`` threshold (``min_share_bytes``), the same
reducer tables (``_wire.Pickler``'s, less the ones below). Only the sink differs
(:class:`ClusterSink`): a task may run on another host, so it shares no segment with
the client (``Sink.carries_segments`` False), and

* a view of a shared array goes as a slot (:meth:`ClusterSink.snapshot`): its values
  now, rebuilt as the task's own array, and what the task changed written back (on one
  host it goes by reference);
* every large out-of-band buffer is collected (:meth:`ClusterSink.send`), to be hashed
  and sent once as a blob after the pass succeeded (``sending.Sender.send``), where a
  local worker's is copied into a segment;
* reducers that hand over a process-local resource are left out of the dispatch table
  (:data:`CROSS_HOST_TABLE`): a file descriptor or a shared-memory name means nothing on
  another host.
"""

from __future__ import annotations

import socket
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from multiprocessing.connection import Connection

import numpy as np

from .._config import Options
from .._reduction import Sink
from .._wire import Pickler
from .worker import _slot

# A reducer of a dispatch table: an object to how it is rebuilt (a reduce tuple).
Reducer = Callable[[object], object]


class _CrossHost(MutableMapping[type, "Reducer"]):
    """A reducer table, looked up live, less the reducers that cannot cross hosts.

    Left out: the reducers of sockets and multiprocessing connections (loky's and
    multiprocessing's pass a file descriptor through the process being spawned, or the
    sender's resource sharer: on another host, there is neither; without them such an
    object fails to pickle, as through Dask), and torch's
    (``torch.multiprocessing.reductions``: a file descriptor, a shared-memory file name or
    a CUDA IPC handle). A CPU tensor never reaches the table (the pass sends its
    storage's bytes); any other tensor pickles by torch's own ``__reduce_ex__``, its
    bytes in the pickle, as it would through Dask.
    """

    def __init__(self, table: Mapping[type, Reducer]) -> None:
        self._table = table

    def __getitem__(self, kind: type) -> Reducer:
        reduce = self._table[kind]
        if _local_only(kind, reduce):
            raise KeyError(kind)
        return reduce

    def __iter__(self) -> Iterator[type]:
        return (k for k, r in list(self._table.items()) if not _local_only(k, r))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, kind: type, reduce: Reducer) -> None:
        raise TypeError("read only: the tables are _wire.Pickler's")

    def __delitem__(self, kind: type) -> None:
        raise TypeError("read only: the tables are _wire.Pickler's")


def _local_only(kind: type, reduce: Reducer) -> bool:
    """Whether ``reduce`` hands over a resource of this process (see :class:`_CrossHost`)."""
    if isinstance(kind, type) and issubclass(kind, (socket.socket, Connection)):
        return True
    return str(getattr(reduce, "__module__", "")).startswith("torch.multiprocessing")


# _wire.Pickler's table (code objects, loky's reducers, multiprocessing's, cloudpickle's),
# each looked up live, less what cannot cross hosts.
CROSS_HOST_TABLE: ChainMap[type, Reducer] = ChainMap(
    *(_CrossHost(table) for table in Pickler.dispatch_table.maps)
)


class ClusterSink(Sink):
    """Where a call's pass puts what it takes out of band, for a task on any host.

    ``slots``: the caller's views of shared arrays, in the order the task rebuilds them,
    e.g. [<SharedArray view of 1000 float64>]; ``buffers``: the large out-of-band buffers,
    in the order the payload consumes them, to be sent as blobs.
    """

    carries_segments = False
    dispatch_table = CROSS_HOST_TABLE

    def __init__(self, options: Options) -> None:
        super().__init__(options)
        self.slots: list[np.ndarray] = []
        self.buffers: list[memoryview] = []
        # The plain arrays made for the slots, by id, e.g. {140213: <ndarray>}: pickled
        # as private arrays (their bytes sent, or in the payload).
        self._snapshots: dict[int, np.ndarray] = {}

    def snapshot(
        self, a: np.ndarray
    ) -> tuple[Callable[[int, np.ndarray], np.ndarray], tuple[int, np.ndarray]] | None:
        if id(a) in self._snapshots:
            return None  # the snapshot made below: its bytes
        self.slots.append(a)
        plain = a.view(np.ndarray)
        snapshot = _alone(plain) if plain.flags.c_contiguous else np.ascontiguousarray(plain)
        self._snapshots[id(snapshot)] = snapshot
        return _slot, (len(self.slots) - 1, snapshot)

    def send(self, raw: memoryview) -> None:
        self.buffers.append(raw)

    def clear(self) -> None:
        """Let go of what the pass collected (the arguments' memory among it)."""
        self.slots, self.buffers, self._snapshots = [], [], {}


class _Memory:
    """``nbytes`` at ``address``, as an array interface, keeping ``owner`` alive."""

    def __init__(self, owner: np.ndarray) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "data": (owner.__array_interface__["data"][0], False),
            "shape": (owner.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def _alone(a: np.ndarray) -> np.ndarray:
    """A C-contiguous ``a`` over the same memory, with no array among its bases: the pass
    sends its own bytes alone (it would send a base ``a`` covers most of)."""
    data: np.ndarray = np.asarray(_Memory(a))
    return data.view(a.dtype).reshape(a.shape)
