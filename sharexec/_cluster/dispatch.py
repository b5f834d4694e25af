"""The dispatcher of a cluster executor: its thread, from the queue to Dask.

This module owns :class:`Dispatcher` and its thread, ``sharexec-cluster-dispatch``:
while Dask holds fewer calls than the cluster's capacity, it takes the next queued call
(marked running then, as the standard library's executor does when a call leaves its
queue), packs it (the one pass, ``_reduction.dumps``, with the cluster's sink:
``packing``), sends its large buffers once (``sending``) and gives it to Dask; while
calls are in flight it also watches the client, and breaks the executor when the
client no longer runs.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from functools import partial

from .._config import Options
from .._reduction import dumps
from ..errors import SegmentError
from .blobs import _HostBytes
from .calls import Calls, _Call, fail
from .connection import Connection
from .dask_api import DaskFuture
from .packing import ClusterSink
from .sending import Sender
from .worker import _run


class Dispatcher:
    """Gives Dask the calls queued in ``calls``, in its own thread, started at the first
    submit (:meth:`start`); ``done(call, remote)`` is Dask's callback for a call's task.
    ``break_(why)`` breaks the executor."""

    def __init__(
        self,
        calls: Calls,
        connection: Connection,
        sender: Sender,
        options: Options,
        done: Callable[[_Call, DaskFuture], None],
        break_: Callable[[str], None],
    ) -> None:
        self._calls = calls
        self._connection = connection
        self._sender = sender
        self._options = options
        self._done = done
        self._break = break_
        self._keys = itertools.count()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, once (under the calls' lock)."""
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._dispatch, name="sharexec-cluster-dispatch", daemon=True
            )
            self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def _dispatch(self) -> None:
        """Give Dask the calls queued, while fewer than the capacity are running there;
        and, while calls are in flight, watch the client (see Connection.gone)."""
        connection, client = self._connection, self._connection.client
        while True:
            call, why = self._calls.next_call(connection.capacity, connection.gone)
            if why is not None:
                self._break(why)
            if call is None:
                return
            try:
                self._pack(call)
                with self._calls.lock:
                    blobs = [self._sender.given(b) for b in call.blobs]
                remote = client.submit(
                    _run,
                    call.payload,
                    blobs,
                    key=f"{call.fn_name}-{connection.token}-{next(self._keys)}",
                    pure=False,
                    **self._where(blobs),
                )
            except BaseException as exc:  # unpicklable arguments, a closed client…
                if (why := connection.gone()) is not None:
                    self._break(why)
                fail(call.future, exc)
                self._calls.finished(call, self._sender.let_go)
                continue
            call.remote = remote
            remote.add_done_callback(partial(self._done, call))
            # Closed meanwhile: Dask may never call back (its loop stopped).
            if (why := connection.gone()) is not None:
                self._break(why)

    def _pack(self, call: _Call) -> None:
        """One pass over the call (the local executor's, with the cluster's sink); then
        its large buffers sent, once each."""
        assert call.call is not None
        sink = ClusterSink(self._options)
        try:
            call.payload = dumps(call.call, sink, call.argument_ids()).payload
            buffers, call.slots = sink.buffers, sink.slots
        finally:
            sink.clear()  # it holds the arguments' memory
        call.call = None  # the arguments are read: let go of them
        call.blobs = [self._sender.send(data, call.since) for data in buffers]

    def _where(self, blobs: Sequence[object]) -> dict[str, object]:
        """Where a task given ``blobs`` may run: a name of the client's copy in the task
        itself can be mapped on this host alone (a worker joining from another host is
        never given it)."""
        if not any(isinstance(b, _HostBytes) and b.by_name for b in blobs):
            return {}
        local = self._sender.local_workers()
        if not local:
            raise SegmentError(
                "the workers of this host, for which this call's arrays were copied into "
                "shared memory, have left the cluster"
            )
        return {"workers": local, "allow_other_workers": False}
