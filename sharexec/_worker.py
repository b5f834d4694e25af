"""What a worker runs once, when it starts: it dies with its parent, then the user's
initializer runs. Kept apart from the transport so a worker imports nothing heavy
(numpy) before its first task needs it.
"""

from __future__ import annotations

from typing import Any

from . import _tracking

__all__ = ["run_initializer"]


def run_initializer(parent_pid: int, call: Any) -> None:
    """Set up a new worker: it dies with its parent; then the user's initializer, if any.

    ``call`` is None, the initializer's ``_reduction.Task`` itself (fork: inherited, not
    pickled), or what that task's reduction rebuilt: ``[(fn, args, kwargs), options, ...]``.
    """
    _tracking.watch_parent(parent_pid)
    if call is None:
        return
    if isinstance(call, list):
        (fn, args, kwargs), *_ = call
    else:
        assert call.call is not None
        fn, args, kwargs = call.call
    fn(*args, **kwargs)
