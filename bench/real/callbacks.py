"""Threads submitting with callbacks: a crawler-like job queue.

Four threads of the parent each submit their share of jobs (key derivations with
``hashlib.pbkdf2_hmac``, a few ms each) and attach ``add_done_callback`` to every
future; the callbacks, run by the executor's thread, collect the digests under a lock
and set an event once the last one is in. The main thread only waits on that event.
"""

import hashlib
import threading

THREADS = 4


def derive(job):
    salt = f"salt-{job}".encode()
    return job, hashlib.pbkdf2_hmac("sha256", b"password", salt, 20_000).hex()[:16]


def main(Executor, scale=1.0):
    jobs = max(THREADS, round(400 * scale))
    digests = {}
    lock = threading.Lock()
    done = threading.Event()

    def collect(future):
        job, digest = future.result()
        with lock:
            digests[job] = digest
            if len(digests) == jobs:
                done.set()

    with Executor(2) as ex:

        def submitter(first):
            for job in range(first, jobs, THREADS):
                ex.submit(derive, job).add_done_callback(collect)

        threads = [threading.Thread(target=submitter, args=(t,)) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not done.wait(timeout=600):
            raise TimeoutError(f"{len(digests)} of {jobs} callbacks ran")
    combined = hashlib.sha256("".join(digests[j] for j in range(jobs)).encode())
    return {"jobs": len(digests), "digest": combined.hexdigest()[:16]}


if __name__ == "__main__":
    from harness import run

    run(main)
