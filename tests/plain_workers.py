"""Functions for workers that must not import NumPy: this module imports the standard
library only (``workers.py`` imports NumPy, so a worker running one of its functions
imports it too)."""

from __future__ import annotations

import pickle
import sys
from typing import Any

# What a worker should import only for a call or a result that holds an array.
HEAVY = ("numpy", "sharexec._arrays", "sharexec._reduction", "sharexec._transport")


def heavy_modules(*ignored: Any) -> list[str]:
    """The heavy modules this worker has imported so far."""
    return [name for name in HEAVY if name in sys.modules]


def echo(x: Any) -> Any:
    return x


class Point:
    """A result that is neither plain nor holds a buffer."""

    def __init__(self, x: int, tags: set[str]) -> None:
        self.x = x
        self.tags = tags

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.tags) == (other.x, other.tags)


def point(x: int) -> Point:
    return Point(x, {"a", "b"})


class Blob:
    """A protocol-5 object that hands its bytes out of band and keeps what it is given."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: Any) -> Any:
        return Blob, (pickle.PickleBuffer(self.data),)


def blob(n: int) -> Blob:
    return Blob(bytearray(b"x" * n))


def collector_state() -> tuple[int, bool]:
    """In a worker: how many objects its collector leaves alone (frozen), and whether
    a reference cycle made now is still freed by a collection."""
    import gc
    import weakref

    class Node:
        pass

    node = Node()
    node.self = node  # type: ignore[attr-defined]
    freed = weakref.ref(node)
    del node
    gc.collect()
    return gc.get_freeze_count(), freed() is None
