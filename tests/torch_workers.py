"""Functions that run in worker processes for tests/test_torch.py (a module of its own, so
that spawn imports it by name and the rest of the suite never imports torch)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

import sharexec


def wait_then_read(t: torch.Tensor, started: Any, go: Any) -> float:
    """The seed program's task: wait until the parent has written, then read."""
    started.set()
    if not go.wait(60):
        raise TimeoutError("never told to go")
    return float(t[0])


def add_one(x: Any) -> None:
    """``t += 1`` for every tensor in ``x`` (a tensor, or a container of them)."""
    for t in _tensors(x):
        t += 1


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if hasattr(x, "payload"):
        return _tensors(x.payload)
    return []


def describe(t: torch.Tensor) -> tuple[Any, ...]:
    """What a tensor is, as the worker sees it."""
    return (
        type(t).__name__,
        t.dtype,
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.requires_grad,
        t.detach().clone(),
        sharexec.is_shared(t),
    )


def write_through_first(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    """Write through ``a``; read through ``b``; whether they share one storage."""
    a.view(-1)[0] = 42
    return float(b.reshape(-1)[0]), a.untyped_storage() is b.untyped_storage()


def fill(t: torch.Tensor, low: int, high: int, value: float) -> None:
    t[low:high] = value


def full(n: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype)


def results(n: int) -> dict[str, Any]:
    """Tensors of every kind, nested, as a task's result."""
    base = torch.arange(2 * n, dtype=torch.float64).reshape(2, n)
    return {
        "large": torch.full((n,), 3.0),
        "small": torch.arange(5),
        "views": (base, base.T, base[:, ::2]),
        "param": torch.nn.Parameter(torch.ones(3)),
        "half": torch.ones(4, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "scalar": torch.tensor(7),
        "list": [torch.full((n,), float(i)) for i in range(3)],
    }


def view_of(t: torch.Tensor) -> torch.Tensor:
    """A view of the argument: it comes back by reference (same memory)."""
    return t[1:3]


def allocate_shared(n: int) -> torch.Tensor:
    """A tensor this worker moves into a sharexec segment, returned: handed over."""
    return sharexec.share(torch.full((n,), 5.0))


def set_each(ts: list[torch.Tensor]) -> float:
    """Write each tensor's index into it; the sum of what they held."""
    total = 0.0
    for i, t in enumerate(ts):
        total += float(t.sum())
        t[0] = i
    return total


def shared_by_torch(t: torch.Tensor) -> bool:
    """Whether the argument arrived in torch's own shared memory (torch's reducer)."""
    return bool(t.is_shared()) and not _in_segment(t)


def _in_segment(t: torch.Tensor) -> bool:
    from sharexec import _tensors

    return _tensors.in_segment(t.untyped_storage()) is not None


def die(*tensors: Any) -> None:
    """Share a tensor of this worker's own (a segment it owns), then die mid-task."""
    mine = sharexec.share(torch.ones(1 << 18))
    assert sharexec.is_shared(mine)
    os.kill(os.getpid(), signal.SIGKILL)
