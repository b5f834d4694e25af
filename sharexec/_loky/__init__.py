"""The one door to loky's internals (and to multiprocessing's and concurrent.futures').

sharexec runs on loky's process pool, and reaches below the public surface of loky,
multiprocessing and ``concurrent.futures`` in the places listed below. Every such
access is made in this package and nowhere else in sharexec; the rest of the package
sees the small surface below, with plain names, imported from here. One module per role,
each opening with what it replaces in loky 3.7 and how it differs:

* ``check``: the check at import (below), run before the other modules subclass
  anything of loky's;
* ``executor``: :class:`LokyExecutor`, the base of sharexec's executor;
* ``batching``: loky's manager thread made to send several calls in one message;
* ``queues``: the call and result queues, and what a worker sends on them;
* ``warm_server``: sharexec's default start method;
* ``warm_preload``: in the warm server only, importing the parent's packages;
* ``temp_folder``: multiprocessing's private folder, where a fork server binds its
  socket, made in /dev/shm where no temporary folder is writable;
* ``reducers``: the reducer tables of loky and multiprocessing;
* ``leak_check``: loky's worker leak check, measuring private memory;
* ``futures``: the future, and the remote traceback.

In detail:

* :class:`LokyExecutor`, the base of sharexec's executor: loky's ``ProcessPoolExecutor``
  with ``_enqueue(future, fn, args)``, which queues a call with a future of the caller's
  own class (loky's ``submit`` makes its own future, so ``_enqueue`` repeats its few
  lines on loky's state: ``_flags``, ``_pending_work_items``, ``_work_ids``,
  ``_queue_count``, the manager thread's wake-up); the pool's state read through
  ``_pool_broken``, ``_pool_shut_down``, ``_pool_max_workers``, ``_pool_processes()`` and
  ``_pending_futures()``; the workers it starts, on demand (loky's
  ``_adjust_process_count``, which would start them all at once, starts at most one per
  call not done, each as loky does: ``_process_worker`` and its arguments; under fork all
  at the first call; a Ctrl-C held while they and the manager thread start), reported to
  ``_workers_started(pids)``; the two queue subclasses below, made in loky's hook for
  its queues; and ``shutdown(cancel_futures=True)`` reaching the calls a worker
  hands back later (``_cancel_pending``).
* Batching (the policy is :mod:`sharexec._batching`'s, a :class:`BatchPolicy`): loky's
  manager thread becomes a ``_Manager`` once started (its class swapped), which
  puts several queued calls in one call item (:class:`CallBatch`), completes each from
  the worker's :class:`BatchOutcome`, and queues again the calls a worker hands back
  (:func:`send_outcome`); its wake-up is written only when it is asleep
  (``_CoalescedWakeup``, swapped in at construction) and the work ids are a deque
  (``_WorkIds``). A call's run time rides on its result item
  (:func:`note_run_seconds`); a call delivered while it waited to be pickled raises
  :class:`AlreadyDone`, and the feeder thread drops it.
* :func:`warm_context`, sharexec's default start method: multiprocessing's forkserver
  with a server of sharexec's own (a second ``ForkServer``, preloading
  :data:`WARM_PRELOAD` and the parent's packages, through ``warm_preload``), whose
  ``Popen`` asks that server for the fork and tells the child nothing of the main
  module; :func:`warm_left_out`: the packages it leaves out.
* :func:`fork_server_folder`: multiprocessing's private folder of this process
  (``util.get_temp_dir()``, where a fork server binds its socket), made before a fork
  server starts; where no temporary folder is writable, made in /dev/shm and stored in
  the process's ``_config["tempdir"]``, where ``get_temp_dir`` looks first.
  :func:`fallback_parent`: where it would go, looking only (for ``doctor``).
* The queues, subclasses of loky's (``_CallQueue``, ``_ResultQueue``): loky
  pickles every item it puts on a queue with a fresh cloudpickle pickler, whose set-up
  (a copied dispatch table) costs about 15 µs, more than the rest of a tiny task's trip
  on either side. What sharexec puts there needs none of it: a call item carries a task
  that our own pass reduces to bytes and segment names, and a result item carries a reply
  made the same way. So the call queue's feeder thread (multiprocessing's, rebuilt on the
  queue's private parts) and the result queue's ``put`` pickle those envelopes with the
  standard pickler, and anything else (a task's exception, loky's messages) as loky
  does. They also carry worker recycling (``max_tasks_per_child``) on loky's own
  clean-exit protocol, quietly: loky's warning about a recycled worker (meant for its
  leak check) is marked as given already.
* :data:`DISPATCH_TABLE`: loky's reducers, for sharexec's picklers.
* :data:`FORKING_REDUCERS`: the reducers registered with
  ``multiprocessing.reduction.ForkingPickler.register`` (torch's tensors and storages,
  multiprocessing's own connections and sockets, sharexec's shared arrays), which the
  standard library's executor pickles everything with: read live from
  ``ForkingPickler._extra_reducers`` at each lookup, since a library registers when it is
  imported (``import torch`` does), after sharexec.
* :func:`count_private_memory_only`: in sharexec's workers only (never in the parent, nor
  in a worker of another pool), loky's leak check measures private memory, not the
  shared pages a worker maps. This is the one module attribute of loky that is
  replaced: ``loky.process_executor._get_memory_usage``, in the worker process.
* :class:`LokyFuture`, the base of sharexec's future: loky's, whose lock
  (``concurrent.futures.Future._condition``, which ``wait`` and ``as_completed`` take)
  is made when first asked for; until then the futures of one executor share one.

Also offered: :func:`remote_traceback` (the standard library's ``_RemoteTraceback``, the
``__cause__`` of a task's exception, of the type its executor gives), and, being public
loky API, :func:`cpu_count` and :func:`get_context`.

**Versions.** sharexec supports loky :data:`SUPPORTED_LOKY` (the pin in
``pyproject.toml``). At import, this package checks that everything it uses exists, and
otherwise raises an :class:`ImportError` that names the installed loky version and the
supported ones, so that a newer loky fails at once and clearly, not with an
``AttributeError`` in a feeder thread. Checked at import, all of it:

* module and class attributes, by lookup;
* attributes that loky or the standard library set on *instances* (``self._flags = ...``
  in ``ProcessPoolExecutor.__init__``): by the names that the code of the class's methods
  (along its MRO) assigns as attributes (its ``STORE_ATTR`` instructions), so no
  instance has to be made;
* the positional parameters of what is called or replaced here;
* that what is overridden or replaced here is still used where loky uses it
  (``_setup_queues`` by the constructor, ``_start_executor_manager_thread`` by
  ``_ensure_executor_running``, ``_start_thread`` by ``Queue.put``, the recycled worker's
  mark by the manager thread, ``_get_memory_usage`` by the worker's loop): the names
  that the code of those users refers to.

This package imports no NumPy: every worker imports it at start-up (it unpickles the
queues).
"""

from __future__ import annotations

from .check import SUPPORTED_LOKY, raise_if_unsupported

raise_if_unsupported()  # before the modules below subclass what loky has

from .batching import AlreadyDone, BatchOutcome, BatchPolicy, CallBatch  # noqa: E402
from .executor import LokyExecutor, cpu_count, get_context  # noqa: E402
from .futures import LokyFuture, PoolFuture, remote_traceback  # noqa: E402
from .leak_check import count_private_memory_only  # noqa: E402
from .queues import note_run_seconds, send_outcome  # noqa: E402
from .reducers import DISPATCH_TABLE, FORKING_REDUCERS, Reducers  # noqa: E402
from .temp_folder import fallback_parent, fork_server_folder  # noqa: E402
from .warm_server import WARM_PRELOAD, warm_context, warm_left_out  # noqa: E402

__all__ = [
    "DISPATCH_TABLE",
    "FORKING_REDUCERS",
    "SUPPORTED_LOKY",
    "WARM_PRELOAD",
    "AlreadyDone",
    "BatchOutcome",
    "BatchPolicy",
    "CallBatch",
    "LokyExecutor",
    "LokyFuture",
    "PoolFuture",
    "Reducers",
    "count_private_memory_only",
    "cpu_count",
    "fallback_parent",
    "fork_server_folder",
    "get_context",
    "note_run_seconds",
    "remote_traceback",
    "send_outcome",
    "warm_context",
    "warm_left_out",
]
