"""The results of a cluster executor's calls: from Dask's callback to the future done.

This module owns :class:`Results` and its thread, ``sharexec-cluster-results``. Dask's
callback thread marks a call out of Dask (the next may go) and hands it on; the results
thread fetches the outcomes of the calls finished meanwhile in one round trip, releases
them on the cluster, writes what each task changed into the caller's shared arrays
(:func:`_write_back`), and completes the futures as the standard library's do; a task
that did not finish ends its call as :meth:`Results._failed` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import Callable
from concurrent.futures import BrokenExecutor, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import numpy as np

from .. import _segments, _tracking
from .._arrays import byte_bounds
from .._loky import remote_traceback
from .._wire import Failure
from .calls import WATCH, Calls, _Call, fail
from .connection import Connection
from .dask_api import DaskFuture
from .sending import Sender
from .worker import Change, Outcome

# How long the client may take to give what it holds already (a task's error), on its
# event loop: bounded, for a loop stopped meanwhile would never answer.
_ASK_TIMEOUT = 30.0

# The reasons Dask gives for cancelling every future of a client whose cluster forgot
# them all (this executor's arrays on it too): the executor cannot go on.
_CLUSTER_LOST = {
    "scheduler-restart": "the cluster was restarted (client.restart())",
    "scheduler-connection-lost": "the client lost its connection to the scheduler",
}


class Results:
    """Delivers the outcomes of the calls of ``calls`` whose tasks ended, in the order
    they ended, in a thread of its own (so that neither Dask's one callback thread nor
    the dispatcher waits for that). ``break_(why)`` breaks the executor."""

    def __init__(
        self,
        calls: Calls,
        connection: Connection,
        sender: Sender,
        break_: Callable[[str], None],
    ) -> None:
        self._calls = calls
        self._connection = connection
        self._sender = sender
        self._break = break_
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sharexec-cluster-results")
        # The calls finished on the cluster whose outcome the results thread has not
        # taken yet, in the order they finished, e.g. [(<_Call>, <Future: finished>)].
        self._arrived: list[tuple[_Call, DaskFuture]] = []
        self._closed = False  # the results thread is shut down: see done()

    def done(self, call: _Call, remote: DaskFuture) -> None:
        """Dask's callback: a call finished on the cluster, the next may go while its
        result comes back."""
        with self._calls.lock:
            self._calls.out_of_dask()
            if not self._closed:
                self._arrived.append((call, remote))
                self._thread.submit(self._collect)  # (queued: it waits for nothing)
                return
        # After shutdown: the executor broke (terminate_workers, a lost client), its
        # call ended already, but the task ended only now. Released here, or the
        # cluster would keep its result for as long as this executor lives.
        with contextlib.suppress(Exception):  # (a client closed: nothing to free)
            remote.release()
        self._calls.finished(call, self._sender.let_go)

    def shutdown(self) -> None:
        """Once every outcome arrived is delivered; a task that ends later is released
        as it ends (:meth:`done`)."""
        with self._calls.lock:
            self._closed = True
        self._thread.shutdown(wait=True)

    def _collect(self) -> None:
        """In the results thread: deliver the outcomes of the calls finished so far, in
        the order they finished, then free what they held. Their results are fetched
        together: one round trip, from every worker holding one at once."""
        with self._calls.lock:
            ready, self._arrived = self._arrived, []
        fetched: dict[str, Outcome] = {}
        finished = [
            remote
            for call, remote in ready
            if remote.status == "finished" and not call.future.done()
        ]
        if len(finished) > 1:
            with contextlib.suppress(Exception):  # (then each alone, with its own error)
                outcomes = self._gather(finished)
                fetched = {r.key: o for r, o in zip(finished, outcomes, strict=True)}
        for call, remote in ready:
            try:
                self._deliver(call, remote, fetched.pop(remote.key, None))
            finally:
                with contextlib.suppress(Exception):  # (a client closed: nothing to free)
                    remote.release()  # (done already, unless delivering failed)
                self._calls.finished(call, self._sender.let_go)

    def _gather(self, remotes: list[DaskFuture]) -> list[Outcome]:
        """The outcomes of finished tasks (of ones lost since, once computed again),
        waited for while the client lives: a gather whose client closes under it would
        never return (its event loop stopped)."""
        client = self._connection.client
        coroutine = client.gather(remotes, direct=self._connection.direct, asynchronous=True)
        gathered = asyncio.run_coroutine_threadsafe(coroutine, client.loop.asyncio_loop)
        while not wait_futures([gathered], WATCH).done:
            if (why := self._connection.gone()) is not None:
                gathered.cancel()
                raise BrokenExecutor(why)
        outcomes = gathered.result()
        assert all(isinstance(o, Outcome) for o in outcomes)  # what _run returns
        return outcomes  # type: ignore[return-value]  # checked just above

    def _deliver(self, call: _Call, remote: DaskFuture, outcome: Outcome | None) -> None:
        """Complete the call's future: with ``outcome``, the task's, or fetched now.

        How each end of a Dask future maps to the standard library's:

        * finished (or lost since, then computed again): the result, or the exception
          the function raised, with its remote traceback as ``__cause__``;
        * erred (the call failed to unpickle, a worker died running it too often:
          Dask's ``KilledWorker``): that exception, with Dask's traceback if any;
        * cancelled, with the client closed, its scheduler lost, or the cluster
          restarted: every call not done fails with ``BrokenExecutor`` (see
          ``Calls.end_all``);
        * cancelled by someone else on the cluster: the future ends cancelled.
        """
        future = call.future
        if future.done():  # ended already: the executor broke
            call.slots = []
            return
        failure: BaseException | None = None
        if remote.status not in ("error", "cancelled") and outcome is None:
            try:
                outcome = self._gather([remote])[0]
            except BaseException as exc:
                failure = exc
        if outcome is None or remote.status in ("error", "cancelled"):
            call.slots = []
            self._failed(call, remote, failure)
            return
        with contextlib.suppress(Exception):
            remote.release()  # the result leaves the cluster before the future is done
        try:
            for change in outcome.changes:
                _write_back(call.slots[change.slot], change)
        except BaseException as exc:  # (a view made read-only meanwhile, say)
            fail(future, exc)
            return
        finally:
            call.slots = []
        if isinstance(outcome.raised, Failure):
            fail(future, outcome.raised.error)  # its cause: the worker's traceback
        else:
            with contextlib.suppress(InvalidStateError):  # (ended by a break meanwhile)
                future.set_result(outcome.result)

    def _failed(self, call: _Call, remote: DaskFuture, failure: BaseException | None) -> None:
        """End a call whose task did not finish on the cluster (``failure``: what
        fetching its result raised, if that is how it failed)."""
        status = remote.status
        why = self._connection.gone()
        if status == "cancelled" and why is None:
            cancelled = getattr(getattr(remote, "_state", None), "exception", None)
            lost = _CLUSTER_LOST.get(getattr(cancelled, "reason", ""))
            if lost is not None:
                why = f"{lost}: the calls in flight and this executor's arrays are gone"
        if why is not None:
            self._break(why)  # this call with every other
        elif status == "cancelled":
            call.future.cancel_running()
        elif status == "error":
            try:
                error = remote.exception(timeout=_ASK_TIMEOUT)
                tb = "".join(traceback.format_tb(remote.traceback(timeout=_ASK_TIMEOUT)))
            except BaseException as exc:  # (the client closing now)
                error, tb = exc, ""
            if not isinstance(error, BaseException):  # (never None, yet: not trusted)
                error = RuntimeError(f"the task {remote.key} failed on the cluster")
            if tb:
                error.__cause__ = remote_traceback(tb)
            fail(call.future, error)
        else:
            assert failure is not None
            fail(call.future, failure)


def _write_back(view: np.ndarray, change: Change) -> None:
    """Write a task's changes into the caller's shared view (every page of a view written
    whole mapped at once first: a fresh output's pages are not mapped in this process)."""
    if change.mask is None:
        low, high = byte_bounds(view)
        found = _tracking.find_shared(low, high)
        if found is not None:
            _segments.populate(found[0], found[1], high - low)
        view[...] = change.values
    else:
        mask = np.unpackbits(change.mask, count=view.size).view(bool).reshape(view.shape)
        view[mask] = change.values
