"""Choosing the cluster for :func:`sharexec.get_executor`: :func:`use_cluster` and
:func:`chosen`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import distributed


from .executor import ClusterExecutor

# The executors chosen by use_cluster blocks open now, innermost last (process-wide).
_chosen: list[ClusterExecutor] = []
_chosen_lock = threading.Lock()


def chosen() -> ClusterExecutor | None:
    """The executor of the innermost :func:`use_cluster` block open, if any."""
    with _chosen_lock:
        return _chosen[-1] if _chosen else None


@contextlib.contextmanager
def use_cluster(
    cluster: ClusterExecutor | distributed.Client | str | None = None, **options: Any
) -> Iterator[ClusterExecutor]:
    """Within the block, :func:`sharexec.get_executor` returns a cluster executor.

    For library code that calls :func:`sharexec.get_executor`: the user runs it on a Dask
    cluster without changing it, as with joblib's ``parallel_config``. The choice is
    process-wide (calls from any thread see it) and blocks nest.

    Parameters
    ----------
    cluster : ClusterExecutor, distributed.Client or str, optional
        An executor to use as it is (left running at the end of the block), or what to
        make one over (a client or a scheduler's address; by default a local cluster),
        shut down at the end of the block.
    **options
        For the executor made: see :class:`ClusterExecutor`.

    Yields
    ------
    ClusterExecutor
        The executor :func:`sharexec.get_executor` returns within the block.
    """
    made = not isinstance(cluster, ClusterExecutor)
    executor = (
        cluster if isinstance(cluster, ClusterExecutor) else ClusterExecutor(cluster, **options)
    )
    with _chosen_lock:
        _chosen.append(executor)
    try:
        yield executor
    finally:
        with _chosen_lock:
            _chosen.remove(executor)
        if made:
            executor.shutdown()
