"""The client's side of the cluster executor: :class:`ClusterExecutor`.

The user's thread queues a call; the dispatcher thread packs it when the cluster has room
(``packing``), sends its large buffers once (``blobs``) and submits it to Dask; Dask's
callback marks it out of Dask, and the results thread fetches outcomes, writes back what
tasks changed of shared arrays and completes futures with the standard library's
outcomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import (
    BrokenExecutor,
    Executor,
    Future,
    InvalidStateError,
    ThreadPoolExecutor,
)
from concurrent.futures import wait as wait_futures
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .. import _segments, _session, _tracking, _worker
from .._api import Statistics, map_calls, submit_future
from .._arrays import byte_bounds
from .._config import Options
from .._loky import remote_traceback
from ..errors import SegmentError

if TYPE_CHECKING:
    import distributed


from .blobs import _HostBytes, _register_sizeof
from .packing import _Packer
from .sending import Sender
from .worker import _run, _scheduler_holds, _worker_holds

T = TypeVar("T")

# Calls given to Dask at once, per worker thread: one running, one ready to start.
_PER_THREAD = 2

# How long shutdown(wait=True) waits for the cluster to forget this executor's blobs.
_FORGET_TIMEOUT = 30.0

# How long the client may take to give what it holds already (a task's error), on its

# event loop: bounded, for a loop stopped meanwhile would never answer.
_ASK_TIMEOUT = 30.0

# How often the executor looks at its client while calls are in flight (seconds): a

# client closed under them ends them, even if Dask never calls back.
_WATCH = 0.5

# The reasons Dask gives for cancelling every future of a client whose cluster forgot

# them all (this executor's arrays on it too): the executor cannot go on.
_CLUSTER_LOST = {
    "scheduler-restart": "the cluster was restarted (client.restart())",
    "scheduler-connection-lost": "the client lost its connection to the scheduler",
}


class _ClusterFuture(Future[T]):
    """A call's future: the standard library's, which can also end cancelled while
    running (see :meth:`cancel_running`)."""

    def cancel_running(self) -> None:
        """End the running call cancelled: its task was cancelled on the cluster, by
        someone other than this executor, as Dask's own executor's futures end then.

        The standard library's futures have no way to cancel a running call: this
        makes the transitions its ``set_running_or_notify_cancel`` makes for a call
        cancelled before it ran (waiters of ``wait`` and ``as_completed`` told, done
        callbacks called). A call not running is left as it is.
        """
        with self._condition:
            if self._state != "RUNNING":
                return
            self._state = "CANCELLED_AND_NOTIFIED"
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        invoke: Callable[[], None] = getattr(self, "_invoke_callbacks")  # noqa: B009
        invoke()


def _fail(future: Future[Any], error: BaseException) -> None:
    """Fail ``future`` with ``error`` unless it is done already (cancelled meanwhile, or
    ended by the executor breaking)."""
    with contextlib.suppress(InvalidStateError):
        future.set_exception(error)


class _Call:
    """A call from submit until its future is done.

    Until it is dispatched it holds its function and arguments (``call``); then its
    payload, the blobs it uses and the caller's shared views it was given; once given to
    Dask, its Dask future (``remote``).
    """

    __slots__ = ("blobs", "call", "fn_name", "future", "payload", "remote", "since", "slots")

    def __init__(
        self, future: _ClusterFuture[Any], call: tuple[Any, Any, Any], since: int
    ) -> None:
        self.future = future
        self.call: tuple[Any, Any, Any] | None = call  # (fn, args, kwargs)
        self.since = since  # the executor's clock at submit, e.g. 16
        name = getattr(call[0], "__name__", None)
        # e.g. "total": in the task's key, for Dask's dashboard
        self.fn_name = name if isinstance(name, str) and name.isidentifier() else "call"
        self.payload = b""  # e.g. b"\x80\x05…": fn, args and kwargs, blobs left out
        # The blobs it uses, in the payload's order: the digest of one sent to the
        # cluster, or one that travels in the task (zeros).
        self.blobs: list[bytes | _HostBytes] = []
        self.slots: list[np.ndarray] = []  # the caller's shared views it was given
        self.remote: Any = None  # e.g. <Future: pending, key: total-sharexec-3f9a…-7>

    def arguments(self) -> list[Any]:
        """The arrays given as arguments themselves (not inside a container)."""
        assert self.call is not None
        _, args, kwargs = self.call
        return [a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)]


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
        **cluster_options: Any,
    ) -> None:
        import distributed as dist  # the optional extra: pip install sharexec[dask]

        distributed: Any = dist  # its API is untyped

        given = {} if min_share_bytes is None else {"min_share_bytes": min_share_bytes}
        self._min_share_bytes = Options.resolve(given).min_share_bytes
        if cluster_options and client is not None:
            raise TypeError(
                "cluster options are for the local cluster ClusterExecutor starts, not for "
                f"a given client or address: {', '.join(sorted(cluster_options))}"
            )
        _register_sizeof()
        # Blobs go straight to a worker, and results come straight from one, unless the
        # client says not to: through the scheduler, it would hold their bytes as well.
        self._direct = getattr(client, "direct_to_workers", None) is not False
        # Typed Any: distributed's API is untyped. The client, e.g. <Client: 'tcp://…'>.
        self._cluster: Any = None
        self._client: Any
        if isinstance(client, distributed.Client):
            self._client, self._owns_client = client, False
        elif client is None:
            options = {"processes": True, **cluster_options}
            self._cluster = distributed.LocalCluster(**options)
            self._client = distributed.Client(self._cluster, direct_to_workers=True)
            self._owns_client = True
        elif isinstance(client, str):
            self._client = distributed.Client(client, direct_to_workers=True)
            self._owns_client = True
        else:
            raise TypeError(f"client must be a distributed.Client or an address, not {client!r}")
        self._lock = threading.RLock()
        # Notified when a call is queued, given to Dask or done, and at shutdown.
        self._changed = threading.Condition(self._lock)
        # The mark of this executor's keys on the cluster, e.g. "sharexec-3f9a…": its
        # blobs are "sharexec-3f9a…-blob-0", …, its calls "total-sharexec-3f9a…-7".
        self._token = f"sharexec-{os.urandom(8).hex()}"
        self._keys = itertools.count()
        self._sender = Sender(self._client, self._token, self._lock)
        self._submitted = 0  # calls submitted
        self._undone: set[Future[Any]] = set()  # of those, the futures not seen done yet
        # Why the executor is broken (see _break), e.g. "the Dask client … is closed…".
        self._broken: str | None = None
        self._queue: deque[_Call] = deque()  # calls not yet dispatched
        self._running: dict[_ClusterFuture[Any], _Call] = {}  # dispatched and not yet done
        self._in_dask = 0  # of those, given to Dask and not yet finished there
        self._shut_down = False
        self._close_when_idle = False
        self._dispatcher: threading.Thread | None = None  # see _dispatch
        # Fetches results and writes changes back, in the order the calls finish, so that
        # neither Dask's one callback thread nor the dispatcher waits for that.
        self._results = ThreadPoolExecutor(1, thread_name_prefix="sharexec-cluster-results")
        # The calls finished on the cluster whose outcome the results thread has not
        # taken yet, in the order they finished, e.g. [(<_Call>, <Future: finished>)].
        self._arrived: list[tuple[_Call, Any]] = []
        self._closer: threading.Thread | None = None  # see _start_closing
        self._threads = -2.0, 1  # (when counted, worker threads): refreshed each second

    @property
    def client(self) -> distributed.Client:
        """The ``distributed.Client`` the tasks go through."""
        client: distributed.Client = self._client
        return client

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
        if self._broken is None and (why := self._gone()) is not None:
            self._break(why)
        with self._lock:
            if self._broken is not None:
                raise BrokenExecutor(self._broken)
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.append(_Call(future, (fn, args, kwargs), self._sender.now()))
            self._submitted += 1
            self._undone.add(future)
            if self._dispatcher is None:
                self._dispatcher = threading.Thread(
                    target=self._dispatch, name="sharexec-cluster-dispatch", daemon=True
                )
                self._dispatcher.start()
            self._changed.notify_all()
        future.add_done_callback(self._seen_done)
        return future

    def _seen_done(self, future: Future[Any]) -> None:
        with self._lock:
            self._undone.discard(future)

    # -- dispatch: in the dispatcher thread -----------------------------------------------

    def _dispatch(self) -> None:
        """Give Dask the calls queued, while fewer than the capacity are running there;
        and, while calls are in flight, watch the client (see _gone)."""
        while True:
            call, why = self._next_call()
            if why is not None:
                self._break(why)
            if call is None:
                return
            try:
                self._pack(call)
                with self._lock:
                    blobs = [self._sender.given(b) for b in call.blobs]
                remote = self._client.submit(
                    _run,
                    call.payload,
                    blobs,
                    key=f"{call.fn_name}-{self._token}-{next(self._keys)}",
                    pure=False,
                    **self._where(blobs),
                )
            except BaseException as exc:  # unpicklable arguments, a closed client…
                if (why := self._gone()) is not None:
                    self._break(why)
                _fail(call.future, exc)
                self._finished(call, None)
                continue
            call.remote = remote
            remote.add_done_callback(partial(self._done, call))
            # Closed meanwhile: Dask may never call back (its loop stopped).
            if (why := self._gone()) is not None:
                self._break(why)

    def _next_call(self) -> tuple[_Call | None, str | None]:
        """The next call to give Dask, marked running; or None when the dispatcher is
        to end, with why the executor is broken if it is now."""
        with self._lock:
            while True:
                if self._broken is not None:
                    return None, None
                if (self._queue or self._running) and (why := self._gone()) is not None:
                    return None, why
                if self._queue and self._in_dask < self._capacity():
                    call = self._queue.popleft()
                    if not call.future.set_running_or_notify_cancel():  # cancelled
                        continue
                    self._running[call.future] = call
                    self._in_dask += 1
                    return call, None
                if self._shut_down and not self._queue and not self._running:
                    return None, None
                self._changed.wait(_WATCH if self._queue or self._running else None)

    def _gone(self) -> str | None:
        """Why the executor cannot go on, if its client is not running any more."""
        status = self._client.status
        if status == "running":
            return None
        return (
            f"the Dask client of this executor is not running (its status: {status}; "
            "closed, or its scheduler lost): the calls in flight were lost with it, and "
            "no call can run"
        )

    def _break(self, why: str) -> None:
        """The executor is broken: every call not done fails with
        :class:`~concurrent.futures.BrokenExecutor` (as the standard library's when its
        pool breaks), and none may be submitted. Their tasks, if any, are lost with the
        client or the cluster: no call waits for Dask to call back any more."""
        with self._lock:
            if self._broken is None:
                self._broken = why
            why = self._broken
            ended = [call.future for call in self._queue]
            ended += self._running
            self._queue.clear()
            self._running.clear()
            self._changed.notify_all()
            idle = self._close_when_idle
        for future in ended:
            _fail(future, BrokenExecutor(why))
        if idle:  # shutdown(wait=False) was called
            self._start_closing()

    def _where(self, blobs: list[Any]) -> dict[str, Any]:
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

    def _capacity(self) -> int:
        counted, threads = self._threads
        now = time.monotonic()
        if now - counted > 1.0:
            with contextlib.suppress(Exception):  # (the client closing: seen by _gone)
                threads = max(1, sum(self._client.nthreads().values()))
            self._threads = now, threads
        return _PER_THREAD * threads

    def _pack(self, call: _Call) -> None:
        out = io.BytesIO()
        packer = _Packer(out, self._min_share_bytes)
        try:
            packer.dump(call.call)
            buffers, call.slots = packer.buffers, packer.slots
        finally:
            packer.clear_memo()  # it holds the arguments
            packer.buffers, packer.slots, packer.snapshots = [], [], {}
        arguments = call.arguments()
        call.call = None  # the arguments are read: let go of them
        call.payload = out.getvalue()
        call.blobs = [self._sender.send(data, call.since, arguments) for data in buffers]

    # -- results: in a Dask callback thread, then in the results thread -------------------

    def _done(self, call: _Call, remote: Any) -> None:
        """A call finished on the cluster: the next may go while its result comes back."""
        with self._lock:
            self._in_dask -= 1
            self._changed.notify_all()
            self._arrived.append((call, remote))
        self._results.submit(self._collect)

    def _collect(self) -> None:
        """In the results thread: deliver the outcomes of the calls finished so far, in
        the order they finished, then free what they held. Their results are fetched
        together: one round trip, from every worker holding one at once."""
        with self._lock:
            ready, self._arrived = self._arrived, []
        fetched: dict[str, Any] = {}
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
                self._deliver(call, remote, fetched.pop(remote.key, _NOT_FETCHED))
            finally:
                with contextlib.suppress(Exception):  # (a client closed: nothing to free)
                    remote.release()  # (done already, unless delivering failed)
                self._finished(call, remote)

    def _gather(self, remotes: list[Any]) -> list[Any]:
        """The results of finished tasks (of ones lost since, once computed again),
        waited for while the client lives: a gather whose client closes under it would
        never return (its event loop stopped)."""
        coroutine = self._client.gather(remotes, direct=self._direct, asynchronous=True)
        gathered = asyncio.run_coroutine_threadsafe(coroutine, self._client.loop.asyncio_loop)
        while not wait_futures([gathered], _WATCH).done:
            if (why := self._gone()) is not None:
                gathered.cancel()
                raise BrokenExecutor(why)
        results: list[Any] = gathered.result()
        return results

    def _finished(self, call: _Call, remote: Any) -> None:
        with self._lock:
            if remote is None:  # it never reached Dask
                self._in_dask -= 1
            self._running.pop(call.future, None)
            self._sender.let_go(call.blobs)
            call.blobs = []
            self._changed.notify_all()
            idle = self._close_when_idle and not self._running and not self._queue
        if idle:  # shutdown(wait=False) was called
            self._start_closing()

    def _deliver(self, call: _Call, remote: Any, outcome: Any) -> None:
        """Complete the call's future: with ``outcome``, the task's, or fetched now.

        How each end of a Dask future maps to the standard library's:

        * finished (or lost since, then computed again): the result, or the exception
          the function raised, with its remote traceback as ``__cause__``;
        * erred (the call failed to unpickle, a worker died running it too often:
          Dask's ``KilledWorker``): that exception, with Dask's traceback if any;
        * cancelled, with the client closed, its scheduler lost, or the cluster
          restarted: every call not done fails with ``BrokenExecutor`` (see _break);
        * cancelled by someone else on the cluster: the future ends cancelled.
        """
        future = call.future
        if future.done():  # ended already: the executor broke
            call.slots = []
            return
        failure: BaseException | None = None
        if remote.status not in ("error", "cancelled") and outcome is _NOT_FETCHED:
            try:
                outcome = self._gather([remote])[0]
            except BaseException as exc:
                failure = exc
        if failure is not None or remote.status in ("error", "cancelled"):
            call.slots = []
            self._failed(call, remote, failure)
            return
        with contextlib.suppress(Exception):
            remote.release()  # the result leaves the cluster before the future is done
        try:
            for index, change in outcome[-1]:
                _write_back(call.slots[index], change)
        except BaseException as exc:  # (a view made read-only meanwhile, say)
            _fail(future, exc)
            return
        finally:
            call.slots = []
        if outcome[0] == "ok":
            with contextlib.suppress(InvalidStateError):  # (ended by _break meanwhile)
                future.set_result(outcome[1])
        else:
            _fail(future, outcome[1].error)  # its cause: the worker's traceback

    def _failed(self, call: _Call, remote: Any, failure: BaseException | None) -> None:
        """End a call whose task did not finish on the cluster (``failure``: what
        fetching its result raised, if that is how it failed)."""
        status = remote.status
        why = self._gone()
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
            _fail(call.future, error)
        else:
            assert failure is not None
            _fail(call.future, failure)

    # -- map and shutdown -----------------------------------------------------------------

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
        with self._lock:
            return Statistics(
                segments_live=max(0, owned - everywhere),
                bytes_in_shared_memory=max(0, owned_bytes - everywhere_bytes),
                segments_pooled=0,
                bytes_pooled=0,
                bytes_copied=self._sender.bytes_sent,
                bytes_reused=self._sender.bytes_reused,
                bytes_by_reference=0,
                fallbacks=self._sender.fallbacks,
                tasks_submitted=self._submitted,
                # Done the moment its state says so (before its callbacks are called).
                tasks_done=self._submitted - sum(not f.done() for f in self._undone),
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
        with self._lock:
            self._shut_down = self._sender.shut_down = True
            queued = [call.future for call in self._queue]
            self._queue.clear()
            remotes = [c.remote for c in self._running.values() if c.remote is not None]
        for future in queued:  # as shutdown(cancel_futures=True)
            future.cancel()
        # The running calls fail first: their tasks cancelled next are none of theirs.
        self._break(f"{name}() was called: the calls in flight were ended")
        if remotes and self._gone() is None:
            with contextlib.suppress(Exception):  # (the client closing meanwhile)
                self._client.cancel(remotes, force=True)
        for pid in self._worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        self.shutdown(wait=False)

    def _worker_pids(self) -> list[int]:
        """The worker processes of the local cluster this executor started (none of a
        cluster it was given, nor of a cluster of threads)."""
        if self._cluster is None:
            return []
        pids = []
        for worker in list(self._cluster.workers.values()):  # nannies, or workers
            pid = getattr(getattr(getattr(worker, "process", None), "process", None), "pid", None)
            if isinstance(pid, int):
                pids.append(pid)
        return pids

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Free the executor's resources once the calls submitted are done; see
        :meth:`concurrent.futures.Executor.shutdown`.

        With ``wait``, returns once every call is done and the cluster holds nothing of
        this executor's (no task, no blob); a local cluster the executor started is
        closed. Without, that happens when the last call is done.
        """
        with self._lock:
            self._shut_down = self._sender.shut_down = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft().future.cancel()
            self._changed.notify_all()
            if wait:
                self._changed.wait_for(lambda: not self._running and not self._queue)
            else:
                self._close_when_idle = True
            idle = not self._running and not self._queue
        if idle:
            closer = self._start_closing()
            if wait:
                closer.join()

    def _start_closing(self) -> threading.Thread:
        """The thread that frees what the executor holds on the cluster, started once (not
        in a Dask callback thread, which the closing waits on)."""
        with self._lock:
            if self._closer is None:
                self._closer = threading.Thread(
                    target=self._release_all, name="sharexec-cluster-close"
                )
                self._closer.start()
            return self._closer

    def _release_all(self) -> None:
        try:
            dispatcher = self._dispatcher
            if dispatcher is not None:
                dispatcher.join()
            self._results.shutdown(wait=True)
            self._sender.release_all()
            # (A cluster of the executor's own is closed: nothing of it is left.)
            if self._client.status == "running" and self._cluster is None:
                self._await_forgotten()
        finally:
            if self._owns_client:
                self._client.close()
            if self._cluster is not None:
                self._cluster.close()

    def _await_forgotten(self) -> None:
        """Until neither the scheduler nor a worker holds a key of this executor's."""
        deadline = time.monotonic() + _FORGET_TIMEOUT
        while time.monotonic() < deadline and self._client.status == "running":
            try:
                held = self._client.run_on_scheduler(_scheduler_holds, self._token)
                held += sum(self._client.run(_worker_holds, self._token).values())
            except Exception:  # (a worker leaving as it is asked): ask again
                held = 1
            if not held:
                return
            time.sleep(0.02)  # the workers forget a moment after the scheduler tells them


_NOT_FETCHED = object()  # a finished call's outcome, not fetched with others'


def _write_back(view: np.ndarray, change: Any) -> None:
    """Write a task's changes into the caller's shared view (every page of a view written
    whole mapped at once first: a fresh output's pages are not mapped in this process)."""
    mask, values = change
    if mask is None:
        low, high = byte_bounds(view)
        found = _tracking.find_shared(low, high)
        if found is not None:
            _segments.populate(found[0], found[1], high - low)
        view[...] = values
    else:
        view[np.unpackbits(mask, count=view.size).view(bool).reshape(view.shape)] = values
