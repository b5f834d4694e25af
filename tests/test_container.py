"""A default container: a 64 MB /dev/shm, perhaps a read-only root file system.

Large arguments and shared arrays that do not fit in /dev/shm live in anonymous shared
memory: the calls run as on the host (one copy, pooled, no fallback, no warning), and
nothing is left in /dev/shm or held by any process afterwards. Each scenario runs as its
own program in a private mount namespace (``container.py``); the crashes (a SIGKILL of
the parent or of a worker) are in ``test_faults.py``.
"""

from __future__ import annotations

import pytest
from container import needs_root, printed, run

from sharexec import _segments

pytestmark = [
    needs_root,
    pytest.mark.timeout(150),
    pytest.mark.skipif(
        not _segments.anonymous_supported(), reason="no memfd_create, or /proc is not mounted"
    ),
]

# Python's forkserver (and so sharexec's default, forks of a warm server of that kind)
# binds its socket in a temporary folder: with none writable it cannot start.
NEEDS_A_TEMP_FOLDER = (None, "forkserver")


def check_repeated(out) -> None:
    assert out.returncode == 0, out.stdout + out.stderr
    assert printed(out.stdout, "exact") is True
    assert printed(out.stdout, "kind") == "anonymous"  # 80 MB: more than /dev/shm holds
    stats = printed(out.stdout, "stats")
    # One copy of the argument, pooled and served again: as on the host.
    assert stats == {
        "fallbacks": 0,
        "bytes_copied": printed(out.stdout, "nbytes"),
        "segments_pooled": 1,
    }, stats
    assert printed(out.stdout, "warnings") == []
    assert printed(out.stdout, "left") == []
    assert printed(out.stdout, "held") == []  # every descriptor closed as its segment went


@pytest.mark.transport  # where the bytes go: the same whatever started the worker
def test_small_dev_shm_runs_as_on_the_host(start_method):
    check_repeated(run(start_method, "repeated"))


@pytest.mark.parametrize("root", ["ro+tmp", "ro"])
def test_read_only_root(start_method, root):
    """Kubernetes' readOnlyRootFilesystem, with a writable /tmp or none: the same."""
    if root == "ro" and start_method in NEEDS_A_TEMP_FOLDER:
        pytest.skip("Python's forkserver needs a writable temporary folder for its socket")
    check_repeated(run(start_method, "repeated", root=root))
