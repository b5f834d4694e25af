"""A cluster executor's Dask client and cluster: made or given, watched, stopped, closed.

This module owns :class:`Connection`: the client the executor's tasks go through (given,
or made over an address or a ``LocalCluster`` it starts), whether it still runs
(:meth:`~Connection.gone`), how many calls the cluster may hold at once
(:meth:`~Connection.capacity`), the worker processes of a cluster the executor started
and their signalling (``terminate_workers``, ``kill_workers``: never those of a cluster
it was given), waiting until the cluster holds nothing of the executor's, and closing
what the executor started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Any, cast

from .dask_api import DaskClient, DaskFuture, LocalCluster
from .worker import _scheduler_holds, _worker_holds

if TYPE_CHECKING:
    import distributed

# Calls given to Dask at once, per worker thread: one running, one ready to start.
_PER_THREAD = 2

# How long shutdown(wait=True) waits for the cluster to forget this executor's blobs.
_FORGET_TIMEOUT = 30.0


class Connection:
    """The executor's client, and the local cluster it started, if any.

    ``token`` marks this executor's keys on the cluster, e.g. "sharexec-3f9a…": its blobs
    are "sharexec-3f9a…-blob-0", …, its calls "total-sharexec-3f9a…-7".
    """

    def __init__(
        self, client: distributed.Client | str | None, cluster_options: dict[str, object]
    ) -> None:
        import distributed as imported  # the optional extra: pip install sharexec[dask]

        dist: Any = imported  # untyped: what this module uses of it is in dask_api

        if cluster_options and client is not None:
            raise TypeError(
                "cluster options are for the local cluster ClusterExecutor starts, not for "
                f"a given client or address: {', '.join(sorted(cluster_options))}"
            )
        # Blobs go straight to a worker, and results come straight from one, unless the
        # client says not to: through the scheduler, it would hold their bytes as well.
        self.direct = getattr(client, "direct_to_workers", None) is not False
        self.cluster: LocalCluster | None = None
        self.client: DaskClient  # e.g. <Client: 'tcp://127.0.0.1:8786' processes=2 …>
        if isinstance(client, dist.Client):
            self.client, self.owns_client = cast(DaskClient, client), False
        elif client is None:
            options = {"processes": True, **cluster_options}
            self.cluster = dist.LocalCluster(**options)
            self.client = dist.Client(self.cluster, direct_to_workers=True)
            self.owns_client = True
        elif isinstance(client, str):
            self.client = dist.Client(client, direct_to_workers=True)
            self.owns_client = True
        else:
            raise TypeError(f"client must be a distributed.Client or an address, not {client!r}")
        self.token = f"sharexec-{os.urandom(8).hex()}"
        self._threads = -2.0, 1  # (when counted, worker threads): refreshed each second

    def gone(self) -> str | None:
        """Why the executor cannot go on, if its client is not running any more."""
        status = self.client.status
        if status == "running":
            return None
        return (
            f"the Dask client of this executor is not running (its status: {status}; "
            "closed, or its scheduler lost): the calls in flight were lost with it, and "
            "no call can run"
        )

    def capacity(self) -> int:
        """How many calls Dask may hold at once: two per worker thread."""
        counted, threads = self._threads
        now = time.monotonic()
        if now - counted > 1.0:
            with contextlib.suppress(Exception):  # (the client closing: seen by gone())
                threads = max(1, sum(self.client.nthreads().values()))
            self._threads = now, threads
        return _PER_THREAD * threads

    def cancel(self, remotes: list[DaskFuture]) -> None:
        """Cancel these tasks on the cluster, if the client still runs."""
        if remotes and self.gone() is None:
            with contextlib.suppress(Exception):  # (the client closing meanwhile)
                self.client.cancel(remotes, force=True)

    def signal_workers(self, signum: signal.Signals) -> None:
        """Signal the worker processes of the local cluster this executor started (none
        of a cluster it was given, nor of a cluster of threads)."""
        for pid in self._worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _worker_pids(self) -> list[int]:
        if self.cluster is None:
            return []
        pids = []
        for worker in list(self.cluster.workers.values()):  # nannies, or workers
            pid = getattr(getattr(getattr(worker, "process", None), "process", None), "pid", None)
            if isinstance(pid, int):
                pids.append(pid)
        return pids

    def close(self) -> None:
        """Wait until the cluster holds nothing of this executor's (a cluster given), then
        close the client and cluster the executor made."""
        try:
            # (A cluster of the executor's own is closed: nothing of it is left.)
            if self.client.status == "running" and self.cluster is None:
                self._await_forgotten()
        finally:
            if self.owns_client:
                self.client.close()
            if self.cluster is not None:
                self.cluster.close()

    def _await_forgotten(self) -> None:
        """Until neither the scheduler nor a worker holds a key of this executor's."""
        deadline = time.monotonic() + _FORGET_TIMEOUT
        while time.monotonic() < deadline and self.client.status == "running":
            try:
                held = cast(int, self.client.run_on_scheduler(_scheduler_holds, self.token))
                counts = cast(dict[str, int], self.client.run(_worker_holds, self.token))
                held += sum(counts.values())
            except Exception:  # (a worker leaving as it is asked): ask again
                held = 1
            if not held:
                return
            time.sleep(0.02)  # the workers forget a moment after the scheduler tells them
