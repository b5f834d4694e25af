"""Worker functions of test_transit.py (importable by every start method): calls whose
exception, result or argument fails on its way."""

from __future__ import annotations

import os
import threading
from typing import Any


class RebuildFails(Exception):
    """Pickles, but cannot be rebuilt: its ``args`` are not what ``__init__`` takes."""

    def __init__(self, a: Any, b: Any) -> None:
        super().__init__(a)


class HoldsLock(BaseException):
    """Cannot be pickled (a lock), and not an ``Exception``."""

    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


class OnlyInWorkers:
    """Rebuilds anywhere but in the process ``parent``."""

    def __init__(self, parent: int) -> None:
        self.parent = parent

    def __reduce__(self) -> Any:
        return _only_in_workers, (self.parent,)


def _only_in_workers(parent: int) -> OnlyInWorkers:
    if os.getpid() == parent:
        raise ValueError("cannot be rebuilt in the parent")
    return OnlyInWorkers(parent)


class OnlyInParent:
    """Rebuilds only in the process ``parent``."""

    def __init__(self, parent: int) -> None:
        self.parent = parent

    def __reduce__(self) -> Any:
        return _only_in_parent, (self.parent,)


def _only_in_parent(parent: int) -> OnlyInParent:
    if os.getpid() != parent:
        raise ValueError("cannot be rebuilt in a worker")
    return OnlyInParent(parent)


def outcome(i: int, how: Any = None, parent: int = 0) -> Any:
    """``i``, unless ``how`` names what goes wrong on the way back."""
    if how == "unrebuildable exception":
        raise RebuildFails(i, "b")
    if how == "unpicklable exception":
        raise HoldsLock()
    if how == "unpicklable result":
        return i, (x for x in ())
    if how == "unrebuildable result":
        return OnlyInWorkers(parent)
    return i


def started_then_wait(started: Any, go: Any) -> bool:
    """Say it runs (``started``, a Manager's Queue), then block until ``go`` (a Manager's
    Event) is set."""
    started.put(os.getpid())
    return bool(go.wait(120))
