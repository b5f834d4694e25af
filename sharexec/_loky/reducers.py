"""The reducer tables sharexec's picklers use, as loky's and the standard library's
executors pickle with them.

Replaces nothing: :data:`DISPATCH_TABLE` is loky 3.7's own reducers (bound methods by
reference, sockets and connections through the process being spawned, partials), and
:data:`FORKING_REDUCERS` what was registered with
``multiprocessing.reduction.ForkingPickler.register`` (torch's tensors and storages,
multiprocessing's connections and sockets, sharexec's shared arrays), read live from
``ForkingPickler._extra_reducers`` at each lookup, since a library registers when it is
imported (``import torch`` does), after sharexec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from multiprocessing import reduction as mp_reduction

from loky.backend import reduction as loky_reduction

# How an object of a type pickles: its ``__reduce__`` value, e.g. (rebuild, (args...)).
Reduce = Callable[..., object]
# Reducers by exact type, as a pickler's ``dispatch_table`` holds them.
Reducers = MutableMapping[type, Reduce]

# The reducers loky's pickler adds to cloudpickle's (bound methods by reference, sockets
# and multiprocessing connections through the process being spawned, partials), by exact
# type, e.g. {functools.partial: <function _reduce_partial>, ...}. loky's own table, not a
# copy: what loky.backend.reduction.register adds later is in it too. Read it only.
DISPATCH_TABLE: dict[type, Reduce] = loky_reduction._dispatch_table


class _ForkingReducers(MutableMapping[type, Reduce]):
    """The reducers registered with ``ForkingPickler.register``, by exact type, looked up
    in ``ForkingPickler._extra_reducers`` at each access (never a copy), e.g.
    ``{torch.Tensor: <function reduce_tensor>, socket.socket: <function _reduce_socket>}``.

    Read only: a library registers through ``ForkingPickler.register``, never here.
    """

    def __getitem__(self, kind: type) -> Reduce:
        return _registrations()[kind]

    def __iter__(self) -> Iterator[type]:
        return iter(dict(_registrations()))

    def __len__(self) -> int:
        return len(_registrations())

    def __setitem__(self, kind: type, reduce: Reduce) -> None:
        raise TypeError("register with multiprocessing.reduction.ForkingPickler.register")

    def __delitem__(self, kind: type) -> None:
        raise TypeError("ForkingPickler's registrations are multiprocessing's")


def _registrations() -> dict[type, Reduce]:
    """ForkingPickler's table of registrations, as it is now."""
    table: dict[type, Reduce] = mp_reduction.ForkingPickler._extra_reducers  # type: ignore[attr-defined]
    return table


# What the standard library's pickler (multiprocessing's ForkingPickler) adds to copyreg's
# reducers: multiprocessing's own (connections, sockets, method descriptors, partials)
# and every library's (torch's tensors and storages...), live.
FORKING_REDUCERS: Reducers = _ForkingReducers()
