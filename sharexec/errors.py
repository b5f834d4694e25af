"""The exceptions sharexec raises.

Every error is a :class:`SharexecError` and also subclasses the builtin that callers
already catch: a failing segment is an :class:`OSError`, a bad option a
:class:`ValueError`.
"""

from __future__ import annotations

from concurrent.futures.process import BrokenProcessPool

__all__ = ["ConfigError", "ResultError", "SegmentError", "SharexecError", "SharexecWarning"]


class SharexecError(Exception):
    """Base class of every exception raised by sharexec itself."""


class SegmentError(SharexecError, OSError):
    """A shared-memory segment could not be created, sized or attached."""


class ResultError(SharexecError, BrokenProcessPool):
    """A task ran, but its result, or the exception it raised, could not be rebuilt in
    the parent process (its ``__cause__`` says why; for an exception, that cause's
    ``__cause__`` is the task's traceback in the worker). Only that task's future fails;
    the executor goes on.

    Also a :class:`~concurrent.futures.process.BrokenProcessPool`, what the standard
    library raises there (it breaks the whole pool): code written for it still catches
    this."""


class ConfigError(SharexecError, ValueError):
    """An option or ``SHAREXEC_*`` environment variable is unknown or invalid."""


class SharexecWarning(UserWarning):
    """Something the user should act on, e.g. shared memory too small: sharexec fell
    back to files on disk or to pickling (slower, still correct)."""
