"""ClusterExecutor: the same program on a Dask cluster, and ``use_cluster``.

This package owns the cluster executor, the choice that makes :func:`sharexec.get_executor`
return one, and what runs of it in a Dask worker, a module per role: ``executor`` (the
client's side: :class:`ClusterExecutor`, its dispatcher and results threads), ``packing``
(the client's pass over a call), ``sending`` (the blobs sent, by digest), ``blobs``
(bytes sent once, one copy per host: ``_HostBytes``), ``worker`` (what a Dask worker
runs: ``_run``), ``choice`` (:func:`use_cluster`, :func:`chosen`).

Dask distributed schedules and moves the data; sharexec only decides what to send, once,
and how each task sees it. ``distributed`` is imported only when an executor is made
(``import sharexec`` and ``get_executor`` never load it).

Data flow, in the order a submitted call travels::

  submit(fn, *args, **kwargs)                                      user thread
    └─ a _Call in the queue, stamped with the executor's clock; nothing is read yet
  dispatcher thread: while fewer than two calls per worker thread are in Dask
    └─ the call is running now (set_running_or_notify_cancel); _pack:
       ONE cloudpickle pass at protocol 5 over (fn, args, kwargs)
         reducer_override(ndarray)
           in a shared segment (any view)   ─▶ a slot: its values now (a snapshot), to be
                                               rebuilt as the task's own array
           large and gappy                  ─▶ a contiguous copy, then as below
         buffer_callback(PickleBuffer)      (large arrays, pandas, pyarrow…)
           < min_share_bytes                ─▶ in the payload
           an argument whose bytes were     ─▶ that blob (no hash: any moment between the
             hashed after this call's submit     call's submit and dispatch is its own)
           all zeros (a fresh output)       ─▶ their length alone, in the task
           otherwise                        ─▶ its SHA-256: a blob already on the cluster
                                               with that digest, or scattered once now
                                               (_HostBytes, client.scatter; _scatter); a
                                               length no blob has is copied for this
                                               host's workers as it is hashed (_hash)
    └─ client.submit(_run, payload, blobs, pure=False, key=<fn>-<token>-<n>)
  worker:   each blob a _HostBytes, one per host in a sharexec segment; the task gets a
            copy-on-write mapping of it (writes stay its own), or fresh zeros; slots
            rebuilt from their snapshots; fn(*args, **kwargs); what it changed in each slot, packed
  Dask's callback thread: the call is out of Dask (the next may go) ─▶ results thread:
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
