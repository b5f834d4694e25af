"""The client's side of the cluster executor: :class:`ClusterExecutor`, a facade.

It owns what a user calls (``submit``, ``map``, ``statistics``, ``shutdown``,
``terminate_workers``, ``kill_workers``) and the closing thread,
``sharexec-cluster-close``; the work is done by one object per role: ``calls`` (the calls
from submit until done, and the one lock), ``connection`` (the Dask client and cluster,
watched, signalled, closed), ``dispatch`` (the dispatcher thread: pack, send, submit),
``results`` (the results thread: fetch, write back, complete), ``sending`` (the blobs
sent).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import BrokenExecutor, Executor, Future
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .. import _session, _worker
from .._api import Statistics, map_calls, submit_future
from .._config import Options
from .blobs import _register_sizeof
from .calls import Calls, _Call, _ClusterFuture
from .connection import Connection
from .dispatch import Dispatcher
from .results import Results
from .sending import Sender

if TYPE_CHECKING:
    import distributed

T = TypeVar("T")


class ClusterExecutor(Executor):
    """A :class:`concurrent.futures.Executor` whose tasks run on a Dask cluster.

    The cluster counterpart of :class:`SharedProcessPoolExecutor` (see :doc:`/scaling-out`):
    the same program, with the same results, when it outgrows one machine. Dask
    distributed schedules the tasks and moves the data. Unlike
    ``distributed.Client.get_executor()``, it behaves as the standard library's executors:

    * every call runs (never deduplicated as "pure"), and keyword arguments reach the
      function whatever their names;
    * ``map`` honours ``timeout``, ``chunksize`` and ``buffersize``;
      ``shutdown(wait, cancel_futures)``, ``cancel()`` and ``running()`` as the standard
      library's (a call is running once it is dispatched, given to Dask: at most two per
      worker thread are; the others wait here, as in the standard library's queue, and
      can be cancelled);
    * a task's exception is raised with its remote traceback as ``__cause__``;
    * a client closed (or the cluster restarted) under calls in flight breaks the
      executor: the calls not done fail with :class:`~concurrent.futures.BrokenExecutor`;
    * the methods of :class:`SharedProcessPoolExecutor` (``statistics``,
      ``terminate_workers``, ``kill_workers``), with the same signatures.

    A call's arguments are read when it is dispatched (as the standard library pickles
    them when a call leaves its queue). Large arrays and out-of-band buffers (of at least
    ``min_share_bytes``) are sent to the cluster once and passed by reference; the same
    unchanged array submitted again is not sent again (its bytes are recognized by their
    SHA-256, so a changed one is never served a stale copy; an array given as an
    argument of calls submitted before its bytes were last hashed is not hashed again).
    Each task sees an array as it was when the call was dispatched, and its writes stay
    its own. On each host, Dask's workers share one copy of a sent array, in sharexec
    shared memory.

    Shared arrays (:func:`sharexec.zeros`, :func:`sharexec.share` and their views) are
    copy-in, copy-out: the task gets the view's values at dispatch, and the elements it
    changed are written back into the caller's array before its future completes (also
    when it raises). Unlike on one machine, a task sees a snapshot, not live memory, and
    of two tasks changing the same element, the one finishing last wins.

    Parameters
    ----------
    client : distributed.Client or str, optional
        The cluster: a client, or a scheduler's address (a client is made and closed with
        the executor). By default, a ``distributed.LocalCluster`` of processes is started,
        and closed at shutdown.
    min_share_bytes : int, optional
        Buffers at least this large are sent once, by reference; smaller ones travel in
        the task. Default: the sharexec option (256 KiB, ``SHAREXEC_MIN_SHARE_BYTES``).
    **cluster_options
        Passed to ``distributed.LocalCluster`` when the executor starts one (e.g.
        ``n_workers=4``); an error with a client or an address.

    Examples
    --------
    >>> with ClusterExecutor("tcp://scheduler:8786") as ex:  # doctest: +SKIP
    ...     sums = list(ex.map(np.sum, np.array_split(a, 64)))
    """

    def __init__(
        self,
        client: distributed.Client | str | None = None,
        *,
        min_share_bytes: int | None = None,
        **cluster_options: object,
    ) -> None:
        given = {} if min_share_bytes is None else {"min_share_bytes": min_share_bytes}
        self._options = Options.resolve(given)
        self._connection = Connection(client, cluster_options)
        _register_sizeof()
        self._token = self._connection.token
        self._calls = Calls(on_idle=self._start_closing)
        self._sender = Sender(self._connection.client, self._token, self._calls.lock)
        self._results = Results(self._calls, self._connection, self._sender, self._break)
        self._dispatcher = Dispatcher(
            self._calls,
            self._connection,
            self._sender,
            self._options,
            self._results.done,
            self._break,
        )
        self._closer: threading.Thread | None = None  # see _start_closing

    @property
    def client(self) -> distributed.Client:
        """The ``distributed.Client`` the tasks go through."""
        return cast("distributed.Client", self._connection.client)

    # -- submit ---------------------------------------------------------------------------

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` on the cluster; see
        :meth:`concurrent.futures.Executor.submit`.

        Raises
        ------
        concurrent.futures.BrokenExecutor
            The executor is broken: its client was closed, lost its scheduler, or the
            cluster was restarted (the message says which), or ``terminate_workers``
            or ``kill_workers`` was called.
        RuntimeError
            After :meth:`shutdown`.
        """
        future: _ClusterFuture[T] = _ClusterFuture()
        calls = self._calls
        if calls.broken is None and (why := self._connection.gone()) is not None:
            self._break(why)
        with calls.lock:
            if calls.broken is not None:
                raise BrokenExecutor(calls.broken)
            if calls.shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            untyped = cast(_ClusterFuture[object], future)
            calls.add(_Call(untyped, (fn, args, kwargs), self._sender.now()))
            self._dispatcher.start()
        untyped.add_done_callback(calls.seen_done)
        return future

    def _break(self, why: str) -> None:
        self._calls.end_all(why)

    # -- map, statistics, stopping --------------------------------------------------------

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ) -> Iterator[T]:
        """Return an iterator of ``fn`` applied to the items of ``iterables``, in order,
        the calls made on the cluster.

        As :meth:`concurrent.futures.ProcessPoolExecutor.map` of Python 3.14 (and
        :meth:`SharedProcessPoolExecutor.map`), on every Python sharexec supports.

        Parameters
        ----------
        fn : callable
            Called as ``fn(*items)``, one item of each iterable.
        *iterables : iterable
            Consumed in step, until the shortest ends.
        timeout : float, optional
            Seconds, from this call, within which every result must be ready:
            :class:`TimeoutError` when one is not.
        chunksize : int, default 1
            Calls sent to the cluster together, in one task.
        buffersize : int, optional
            At most this many tasks (of ``chunksize`` calls) are submitted ahead of the
            results consumed: ``map`` over a huge or endless iterator takes items as
            results are taken. By default every call is submitted at once.

        Returns
        -------
        iterator
            The results, in the order of the items. A call's exception is raised when its
            result is reached; closing the iterator cancels the calls not started.
        """
        submit_one = partial(submit_future, fn)
        chunk = partial(_worker.run_chunk, fn)
        return map_calls(self, iterables, timeout, chunksize, buffersize, submit_one, chunk)

    def statistics(self) -> Statistics:
        """What this executor sent to the cluster, and how: the fields of
        :meth:`SharedProcessPoolExecutor.statistics`, with their meaning on a cluster.

        Returns
        -------
        Statistics
            ``segments_live`` and ``bytes_in_shared_memory``: this process's segments
            holding data now (shared arrays, and the copies of sent arrays this process
            made for the workers of its host; the workers' own copies, on other hosts,
            are not counted). ``bytes_copied``: bytes of arguments sent to the cluster,
            once each; ``bytes_reused``: bytes of arguments served an array sent before,
            instead of sending it again; ``fallbacks``: arrays sent through Dask as bytes
            because this host's shared memory was short. ``tasks_submitted`` and
            ``tasks_done``: calls submitted (a ``map`` chunk is one), and those whose
            future is done. Always zero here: ``segments_pooled`` and ``bytes_pooled``
            (no warm pool), ``bytes_by_reference`` (a shared array reaches a task as a
            snapshot, copied in and out, never by reference), ``tasks_batched`` and
            ``batches`` (every call is a task of its own).
        """
        from .._warm import pooled_everywhere

        owned, owned_bytes = _session.live()
        everywhere, everywhere_bytes = pooled_everywhere()
        with self._calls.lock:
            return Statistics(
                segments_live=max(0, owned - everywhere),
                bytes_in_shared_memory=max(0, owned_bytes - everywhere_bytes),
                segments_pooled=0,
                bytes_pooled=0,
                bytes_copied=self._sender.bytes_sent,
                bytes_reused=self._sender.bytes_reused,
                bytes_by_reference=0,
                fallbacks=self._sender.fallbacks,
                tasks_submitted=self._calls.submitted,
                tasks_done=self._calls.done_count(),
                tasks_batched=0,
                batches=0,
            )

    def terminate_workers(self) -> None:
        """Stop now: end the calls in flight, and shut the executor down.

        As :meth:`concurrent.futures.ProcessPoolExecutor.terminate_workers` of Python
        3.14, with a meaning on a cluster: the calls not started are cancelled, those
        running fail with :class:`~concurrent.futures.BrokenExecutor` and their tasks
        are cancelled on the cluster, and no call may be submitted afterwards. The
        workers of a local cluster this executor started are terminated (SIGTERM; a
        ``processes=False`` cluster has none: its threads cannot be stopped, it is
        closed). The workers of a cluster given as a client or an address are the
        user's, shared with other work: they are never signalled, and a task already
        running in one runs to its end there (Dask cannot stop a worker's thread), its
        outcome dropped.
        """
        self._force_shutdown(signal.SIGTERM)

    def kill_workers(self) -> None:
        """Stop now, as :meth:`terminate_workers`, the workers of a local cluster this
        executor started being killed (SIGKILL).

        As :meth:`concurrent.futures.ProcessPoolExecutor.kill_workers` of Python 3.14;
        the workers of a cluster given as a client or an address are never signalled.
        """
        self._force_shutdown(signal.SIGKILL)

    def _force_shutdown(self, signum: signal.Signals) -> None:
        name = "kill_workers" if signum == signal.SIGKILL else "terminate_workers"
        calls = self._calls
        with calls.lock:
            calls.shut_down = self._sender.shut_down = True
            queued = calls.cancel_queued()
            remotes = [c.remote for c in calls.running.values() if c.remote is not None]
        for future in queued:  # as shutdown(cancel_futures=True)
            future.cancel()
        # The running calls fail first: their tasks cancelled next are none of theirs.
        self._break(f"{name}() was called: the calls in flight were ended")
        self._connection.cancel(remotes)
        self._connection.signal_workers(signum)
        self.shutdown(wait=False)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Free the executor's resources once the calls submitted are done; see
        :meth:`concurrent.futures.Executor.shutdown`.

        With ``wait``, returns once every call is done and the cluster holds nothing of
        this executor's (no task, no blob); a local cluster the executor started is
        closed. Without, that happens when the last call is done.
        """
        calls = self._calls
        with calls.lock:
            calls.shut_down = self._sender.shut_down = True
            if cancel_futures:
                for future in calls.cancel_queued():
                    future.cancel()
            calls.changed.notify_all()
            if wait:
                calls.changed.wait_for(lambda: calls.idle)
            else:
                calls.close_when_idle = True
            idle = calls.idle
        if idle:
            closer = self._start_closing()
            if wait:
                closer.join()

    def _start_closing(self) -> threading.Thread:
        """The thread that frees what the executor holds on the cluster, started once (not
        in a Dask callback thread, which the closing waits on)."""
        with self._calls.lock:
            if self._closer is None:
                self._closer = threading.Thread(
                    target=self._release_all, name="sharexec-cluster-close"
                )
                self._closer.start()
            return self._closer

    def _release_all(self) -> None:
        try:
            self._dispatcher.join()
            self._results.shutdown()
            self._sender.release_all()
        finally:
            self._connection.close()
