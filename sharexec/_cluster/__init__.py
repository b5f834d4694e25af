"""ClusterExecutor: the same program on a Dask cluster, and ``use_cluster``.

This package owns the cluster executor, the choice that makes :func:`sharexec.get_executor`
return one, and what runs of it in a Dask worker, a module per role: ``executor``
(:class:`ClusterExecutor`, the facade a user calls, and the closing thread), ``calls``
(the calls from submit until done, the one lock), ``connection`` (the Dask client and
cluster: made or given, watched, their workers signalled, closed), ``dispatch`` (the
dispatcher thread: pack, send, submit), ``results`` (the results thread: fetch, write
back, complete), ``packing`` (the cluster's sink for the one pass, ``_reduction.dumps``,
and its reducer tables), ``sending`` (the blobs sent, by digest), ``blobs`` (bytes sent
once, one copy per host: ``_HostBytes``), ``worker`` (what a Dask worker runs: ``_run``,
its ``Outcome``), ``dask_api`` (the parts of Dask's untyped API used, typed), ``choice``
(:func:`use_cluster`, :func:`chosen`).

Dask distributed schedules and moves the data; sharexec only decides what to send, once,
and how each task sees it. ``distributed`` is imported only when an executor is made
(``import sharexec`` and ``get_executor`` never load it).

Data flow, in the order a submitted call travels::

  submit(fn, *args, **kwargs)                                      user thread
    └─ a _Call in the queue, stamped with the executor's clock; nothing is read yet
  dispatcher thread: while fewer than two calls per worker thread are in Dask
    └─ the call is running now (set_running_or_notify_cancel); Dispatcher._pack:
       THE pass of the local executor (_reduction.dumps) over (fn, args, kwargs), with
       the cluster's sink (packing.ClusterSink: no segment crosses hosts) and the reducer
       tables less those that pass a file descriptor or a shared-memory name
         reducer_override(ndarray)
           in a shared segment (any view)   ─▶ a slot: its values now (a snapshot), to be
                                               rebuilt as the task's own array
           large and gappy                  ─▶ a compact copy (in this process), then as below
           large, dense                     ─▶ a buffer over the bytes it spans + geometry
         reducer_override(tensor, storage)  ─▶ the storage's bytes as a buffer + geometry
         buffer_callback(PickleBuffer)      (large arrays, pandas, pyarrow…)
           < min_share_bytes                ─▶ in the payload
           else, after the pass succeeded (Sender.send):
           an argument whose bytes were     ─▶ that blob (no hash: the local executor's
             hashed after this call's submit     rule for trusting a copy, _copies.taken_for)
           all zeros (a fresh output)       ─▶ their length alone, in the task
           otherwise                        ─▶ its SHA-256: a blob already on the cluster
                                               with that digest, or scattered once now
                                               (_HostBytes, client.scatter; _scatter); a
                                               length no blob has is copied for this
                                               host's workers as it is hashed (_hash)
    └─ client.submit(_run, payload, blobs, pure=False, key=<fn>-<token>-<n>)
  worker:   each blob a _HostBytes, one per host in a sharexec segment; the task gets a
            copy-on-write mapping of it (writes stay its own), or fresh zeros; slots
            rebuilt from their snapshots; fn(*args, **kwargs); an Outcome: the result or
            the exception (a _wire.Raised), and what it changed in each slot (Change)
  Dask's callback thread: the call is out of Dask (the next may go) ─▶ results thread
            (results.Results):
            the outcome fetched (with those of the calls finished meanwhile, in one
            round trip) and released on the cluster; the changed elements
            written into the shared arrays; then the future completes; its blobs are let
            go of (released when no call holds them and no object they came from lives)

Where workers share the client's host, the client copies a blob's bytes once into a
segment of its own and sends those workers its name alone. On any other host, the first
worker to receive a blob copies it into a segment it owns; a worker on the same host
that receives it from that one maps the segment by name instead of keeping what it
received. Every such segment is tracked and swept as any sharexec segment. A task maps a
blob copy-on-write through the worker's kept mappings (reused by the next task while no
task wrote into it): its pages are the segment's, shared, never the worker's private
memory, and Dask's ``sizeof`` of a blob is its handle's.
"""

from __future__ import annotations

from .choice import chosen, use_cluster
from .executor import ClusterExecutor

__all__ = ["ClusterExecutor", "chosen", "use_cluster"]
