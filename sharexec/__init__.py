"""sharexec: a drop-in ProcessPoolExecutor that moves large NumPy arrays through shared memory.

The names below are imported on first use (PEP 562): ``import sharexec`` costs almost
nothing, and the sweeper process, which loads only ``_sweeper`` and ``_segments``, never
loads numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._api import Statistics
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
    from ._cluster import ClusterExecutor, use_cluster
    from ._executor import SharedProcessPoolExecutor, get_executor
    from .errors import ConfigError, ResultError, SegmentError, SharexecError, SharexecWarning

__all__ = [
    "ClusterExecutor",
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
    "use_cluster",
    "zeros",
    "zeros_like",
]

__version__ = "0.1.0.dev0"

# Where each public name lives, e.g. {"zeros": "._arrays"}.
_HOMES = {
    **dict.fromkeys(
        ["ConfigError", "ResultError", "SegmentError", "SharexecError", "SharexecWarning"],
        ".errors",
    ),
    **dict.fromkeys(["ClusterExecutor", "use_cluster"], "._cluster"),
    **dict.fromkeys(["SharedProcessPoolExecutor", "get_executor"], "._executor"),
    "Statistics": "._api",
}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'sharexec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES.get(name, "._arrays"), __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
