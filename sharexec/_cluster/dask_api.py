"""The parts of Dask distributed's API the cluster executor uses, typed.

``distributed`` ships no type information: these protocols say what the executor reads
and calls of a client, a Dask future and a local cluster, so that the rest of the
package is typed against them, not left untyped. They describe, they do not wrap:
the objects are distributed's own.
"""

from __future__ import annotations

from asyncio import AbstractEventLoop
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Protocol


class DaskFuture(Protocol):
    """A ``distributed.Future``: a task, or data scattered to the cluster."""

    @property
    def key(self) -> str: ...

    @property
    def status(self) -> str: ...  # "pending", "finished", "error", "cancelled", "lost"

    def release(self) -> None: ...

    def add_done_callback(self, fn: Callable[[DaskFuture], None]) -> None: ...

    def exception(self, timeout: float | None = None) -> BaseException | None: ...

    def traceback(self, timeout: float | None = None) -> TracebackType | None: ...


class _Loop(Protocol):
    @property
    def asyncio_loop(self) -> AbstractEventLoop: ...


class DaskClient(Protocol):
    """A ``distributed.Client``."""

    @property
    def status(self) -> str: ...  # "running" while it may be used

    @property
    def loop(self) -> _Loop: ...

    @property
    def futures(self) -> Mapping[str, object]: ...

    def submit(self, fn: Callable[..., object], *args: object, **options: object) -> DaskFuture:
        """``key``, ``pure``, ``workers``, ``allow_other_workers``: Dask's options."""
        ...

    def scatter(self, data: dict[str, object], **options: object) -> dict[str, DaskFuture]: ...

    def gather(
        self, futures: list[DaskFuture], direct: bool, asynchronous: bool
    ) -> Coroutine[object, object, list[object]]: ...

    def run(self, fn: Callable[..., object], *args: object) -> dict[str, object]: ...

    def run_on_scheduler(self, fn: Callable[..., object], *args: object) -> object: ...

    def nthreads(self) -> dict[str, int]: ...

    def cancel(self, futures: list[DaskFuture], force: bool = False) -> None: ...

    def close(self) -> None: ...


class LocalCluster(Protocol):
    """A ``distributed.LocalCluster`` the executor started."""

    @property
    def workers(self) -> Mapping[object, object]: ...  # nannies, or workers

    def close(self) -> None: ...
