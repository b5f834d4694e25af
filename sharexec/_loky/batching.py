"""Batching: several queued calls in one message to a worker, their outcomes back together.

Replaces, in loky 3.7's ``_ExecutorManagerThread``, the two steps of its loop that send
calls (``add_call_item_to_queue``) and complete futures (``process_result_item``): the
manager (:class:`_Manager`, the thread's class swapped once it has started) asks
sharexec's :class:`BatchPolicy` how many queued calls go together in one call item
(:class:`CallBatch`), completes each from the worker's :class:`BatchOutcome`, and queues
again the calls a worker hands back unstarted. Also replaced: the manager's wake-up
(:class:`_CoalescedWakeup`, written only when the thread is asleep, where loky writes
one byte per submit) and the work-id queue (:class:`_WorkIds`, a deque where loky has a
``queue.Queue``). A call delivered while it waited to be pickled raises
:class:`AlreadyDone`, and the feeder drops it.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeAlias

from loky import process_executor

_NO_KEYWORDS: dict[str, object] = {}  # the keywords of every call queued: never changed

# A queued call as the executor queued it (``_enqueue``): its function and arguments.
Call: TypeAlias = tuple[Callable[..., object], tuple[object, ...]]
# What a ``__reduce__`` returns: a callable and its arguments.
Reduced: TypeAlias = tuple[Callable[..., object], tuple[object, ...]]


class _WorkItem(Protocol):
    """A call waiting in the manager's ``pending_work_items`` (loky's ``_WorkItem``)."""

    fn: Callable[..., object]
    args: tuple[object, ...]
    kwargs: dict[str, object]

    @property
    def future(self) -> _Future: ...


class _Future(Protocol):
    def set_running_or_notify_cancel(self) -> bool: ...


class BatchPolicy(Protocol):
    """What the manager thread asks before it sends calls together (``_batching``'s).

    Called from the manager thread only. ``fn`` and ``args`` are those of a queued call
    as the executor queued it (``_enqueue``).
    """

    budget: float  # seconds of estimated run time one batch may hold

    def cost(self, fn: Callable[..., object], args: tuple[object, ...]) -> float | None:
        """The call's estimated run time in seconds; None: it goes alone."""

    def limit(self, queued: int) -> int:
        """How many calls one batch may take when ``queued`` calls wait."""

    def measured(
        self, fn: Callable[..., object], args: tuple[object, ...], seconds: float
    ) -> None:
        """The call ran for ``seconds`` in a worker."""

    def batched(self, calls: int) -> None:
        """A batch of ``calls`` calls was queued (for statistics)."""

    def handed_back(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        """A call of a batch was handed back unstarted: it will be sent again."""

    def run_batch(self, batch: Any) -> object:  # what load_batch rebuilt
        """Runs in the worker: what a :class:`CallBatch` rebuilt as, to a
        :class:`BatchOutcome`."""

    def reduce_batch(self, batch: CallBatch) -> Reduced:
        """The ``__reduce__`` value of ``batch``: how its calls travel."""


class AlreadyDone(RuntimeError):
    """Raised by pickling a call whose outcome was delivered while it waited in the
    call queue's buffer (its future failed when a worker died, say): :func:`_feed`
    drops such a call, and frees its slot, instead of failing its future again."""


class CallBatch:
    """Queued calls sent in one message: their work ids and ``(fn, args)``, in order.

    Pickled by ``policy.reduce_batch`` (one pickle for the calls of plain arguments).
    If that fails, the feeder thread sends each call alone, so only a call that cannot
    be pickled fails (:func:`_feed`).
    """

    __slots__ = ("calls", "checked", "ids", "policy")

    def __init__(self, ids: list[int], calls: list[Call], policy: BatchPolicy) -> None:
        self.ids = ids
        self.calls = calls
        self.policy = policy
        self.checked = False  # made of calls that each pickled alone (see _feed)

    def __reduce__(self) -> Reduced:
        return self.policy.reduce_batch(self)


class BatchOutcome(list):  # type: ignore[type-arg]
    """What a worker sends back for a batch: ``(work_id, outcome, seconds)`` per call, in
    order; ``outcome`` is what the call sent alone would send as its result (a task's
    exception too travels as such a value, which the future raises: ``_worker.run``).
    Pickled by plain pickle: every outcome is made to pickle. ``returned``: the work ids
    of the calls the worker hands back, not started (the parent queues them again)."""

    returned: Sequence[int] = ()

    def add(self, work_id: int, outcome: object, seconds: float) -> None:
        self.append((work_id, outcome, seconds))


class _CoalescedWakeup(process_executor._ThreadWakeup):  # type: ignore[misc]
    """loky's wake-up of the manager thread, written for a call only when none is
    pending.

    loky writes a byte to a pipe at every submit: a system call, and a thread switch
    to the manager, per call. Here a submit (``wakeup_for_call``) writes only if the
    manager has not been woken since it last cleared the pipe. Safe because the manager
    clears *before* it next looks at the queued calls (``wait_result_broken_or_wakeup``
    ends its step with ``clear``), and the flag is reset after the pipe is drained: any
    call queued before the reset is seen by that look, any wake-up after it writes
    again. loky's own wake-ups (``wakeup``: shutdown, a broken pool, new workers to
    watch) always write: they are rare, and one that a stale flag swallowed would leave
    the manager asleep while ``shutdown`` waits for it.
    """

    _pending = False
    # Whether the manager thread is awake and will look at the queued calls before it
    # next waits (set by _Manager): then a call queued needs no wake-up at all.
    awake = False

    def wakeup_for_call(self) -> None:
        """A call was queued: wake the manager unless it is awake or already woken."""
        if self.awake or self._pending:
            return
        self._pending = True
        try:
            self.wakeup()
        except BaseException:
            # Not written (Ctrl-C in the submitting thread, say): a flag left set would
            # swallow every later call's wake-up.
            self._pending = False
            raise

    def clear(self) -> None:
        super().clear()
        self._pending = False


class _WorkIds:
    """The queue of work ids, a deque: loky's is a ``queue.Queue`` (two locks and a
    condition per call) read only by its manager thread, never blocking."""

    def __init__(self) -> None:
        self._ids: deque[int] = deque()

    def put(self, work_id: int) -> None:
        self._ids.append(work_id)

    def put_back(self, ids: list[int]) -> None:
        """Queue again calls taken before (``ids``, in order): ahead of the others, in
        the order they were queued first. Called by the manager thread, the only one
        that takes ids (a submit only appends), so the front of the queue is its own:
        the ids put back before (smaller than any never taken) are merged with these."""
        queued = self._ids
        last = ids[-1]
        ahead = []
        while queued and queued[0] < last:
            ahead.append(queued.popleft())
        if ahead:
            ids = sorted(ids + ahead)
        queued.extendleft(reversed(ids))

    def get(self, block: bool = True, timeout: float | None = None) -> int:
        if block:  # pragma: no cover - loky never blocks on it
            raise NotImplementedError("work ids are taken without blocking")
        try:
            return self._ids.popleft()
        except IndexError:
            raise queue.Empty from None

    def get_nowait(self) -> int:
        return self.get(block=False)

    def qsize(self) -> int:
        return len(self._ids)

    def empty(self) -> bool:
        return not self._ids


class _Manager(process_executor._ExecutorManagerThread):  # type: ignore[misc]
    """loky's manager thread, which sends queued calls of short functions together.

    ``add_call_item_to_queue`` fills free places of the call queue as loky's does, one
    call item per place; a call whose function the policy measured short starts a
    batch, which takes the calls queued after it while they are short too, up to the
    policy's budget of run time and its limit on calls. Each call of a batch is marked
    running as it joins (a cancelled one is dropped, as loky drops it), and is listed
    in loky's tables under its own work id: a dead worker fails each with
    ``BrokenProcessPool``, as it would fail them alone. ``process_result_item``
    completes each call of a batch's outcome, in order, and feeds every call's
    measured run time to the policy. The calls a worker hands back unstarted (its batch
    ran past its bound) are pending again and queued ahead of the others
    (``_queue_again``): loky's tables count them pending, not running, and a dead
    worker fails them as any pending call.
    """

    policy: BatchPolicy | None  # None: every call goes alone
    carry: int | None  # a work id taken but not sent: it goes first in the next step
    results_closed: Callable[[], None] | None  # told once no more result is read

    def join_executor_internals(self) -> None:
        # The last step of every end (shut down, broken, the executor collected, the
        # interpreter exiting): the result queue is closed, and whatever a worker still
        # sent will never be read.
        try:
            super().join_executor_internals()
        finally:
            if self.results_closed is not None:
                self.results_closed()

    def wait_result_broken_or_wakeup(self) -> Any:
        # While this thread is awake, a submit does not write its wake-up (a system call
        # and a thread switch per call): this thread looks at the queue before it waits.
        # Marked asleep first, then that look: a call queued before the mark is seen
        # here, one queued after it writes.
        wakeup = self.thread_wakeup
        wakeup.awake = False
        if self.work_ids_queue.qsize() and not self.call_queue.full():
            wakeup.wakeup_for_call()
        try:
            return super().wait_result_broken_or_wakeup()
        finally:
            wakeup.awake = True

    def add_call_item_to_queue(self) -> None:
        pending = self.pending_work_items
        while not self.call_queue.full():
            work_id = self.carry
            if work_id is None:
                try:
                    work_id = self.work_ids_queue.get(block=False)
                except queue.Empty:
                    return
            self.carry = None
            work_item = pending.get(work_id)
            if work_item is None:
                continue  # failed meanwhile (shut down with kill_workers)
            if not work_item.future.set_running_or_notify_cancel():
                del pending[work_id]
                continue
            members = self._gather(work_id, work_item)
            if members is None:
                self.running_work_items.append(work_id)
                call = process_executor._CallItem(
                    work_id, work_item.fn, work_item.args, work_item.kwargs
                )
            else:
                ids = [work_id, *(i for i, _ in members)]
                policy = self.policy
                assert policy is not None  # _gather batches only with a policy
                calls = [(work_item.fn, work_item.args)]
                calls += [(item.fn, item.args) for _, item in members]
                self.running_work_items.extend(ids)
                batch = CallBatch(ids, calls, policy)
                call = process_executor._CallItem(
                    work_id, policy.run_batch, (batch,), _NO_KEYWORDS
                )
                policy.batched(len(ids))
            self.call_queue.put(call, block=True)

    def _gather(self, work_id: int, work_item: _WorkItem) -> list[tuple[int, _WorkItem]] | None:
        """The calls queued after ``work_item`` that go with it (marked running), or
        None if it goes alone."""
        policy = self.policy
        if policy is None:
            return None
        cost = policy.cost(work_item.fn, work_item.args)
        if cost is None:
            return None
        limit = policy.limit(self.work_ids_queue.qsize() + 1) - 1
        if limit <= 0:
            return None
        budget = policy.budget - cost
        pending = self.pending_work_items
        members: list[tuple[int, _WorkItem]] = []
        while len(members) < limit:
            try:
                next_id = self.work_ids_queue.get(block=False)
            except queue.Empty:
                break
            item = pending.get(next_id)
            if item is None:
                continue
            cost = policy.cost(item.fn, item.args)
            if cost is None or cost > budget:
                self.carry = next_id  # goes first next time, alone or leading a batch
                break
            if not item.future.set_running_or_notify_cancel():
                del pending[next_id]
                continue
            members.append((next_id, item))
            budget -= cost
        return members or None

    def process_result_item(self, result_item: Any) -> None:
        if type(result_item) is not process_executor._ResultItem:
            super().process_result_item(result_item)  # a worker's pid: it left
            return
        outcome = result_item.result
        if type(outcome) is BatchOutcome:
            self._complete(outcome)
            return
        seconds = getattr(result_item, "seconds", None)
        if seconds is not None and self.policy is not None:
            work_item = self.pending_work_items.get(result_item.work_id)
            if work_item is not None:
                self.policy.measured(work_item.fn, work_item.args, seconds)
        super().process_result_item(result_item)

    def _complete(self, outcome: BatchOutcome) -> None:
        """Complete each call of a batch, in order, with its own result or exception;
        queue again the calls its worker handed back."""
        pending = self.pending_work_items
        assert self.policy is not None  # a batch was sent
        measured = self.policy.measured
        done: list[int] = []
        for work_id, value, seconds in outcome:
            work_item = pending.pop(work_id, None)
            if work_item is None:
                continue  # failed meanwhile (a dead worker broke the pool)
            measured(work_item.fn, work_item.args, seconds)
            work_item.future.set_result(value)  # the future raises a task's exception
            done.append(work_id)
            del work_item
        outcome.clear()
        self._not_running(done)
        if outcome.returned:
            self._queue_again(outcome.returned)

    def _queue_again(self, ids: Sequence[int]) -> None:
        """Calls a worker handed back, not started: pending again (they keep their work
        ids and futures, and may be cancelled), queued ahead of the later calls, in
        their order. If the pool is shutting down with its pending calls cancelled, they
        are cancelled too, as they would have been had they been pending then."""
        pending = self.pending_work_items
        back = [work_id for work_id in ids if work_id in pending]  # not failed meanwhile
        self._not_running(back)
        if not back:
            return
        policy = self.policy
        assert policy is not None  # a batch was sent
        for work_id in back:
            work_item = pending[work_id]
            policy.handed_back(work_item.fn, work_item.args)
            work_item.future.set_pending_again()
            del work_item
        if self.carry is not None:  # taken from the queue's front: it goes back there
            back.append(self.carry)
            back.sort()
            self.carry = None
        self.work_ids_queue.put_back(back)
        if self.executor_flags.cancel_pending:  # read after they became pending
            for work_id in back:
                work_item = pending.get(work_id)
                if work_item is not None:
                    work_item.future.cancel()

    def _not_running(self, ids: list[int]) -> None:
        """Take ``ids`` out of loky's list of running ids."""
        if not ids:
            return
        # All at once (a remove per call would move the rest of the list each time), in
        # place: loky's queue holds the same list. A batch's ids were added together,
        # so they are found together, unless some failed alone in the feeder thread
        # meanwhile.
        running = self.running_work_items
        try:
            at = running.index(ids[0])
        except ValueError:
            at = -1
        if at >= 0 and running[at : at + len(ids)] == ids:
            del running[at : at + len(ids)]
        else:
            gone = set(ids)
            running[:] = [work_id for work_id in running if work_id not in gone]
