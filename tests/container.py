"""Running a scenario as a container would: a private mount namespace whose /dev/shm is a
64 MB tmpfs (Docker's and Kubernetes' default), optionally under a read-only root file
system, with or without a writable /tmp (Kubernetes' ``readOnlyRootFilesystem``).

Needs root (CI runs as root) and util-linux's ``unshare``; :data:`needs_root` skips a
test, with the reason, where either is missing. The namespace and its mounts vanish with
the scenario's last process: whatever a scenario must judge about its own /dev/shm, it
prints before it exits (:func:`printed`).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import method_id

SCENARIOS = Path(__file__).parent / "container_scenarios.py"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounting a small tmpfs in a private mount namespace needs root and unshare",
)


# What each root file system looks like, as the shell commands that make it (run inside
# the namespace, after the 64 MB /dev/shm is mounted): "rw" as it is; "ro" read-only,
# with every mount a scenario could write a file to; "ro+tmp" the same but for /tmp,
# bound onto itself first (what it holds stays: CI's clone, its virtual environment).
def _read_only(but: str) -> str:
    return (
        "mount --bind / / && mount -o remount,bind,ro / / && "
        "for m in $(awk '$2 ~ \"^/(tmp|work|root|home|var|srv|opt)\" {print $2}' "
        f'/proc/mounts); do [ "$m" = "{but}" ] || '
        'mount -o remount,bind,ro "$m" 2>/dev/null || true; done && '
    )


ROOTS = {
    "rw": "",
    "ro": _read_only(""),
    "ro+tmp": "(mountpoint -q /tmp || mount --bind /tmp /tmp) && " + _read_only("/tmp"),
}


def run(
    method: str | None,
    *args: str,
    root: str = "rw",
    size: str = "64m",
    timeout: float = 110,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a scenario of ``container_scenarios.py`` (``args``: its name and argument)
    under the start method in a private mount namespace with a /dev/shm of ``size`` and
    the root file system ``root``."""
    setup = ROOTS[root]
    return in_namespace(SCENARIOS, method, *args, setup=setup, size=size, timeout=timeout, env=env)


def in_namespace(
    script: Path,
    method: str | None,
    *args: str,
    setup: str = "",
    size: str = "64m",
    timeout: float = 110,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (its arguments: the start method's id, then ``args``) in a private
    mount namespace with a /dev/shm of ``size``, after the shell commands ``setup`` (each
    ending in ``&&``)."""
    mount = f"mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm && {setup}"
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{mount} exec "$0" "$@"',
            sys.executable,
            str(script),
            method_id(method),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def printed(stdout: str, key: str) -> object:
    """The value a scenario printed last as ``<key> <Python literal>``."""
    lines = [line for line in stdout.splitlines() if line.startswith(key + " ")]
    assert lines, f"the scenario printed no {key!r}: {stdout}"
    return ast.literal_eval(lines[-1][len(key) + 1 :])
