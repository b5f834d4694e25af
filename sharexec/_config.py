"""Options of sharexec and their ``SHAREXEC_*`` environment variables, parsed in one place.

An option given to an executor wins over its environment variable, which wins over the
default. Unknown options are errors that name the option. An unknown ``SHAREXEC_*``
variable is ignored by executors (the environment is the user's), but the command line
names it, with the known variable closest to it (:func:`unknown_variables`).
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import ConfigError

# Below this size a buffer is pickled in-band: a segment costs a few system calls and
# fresh page faults, which beat the pipe only from about this size up. Measured here
# (2 workers, spawn, 20 distinct arrays per run, median of 5, µs per task):
#   bytes      stdlib   shared   pickled by sharexec
#   131072       320      551      585
#   262144       605      513      728
#   1048576     2473     1072     2095
DEFAULT_MIN_SHARE_BYTES = 256 << 10

# Warm memory, held on both sides of a transfer under the same bounds, so that neither
# side keeps what the other has let go of (see docs/design.md, "Warm memory"):
# - the parent's pool of warm segments holds at most WARM_BYTES (and a quarter of
#   shared memory) in at most WARM_SEGMENTS segments (each is a name in the folder and
#   a mapping in the parent), and drops a segment once it has been unused for
#   WARM_IDLE_SECONDS (at most _warm.TRIM_SLACK later);
# - a worker keeps at most WARM_BYTES and KEPT_MAPPINGS mappings of the segments its
#   tasks received, and drops them all after WARM_IDLE_SECONDS without a task. A copy
#   stays in the parent's pool at least as long as a worker may keep its mapping.
WARM_BYTES = 1 << 30
WARM_IDLE_SECONDS = 10.0
KEPT_MAPPINGS = 128  # W2's 64 chunks fit; each is one VMA and one name to look up per call
WARM_SEGMENTS = KEPT_MAPPINGS  # as many as a worker keeps mapped: neither side keeps more


# The roads of private torch tensors (Options.tensor_sharing), the default first.
TENSOR_SHARING = ("sharexec", "torch")


@dataclass(frozen=True)
class Options:
    """The sharexec options of one executor.

    Attributes
    ----------
    min_share_bytes
        Buffers of at least this many bytes travel through shared memory; smaller ones
        are pickled. Environment variable: ``SHAREXEC_MIN_SHARE_BYTES``.
    temp_folder
        Where file-backed segments go when shared memory is full or missing and
        anonymous shared memory cannot be had (a private subfolder is made in it);
        default: the system's temporary folder (:meth:`spill_folder`).
        Environment variable: ``SHAREXEC_TEMP_FOLDER``.
    batching
        Whether queued calls of functions measured short may travel to a worker several
        in one message (see ``_batching``). Environment variable: ``SHAREXEC_BATCHING``
        (``0`` or ``1``).
    tensor_sharing
        How private PyTorch CPU tensors are shared with the tasks they are sent to:
        ``"sharexec"`` (the default) moves them into sharexec segments, ``"torch"``
        leaves them to torch's own reducers (torch's shared memory, a file descriptor
        per storage), as the standard library's executor does. Either way the sender's
        tensor ends up shared. Environment variable: ``SHAREXEC_TENSOR_SHARING``.
    """

    min_share_bytes: int = DEFAULT_MIN_SHARE_BYTES
    temp_folder: str | None = None
    batching: bool = True
    tensor_sharing: str = "sharexec"

    def spill_folder(self) -> str:
        """Where file-backed segments go: ``temp_folder``, else the system's temporary
        folder; where the system has none that is writable (a read-only root file
        system), the first it would look at, in which creating a segment fails and the
        buffer is pickled instead."""
        if self.temp_folder:
            return self.temp_folder
        try:
            return tempfile.gettempdir()
        except OSError:  # no writable candidate: tempfile looked at each (and will again)
            return os.environ.get("TMPDIR") or "/tmp"

    @classmethod
    def resolve(
        cls, given: Mapping[str, object], environ: Mapping[str, str] | None = None
    ) -> Options:
        """Merge keyword options, environment variables and defaults, validating each."""
        environ = os.environ if environ is None else environ
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(
                f"unknown sharexec option(s): {', '.join(map(repr, unknown))}; "
                f"known options are {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        for name in sorted(known):
            env_name = "SHAREXEC_" + name.upper()
            if name in given:
                values[name] = _parse(name, given[name], f"option {name!r}")
            elif env_name in environ:
                values[name] = _parse(name, environ[env_name], f"environment variable {env_name}")
        return cls(**values)


def _parse(name: str, value: Any, where: str) -> Any:
    if name == "min_share_bytes":
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
        if isinstance(value, (bool, float)) or number < 1:
            raise ConfigError(f"{where} must be an integer >= 1, got {value!r}")
        return number
    if name == "temp_folder":
        if value is None:
            return None
        folder = os.fspath(value)
        if not os.path.isdir(folder):
            raise ConfigError(f"{where} must be an existing folder, got {value!r}")
        return os.path.abspath(folder)
    if name == "batching":
        if isinstance(value, bool):
            return value
        words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
        if isinstance(value, str) and value.strip().lower() in words:
            return words[value.strip().lower()]
        raise ConfigError(f"{where} must be True or False (or 1 or 0), got {value!r}")
    if name == "tensor_sharing":
        if value not in TENSOR_SHARING:
            raise ConfigError(f"{where} must be one of {', '.join(TENSOR_SHARING)}, got {value!r}")
        return value
    raise AssertionError(name)  # pragma: no cover - every field has a parser


PREFIX = "SHAREXEC_"

# Variables read by the project's own tools rather than by the library, so not unknown:
# {name: what reads it}.
TOOL_VARIABLES = {
    "SHAREXEC_FAULTS_REPORT": "the fault report of the test suite (nox -s faults)",
    "SHAREXEC_DOCS_INTERSPHINX": "the documentation build (nox -s docs)",
}


def option_variables() -> dict[str, str]:
    """The environment variable of each option, e.g.
    ``{"SHAREXEC_MIN_SHARE_BYTES": "min_share_bytes", ...}``."""
    return {PREFIX + f.name.upper(): f.name for f in fields(Options)}


def check_variables(environ: Mapping[str, str] | None = None) -> list[ConfigError]:
    """Every ``SHAREXEC_*`` option variable of ``environ`` whose value is invalid, as the
    error an executor would raise for it (one per variable, not only the first)."""
    environ = os.environ if environ is None else environ
    errors = []
    for name in sorted(option_variables()):
        if name in environ:
            try:
                Options.resolve({}, {name: environ[name]})
            except ConfigError as error:
                errors.append(error)
    return errors


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """The ``SHAREXEC_*`` variables of ``environ`` that nothing reads, each with the known
    variable closest to it (None if none is close), e.g.
    ``[("SHAREXEC_MIN_SHARE_BYTE", "SHAREXEC_MIN_SHARE_BYTES")]``."""
    environ = os.environ if environ is None else environ
    known = sorted([*option_variables(), *TOOL_VARIABLES])
    # Compared without the prefix every name shares, which would make any two look alike.
    suffixes = {name.removeprefix(PREFIX): name for name in known}
    found = []
    for name in sorted(environ):
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name.removeprefix(PREFIX), suffixes, n=1)
            found.append((name, suffixes[close[0]] if close else None))
    return found


def describe_unknown(name: str, closest: str | None) -> str:
    """One sentence about an unknown variable, for the command line."""
    hint = f"; did you mean {closest}?" if closest else ""
    known = ", ".join(sorted(option_variables()))
    return f"{name} is not a sharexec variable and is ignored (known: {known}){hint}"
