"""sharexec: a drop-in ProcessPoolExecutor that moves large NumPy arrays through shared memory."""

from ._arrays import (
    SharedArray,
    empty,
    empty_like,
    full,
    full_like,
    is_shared,
    ones,
    ones_like,
    share,
    zeros,
    zeros_like,
)
from ._executor import SharedProcessPoolExecutor, Statistics, get_executor
from .errors import ConfigError, ResultError, SegmentError, SharexecError, SharexecWarning

__all__ = [
    "ConfigError",
    "ResultError",
    "SegmentError",
    "SharedArray",
    "SharedProcessPoolExecutor",
    "SharexecError",
    "SharexecWarning",
    "Statistics",
    "empty",
    "empty_like",
    "full",
    "full_like",
    "get_executor",
    "is_shared",
    "ones",
    "ones_like",
    "share",
    "zeros",
    "zeros_like",
]

__version__ = "0.1.0.dev0"
