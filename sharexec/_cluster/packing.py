"""The client's pass over a call: what goes in the payload, what is sent once.

One cloudpickle pass (:class:`_Packer`) collects the large out-of-band buffers (to be
sent as blobs) and turns each view of a shared array into a slot (its values now, to be
rebuilt as the task's own array and written back as it changed). Unlike the local
executor's pass (``_reduction``) it has no sink: nothing here is copied into a segment,
and no reducer that passes a file descriptor may be used (a task may run on another
host).
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

import cloudpickle
import numpy as np

from .. import _tracking
from .._arrays import byte_bounds

if TYPE_CHECKING:
    pass


from .worker import _slot


class _Packer(cloudpickle.Pickler):  # type: ignore[misc]
    """Pickles a call; collects its large buffers and its shared arrays.

    ``slots``: the caller's views of shared arrays, in the order the task rebuilds them,
    e.g. [<SharedArray view of 1000 float64>]; ``buffers``: the large out-of-band buffers
    in the order the payload consumes them.
    """

    def __init__(self, file: io.BytesIO, min_share_bytes: int) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._buffer)
        self.min_share_bytes = min_share_bytes
        self.slots: list[np.ndarray] = []
        self.buffers: list[memoryview] = []
        # The plain views of shared memory made for the slots, pickled as data, by id,
        # e.g. {140213: <ndarray>}: read at dispatch (their bytes hashed, sent or in-band).
        self.snapshots: dict[int, np.ndarray] = {}

    def reducer_override(self, obj: Any) -> Any:
        # cloudpickle's own override handles functions and classes: fall through to it.
        if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            if id(obj) in self.snapshots:
                return NotImplemented  # numpy's own reduction: the bytes
            if _tracking.find_shared(*byte_bounds(obj)) is not None:
                self.slots.append(obj)
                plain = obj.view(np.ndarray)
                snapshot = plain if plain.flags.c_contiguous else np.ascontiguousarray(plain)
                self.snapshots[id(snapshot)] = snapshot
                return _slot, (len(self.slots) - 1, snapshot)
            dense = obj.flags.c_contiguous or obj.flags.f_contiguous
            if not dense and obj.nbytes >= self.min_share_bytes:
                return np.asarray, (np.ascontiguousarray(obj),)  # then out of band
        return super().reducer_override(obj)

    def _buffer(self, buffer: pickle.PickleBuffer) -> bool:
        data = buffer.raw()
        if data.nbytes < self.min_share_bytes:
            return True  # in the payload
        self.buffers.append(data)
        return False
