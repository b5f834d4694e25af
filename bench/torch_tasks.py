"""What the workers of the tensor benchmark run (``bench/torch_bench.py``).

Module-level functions, so that workers started with ``spawn`` or ``forkserver`` import
them by name (``bench/`` is on the workers' ``sys.path``, inherited from the parent).
"""

from __future__ import annotations

import torch


def total(t: torch.Tensor) -> float:
    """T1: the sum of a whole tensor argument."""
    return float(t.sum())


def make(n: int, value: float) -> torch.Tensor:
    """T2: a fresh float32 tensor of ``n`` elements equal to ``value``."""
    return torch.full((n,), value, dtype=torch.float32)


def fill(t: torch.Tensor, low: int, high: int, value: float) -> None:
    """T3: write ``value`` into ``t[low:high]``, in place: the parent sees it."""
    t[low:high] = value


def warm(t: torch.Tensor) -> int:
    """Warm-up: torch imported, and a small tensor through each way."""
    return int(t.numel())
