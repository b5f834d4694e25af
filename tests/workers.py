"""Functions that run in worker processes; a module of their own so spawn can import them."""

from __future__ import annotations

import contextlib
import copyreg
import itertools
import os
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

import sharexec
from sharexec import _segments


def identity(x: Any) -> Any:
    return x


def set_first(out: np.ndarray, value: float) -> None:
    out[0] = value


def do_stuff(i: int, out: np.ndarray) -> None:
    out[0] = i


def fill(out: np.ndarray, value: float) -> None:
    out[...] = value


def total(a: np.ndarray) -> float:
    return float(a.sum())


def sums(arrays: list[np.ndarray]) -> np.ndarray:
    return np.array([a.sum() for a in arrays])


def write_and_sum(a: np.ndarray) -> float:
    """Writes into its (private) argument, then reads it back."""
    a[...] = 7
    return float(a.sum())


_tags = itertools.count(1)


def _mapping_of(a: np.ndarray) -> Any:
    base: Any = a
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def in_reach(a: np.ndarray) -> np.ndarray:
    """Every byte this process can read through ``a``: its base's whole buffer (for an
    array in a segment, the whole mapping of the segment)."""
    base: Any = a
    while isinstance(base.base, np.ndarray):
        base = base.base
    if base.base is None:
        return np.asarray(base).view(np.uint8).reshape(-1)
    return np.frombuffer(base.base, np.uint8)


def marks_in_reach(a: np.ndarray, mark: int) -> tuple[int, str]:
    """How many bytes this process can read through ``a`` are ``mark``, and the name
    of the segment ``a`` lies in."""
    return int(np.count_nonzero(in_reach(a) == mark)), _mapping_of(a).name


def marked(n: int, mark: int) -> np.ndarray:
    """A fresh private array of ``n`` bytes, each ``mark``."""
    return np.full(n, mark, dtype=np.uint8)


def tag_and_sum(a: np.ndarray, write_at: int | None = None) -> tuple[float, int]:
    """The sum of ``a`` (after writing 7 at ``write_at``, if given), and a number that
    names the mapping it lies in: the same number, the same mapping kept and reused."""
    mapping = _mapping_of(a)
    if not hasattr(mapping, "tag"):
        mapping.tag = next(_tags)
    if write_at is not None:
        a[write_at] = 7
    return float(a.sum()), mapping.tag


def describe(a: Any) -> dict[str, Any]:
    """What the worker received: value, flags, and whether it sits in a segment."""
    return {
        "copy": None if not isinstance(a, np.ndarray) else np.array(a, copy=True),
        "dtype": getattr(a, "dtype", None),
        "writeable": bool(getattr(a, "flags", None) and a.flags.writeable),
        "in_segment": in_segment(a),
        "shared": sharexec.is_shared(a),
        "type": type(a).__name__,
    }


def in_segment(a: Any) -> bool:
    """Whether an array's memory comes from a sharexec segment mapping."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, _segments.Mapping)


def segment_bytes(creator: int | None = None) -> int:
    """Bytes held by sharexec segments right now (of one creating process, if given)."""
    size = 0
    for name in _segments.listdir():
        if creator is not None and not name.startswith(f"{_segments.PREFIX}{creator}-"):
            continue
        with contextlib.suppress(FileNotFoundError):
            size += os.stat(os.path.join(_segments.SHM_FOLDER, name)).st_size
    return size


def sum_and_segment_bytes(a: np.ndarray, creator: int | None = None) -> tuple[float, int]:
    return float(a.sum()), segment_bytes(creator)


def make_shared(n: int, value: float) -> np.ndarray:
    out = sharexec.full(n, value)
    return out


def make_private(n: int, value: float) -> np.ndarray:
    return np.full(n, value)


def return_arg_view(a: np.ndarray) -> np.ndarray:
    return a[1:-1:2]


def raise_value_error(msg: str) -> None:
    raise ValueError(msg)


def wait_then_read(a: np.ndarray, started: Any, go: Any) -> float:
    started.set()
    if not go.wait(60):
        raise TimeoutError("never told to go")
    return float(a[0])


def hold(a: np.ndarray, go: Any) -> float:
    if not go.wait(60):
        raise TimeoutError("never told to go")
    return float(a.sum())


def kwargs_sum(*, x: np.ndarray, y: dict[str, Any]) -> float:
    return float(x.sum() + y["nested"][0].sum())


_initialized: dict[str, Any] = {}


def init_worker(table: np.ndarray, shared: np.ndarray) -> None:
    _initialized["table"] = table
    _initialized["shared"] = shared
    shared[os.getpid() % len(shared)] = 1  # proves the initializer saw the shared array


def read_initialized() -> tuple[float, bool, bool]:
    table = _initialized["table"]
    return float(table.sum()), in_segment(table), sharexec.is_shared(_initialized["shared"])


def now() -> float:
    return time.monotonic()


def hold_nothing(*arrays: Any) -> int:
    return len(arrays)


def environment() -> dict[str, str]:
    return dict(os.environ)


_kept: list[Any] = []


def keep_and_sum(a: np.ndarray) -> float:
    """Keeps a view of its argument past the task (as a cache would)."""
    _kept.append(a[:10])
    return float(a.sum())


def kept_sums() -> list[float]:
    return [float(k.sum()) for k in _kept]


_mapped: list[Any] = []


def keep_mapped_and_tighten_loky_leak_check(a: np.ndarray) -> None:
    """An initializer: keep a (shared) array for later tasks, and make loky's leak check
    run after every task with a 16 MB limit (its defaults: every second, 300 MB)."""
    from loky import process_executor

    _mapped.append(a)
    process_executor._MEMORY_LEAK_CHECK_DELAY = 0.0
    process_executor._MAX_MEMORY_LEAK_SIZE = 16 << 20


def read_mapped(touch: bool) -> int:
    """Read every page of the kept array (or not); return this worker's pid."""
    if touch:
        float(_mapped[0].sum())
    return os.getpid()


def shared_mapped() -> list[str]:
    """Names of the shared segments this process maps."""
    from sharexec import _tracking

    return sorted(_tracking._registry.by_name)


def inverse(x: float) -> float:
    return 1.0 / x


def add(x: Any, y: Any) -> Any:
    return x + y


def wait_for(event: Any) -> bool:
    """Block until ``event`` (a Manager's Event) is set."""
    return bool(event.wait(120))


def block(event: Any, seconds: float = 0.0) -> bool:
    """Run ``seconds``, then block until ``event`` (a Manager's Event) is set: with
    ``seconds`` > 0, a function measured long."""
    if seconds:
        time.sleep(seconds)
    return bool(event.wait(120))


def mark(seen: np.ndarray, i: int) -> int:
    """Record in the shared array ``seen`` that call ``i`` ran."""
    seen[i] += 1
    return i


def exit_at(i: int, k: int) -> int:
    """Return ``i``, or kill this worker if ``i == k``."""
    if i == k:
        os._exit(3)
    return i


def filled(n: int, value: float) -> np.ndarray:
    """A fresh private array of ``n`` float64 equal to ``value``."""
    return np.full(n, value)


def wait_at(i: int, k: int, event: Any) -> int:
    """Return ``i`` at once, unless ``i == k``: then wait for ``event`` first."""
    if i == k:
        event.wait(120)
    return i


class Marked:
    """An object whose reducers leave a trail: registered with copyreg and with
    multiprocessing's ForkingPickler (at import, in every process that imports this
    module, as torch registers its own), so each pickling says which reducer ran."""

    def __init__(self, trail: list[str]) -> None:
        self.trail = trail


def _rebuild_marked(trail: list[str]) -> Marked:
    return Marked(trail)


copyreg.pickle(Marked, lambda m: (_rebuild_marked, ([*m.trail, "copyreg"],)))
ForkingPickler.register(Marked, lambda m: (_rebuild_marked, ([*m.trail, "ForkingPickler"],)))
