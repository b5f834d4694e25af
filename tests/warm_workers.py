"""Worker functions of test_warm_arrays.py (importable by every start method)."""

from __future__ import annotations

from typing import Any

import numpy as np

kept: list[np.ndarray] = []  # views a worker keeps between tasks


def fill(view: np.ndarray, value: float) -> None:
    view[...] = value


def fill_and_keep(view: np.ndarray, value: float) -> None:
    view[...] = value
    kept.append(view)


def kept_sum() -> float:
    return float(sum(v.sum() for v in kept))


def wait_then_fill(view: np.ndarray, event: Any, value: float) -> bool:
    """Block until ``event`` (a Manager's Event) is set, then fill ``view``."""
    ready = bool(event.wait(120))
    view[...] = value
    return ready
