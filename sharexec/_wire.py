"""What travels between the parent and its workers, and how it is unpickled: no NumPy.

Both sides import this module, a worker at start-up, so it must stay light: nothing here
imports NumPy, :mod:`sharexec._arrays` or :mod:`sharexec._reduction`. It owns

* the shape of an out-of-band buffer on the wire (:data:`BufferRef`) and
  :func:`loads`, which unpickles a payload over the segments its buffers lie in;
* :class:`Pickler`, the base of every pickler sharexec runs, so that an object pickles
  the same way in each (loky's reducers, then those registered with multiprocessing's
  ``ForkingPickler``, then cloudpickle's and copyreg's);
* plain values (:func:`is_plain`): calls and results made only of them hold no buffer
  and skip the passes;
* functions sent by their cached pickle, or by the segments it was copied into once
  (:func:`load_function`, a cache per worker);
* the globals of functions sent by value: one namespace per module in each worker
  (:func:`share_globals`, :func:`namespace`), as one import of the module would give;
* the reply envelope: a worker's :class:`Reply`, which the parent unpickles as
  :func:`load_result`. That hands each segment of the result to the :class:`Receiver`
  the sending executor registered (:func:`register`): the parent decides, not this
  module, what becomes of a result's segments;
* a task's exception on its way back, :class:`Raised`, rebuilt by :func:`load_raised`
  on its own: whatever fails in transit fails one future, as a :class:`Failure`.

The call envelope, ``_worker.load_call``, is the worker's, since it maps segments into
the worker's kept mappings.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import traceback
import types
import weakref
from collections import ChainMap, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast

import cloudpickle

from . import _session, _tracking
from ._loky import DISPATCH_TABLE, FORKING_REDUCERS, remote_traceback
from .errors import ResultError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ._segments import Mapping

__all__ = [
    "BufferRef",
    "Delivered",
    "Failure",
    "Pickler",
    "Raised",
    "Receiver",
    "Reply",
    "dumps_sharing_globals",
    "is_plain",
    "load_function",
    "load_raised",
    "load_result",
    "loads",
    "namespace",
    "register",
    "set_function_state",
    "share_globals",
]

# An out-of-band buffer: (segment name, segment size, offset, length),
# e.g. ("sharexec-41-Zm9vYmFy", 8000000, 0, 8000000).
BufferRef = tuple[str, int, int, int]


class Sliceable(Protocol):
    """What holds a segment's bytes for :func:`loads`: a buffer that slices without
    copying (a memoryview, a byte array of NumPy's)."""

    def __getitem__(self, index: slice, /) -> object: ...


Bytes = TypeVar("Bytes", bound=Sliceable)


def loads(
    payload: bytes | memoryview,
    buffers: list[BufferRef],
    attach: Callable[[str, int], Bytes],
    mapped: dict[str, Bytes] | None = None,
) -> object:
    """Unpickle ``payload`` over its out-of-band buffers; ``mapped`` gets what holds each
    segment's bytes, by name.

    ``attach(name, size)`` gives what holds a segment's bytes. Each segment is attached
    once.
    """
    mappings: dict[str, Bytes] = {} if mapped is None else mapped
    views: list[object] = []
    for name, size, offset, length in buffers:
        mapping = mappings.get(name)
        if mapping is None:
            mapping = mappings[name] = attach(name, size)
        views.append(mapping[offset : offset + length])
    return pickle.loads(payload, buffers=views)


def _reduce_code(code: types.CodeType) -> tuple[Callable[..., types.CodeType], tuple[object, ...]]:
    """cloudpickle's reduction of a code object, keeping the file it came from.

    cloudpickle 3 names every code object it sends by value ``"<dynamic-code>"`` (so that
    its pickles are the same wherever the function was defined): the traceback of a task
    defined in your script would then show ``File "<dynamic-code>"`` and no source line,
    where the standard library's shows the script's file and line.
    """
    rebuild, args = _reduce_code_by_value(code)
    return _code_from, (rebuild, args, code.co_filename)


def _code_from(
    rebuild: Callable[..., types.CodeType], args: tuple[object, ...], filename: str
) -> types.CodeType:
    """The code object cloudpickle rebuilds, in ``filename`` again."""
    return rebuild(*args).replace(co_filename=filename)


_reduce_code_by_value = cloudpickle.Pickler.dispatch_table[types.CodeType]


class Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle's pickler with the dispatch table of loky's own, and multiprocessing's,
    and the standard pickler's rule for what travels by name.

    By exact type, first match wins: code objects keep their file (:func:`_reduce_code`);
    loky's reducers (bound methods by reference, sockets
    and multiprocessing connections through the process being spawned, partials); then
    whatever was registered with ``multiprocessing.reduction.ForkingPickler.register``,
    as the standard library's executor pickles with it (torch's tensors and storages:
    moved to shared memory, passed by handle; multiprocessing's method descriptors;
    sharexec's shared arrays); then cloudpickle's and copyreg's, which ForkingPickler's
    registrations override there too. ForkingPickler's are looked up live
    (``_loky.FORKING_REDUCERS``): ``import torch`` registers long after this class
    exists. An override in a subclass's ``reducer_override`` wins over all of them, and
    must end in this class's.

    A class or function goes by reference to its module and name whenever the standard
    pickler would find it there, importing the module (``pickle.whichmodule``, then
    ``__import__``), as the standard library's executor sends it: cloudpickle sends by
    reference only what lies in a module imported already (``sys.modules``), and by
    value the rest, a copy that is not the class itself (``np.recarray``, whose
    ``__module__`` is ``numpy.rec``, a module ``import numpy`` leaves out: its copy's
    methods fail). So the module of such an object is imported first
    (:func:`_import_home`), once, and cloudpickle's own rule then finds it. Functions and
    classes of ``__main__`` and of modules registered with
    ``cloudpickle.register_pickle_by_value`` still go by value.
    """

    dispatch_table: ClassVar[ChainMap[type, Callable[..., object]]] = ChainMap(
        {types.CodeType: _reduce_code},
        DISPATCH_TABLE,
        FORKING_REDUCERS,
        cloudpickle.Pickler.dispatch_table,
    )

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, _BY_NAME) and getattr(obj, "__module__", None) not in sys.modules:
            _import_home(obj)
        return _cloudpickle_override(self, obj)  # super()'s, without making a super object


# cloudpickle's own override (functions and classes by value or by name), called for every
# object that is not a builtin container or atom.
_cloudpickle_override = cloudpickle.Pickler.reducer_override


# What the standard pickler pickles by name (a class, whatever its metaclass; a function).
_BY_NAME = (type, types.FunctionType)

# Modules that failed to import when a class or function of theirs was pickled, e.g.
# {"plugins.gone"}: not tried again (a failed import searches the whole path each time).
_unimportable: set[str] = set()


def _import_home(obj: object) -> None:
    """Import the module ``obj`` names as its own (``__module__``), as the standard
    pickler would to pickle it by name; nothing if that fails (it goes by value)."""
    module = getattr(obj, "__module__", None)
    if type(module) is not str or module in _unimportable:
        return
    try:
        importlib.import_module(module)
    except Exception:
        _unimportable.add(module)


# ---------------------------------------------------------------------------------------
# Plain values and cached functions
# ---------------------------------------------------------------------------------------

# Values that hold no buffer, whatever the pickler: plain pickle writes them as either
# pass would (the C pickler saves these types itself, complex by copyreg). Results and
# arguments made only of them skip the passes (``_worker.run``, ``Transport.plain_call``).
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_PLAIN_ITEMS = 16  # a longer tuple or list takes the general road: no scan of its items


def is_plain(value: object) -> bool:
    """Whether ``value`` is an atom, or a short tuple or list of atoms: it holds no buffer."""
    if type(value) in _ATOMS:
        return True
    if (type(value) is tuple or type(value) is list) and len(value) <= _PLAIN_ITEMS:
        return all(type(item) in _ATOMS for item in value)
    return False


# In a worker: functions already unpickled, by their pickle or by the segment it lies in
# (most recent last), e.g. {b"\x80\x05...": <function square>, "sharexec-41-Zm9v": <function
# fitness>}. A segment's name is never given to another while the parent holds it.
_functions: OrderedDict[bytes | str, Callable[..., object]] = OrderedDict()
_FUNCTIONS_KEPT = 256


def load_function(payload: bytes | tuple[BufferRef, ...]) -> Callable[..., object]:
    """Unpickle a function sent by its cached pickle, once per worker (in its module's
    namespace there, if it was sent by value: see :func:`share_globals`).

    ``payload``: the pickle, or where it lies in a segment followed by its out-of-band
    buffers (large globals), each segment mapped copy-on-write at the first call only:
    what the worker changes in them stays its own.
    """
    key = payload if isinstance(payload, bytes) else payload[0][0]
    fn = _functions.get(key)
    if fn is None:
        if isinstance(payload, bytes):
            fn = pickle.loads(payload)
        else:
            (name, size, offset, length), *buffers = payload
            mapped: dict[str, memoryview] = {}
            pickled = mapped[name] = _attach_copy(name, size)
            fn = cast(
                "Callable[..., object]",
                loads(pickled[offset : offset + length], buffers, _attach_copy, mapped),
            )
        _functions[key] = fn
        if len(_functions) > _FUNCTIONS_KEPT:
            _functions.popitem(last=False)
    else:
        _functions.move_to_end(key)
    return fn


def _attach_copy(name: str, size: int) -> memoryview:
    """The bytes of the copy segment ``name``, mapped copy-on-write."""
    return memoryview(_tracking.attach_private(name, size))


# ---------------------------------------------------------------------------------------
# The globals of functions sent by value
# ---------------------------------------------------------------------------------------
#
# cloudpickle rebuilds a function sent by value over a globals dict of its own: one per
# pickle, holding only the globals the function refers to. A worker of the standard
# library's executor instead runs every function of the script in one module (imported
# again, or forked), so what its initializer or an earlier call stores in a global is
# seen by later calls. Here too: a function sent by value whose globals are its module's
# namespace is rebuilt over this process's one namespace of that module (by the module's
# name), and of the globals its pickle carries (their values in the parent when it was
# pickled), only the names that namespace lacks are added. A name the worker has keeps
# the worker's value: state set in the worker persists, and the parent's later changes
# are not seen, as in a worker that imported or forked the script before them. Classes
# need no more: cloudpickle rebuilds a class sent by value once per process (its class
# tracker), so every function and argument sees the same class.

# In a worker: the namespace of each module whose functions arrived by value, by the
# module's name, e.g. {"__main__": {"__name__": "__main__", "CACHE": {"x": 42}, ...}}.
_namespaces: dict[str, dict[str, object]] = {}


class _Namespace:
    """Stands for a module's namespace in a function's pickle: unpickled as the
    receiver's namespace of that module (:func:`namespace`)."""

    __slots__ = ("base", "module")

    def __init__(self, module: str, base: dict[str, object]) -> None:
        self.module = module
        self.base = base  # what cloudpickle gives a new namespace: __name__, __file__...

    def __reduce__(
        self,
    ) -> tuple[
        Callable[[str, dict[str, object]], dict[str, object]], tuple[str, dict[str, object]]
    ]:
        return namespace, (self.module, self.base)


def namespace(module: str, base: dict[str, object]) -> dict[str, object]:
    """This process's namespace of ``module`` for its functions sent by value: made from
    ``base`` (the module's ``__name__``, ``__file__``…) when the first one arrives."""
    found = _namespaces.get(module)
    if found is None:
        found = _namespaces.setdefault(module, dict(base))
    return found


# cloudpickle's state of a function: its attributes, and its slots (``__globals__``,
# ``__defaults__``...), each of its own type.
_FunctionState = tuple[dict[str, object], dict[str, Any]]


def set_function_state(
    fn: types.FunctionType,
    state: tuple[Callable[[types.FunctionType, _FunctionState], None], _FunctionState],
) -> None:
    """Set the state of a function rebuilt in its module's namespace: by cloudpickle's own
    setter (``state`` is that setter and its state), except that the globals the pickle
    carries are only added where the namespace lacks them."""
    setter, (attributes, slots) = state
    carried = slots["__globals__"]
    shared = fn.__globals__
    slots["__globals__"] = {name: v for name, v in carried.items() if name not in shared}
    setter(fn, (attributes, slots))


def share_globals(fn: types.FunctionType, reduced: object) -> object:
    """cloudpickle's reduction of ``fn`` (by value, or ``NotImplemented`` by name), made to
    rebuild ``fn`` over the receiver's one namespace of its module.

    Only a function whose globals are its module's own namespace (a function of the
    script, a notebook, or a module registered to pickle by value); any other (one made
    by ``exec`` over a dict of its own) keeps cloudpickle's namespace per pickle.
    """
    if type(reduced) is not tuple or len(reduced) != 6:
        return reduced  # by name, or a reduction of a shape this does not know
    module = fn.__globals__.get("__name__")
    if not isinstance(module, str):
        return reduced
    if getattr(sys.modules.get(module), "__dict__", None) is not fn.__globals__:
        return reduced
    make, (code, base, *rest), state, items, pairs, setter = reduced
    if type(base) is not dict:
        return reduced
    newargs = (code, _Namespace(module, base), *rest)
    return make, newargs, (setter, state), items, pairs, set_function_state


class _SharingPickler(Pickler):
    """A pickler whose functions sent by value rebuild in their module's namespace."""

    def reducer_override(self, obj: object) -> object:
        reduced = super().reducer_override(obj)
        if type(obj) is types.FunctionType:
            return share_globals(obj, reduced)
        return reduced


def dumps_sharing_globals(obj: object) -> bytes:
    """Pickle ``obj`` so that its functions sent by value are rebuilt in their module's
    namespace (buffers in band): a forked worker's initializer (``_executor``)."""
    return _dumps_in_band(obj, _SharingPickler)


# ---------------------------------------------------------------------------------------
# A result, on its way back to the parent
# ---------------------------------------------------------------------------------------


class Reply:
    """A result on its way back: a small payload and the segments handed to the parent."""

    __slots__ = ("buffers", "keep", "lost", "payload", "released", "token")

    def __init__(
        self,
        payload: bytes,
        buffers: list[BufferRef],
        released: list[str],
        token: int,
        keep: list[Mapping] | None = None,
        lost: bool = False,
    ) -> None:
        self.payload = payload
        self.buffers = buffers
        self.released = released  # the call's segments it released (see Delivered)
        self.token = token  # the receiver of the executor that sent the call
        self.keep = keep  # the mappings the payload refers to, held until it is sent
        self.lost = lost  # the worker could not reach the sweeper: the root checks it

    def __reduce__(self) -> tuple[Callable[..., Delivered | Failure], tuple[object, ...]]:
        args = (self.payload, self.buffers, self.released, self.token)
        return load_result, (*args, True) if self.lost else args


class Receiver(Protocol):
    """What the parent does with the segments of a result (see :func:`register`)."""

    def receive(self, name: str, size: int) -> Buffer:
        """The buffer the result is rebuilt over, from the segment ``name`` (now ours)."""

    def discard(self, name: str) -> None:
        """A segment of a result that failed to rebuild, never received: let it go."""


class _Unclaimed:
    """The receiver of results whose executor is gone: mapped, then unlinked at once."""

    def receive(self, name: str, size: int) -> Buffer:
        return _tracking.adopt_private(name, size)

    def discard(self, name: str) -> None:
        _tracking.forget(name)


# The receivers of this process's executors, by token, e.g. {3: <ResultLoans>}.
_receivers: weakref.WeakValueDictionary[int, Receiver] = weakref.WeakValueDictionary()
_unclaimed = _Unclaimed()


def register(token: int, receiver: Receiver) -> None:
    """Results of the calls sent with ``token`` go to ``receiver`` (held weakly)."""
    _receivers[token] = receiver


def load_result(
    payload: bytes,
    buffers: list[BufferRef],
    released: list[str],
    token: int,
    lost: bool = False,
) -> Delivered | Failure:
    """Rebuild a result in the parent over its segments, which become the parent's.

    Each segment goes to the receiver registered for ``token``. ``lost``: the worker
    could not reach the sweeper, which the root then restarts if it is gone (once the
    result's segments are the parent's, so that the new sweeper hears of them).

    This runs in loky's manager thread, where an exception would break the whole pool
    (as the standard library's does): a :class:`Failure` is returned instead, for the
    executor's future to raise (see ``_executor._Future``), and the pool goes on.
    """
    spilled = [name for name, *_ in buffers if os.path.isabs(name)]
    if spilled:
        _tracking.warn_fallback(_tracking.spilled(spilled[0], "large results come back through"))
    receiver = _receivers.get(token, _unclaimed)
    received: list[str] = []

    def receive(name: str, size: int) -> memoryview:
        buffer = receiver.receive(name, size)
        received.append(name)
        return memoryview(buffer)

    try:
        value = loads(payload, buffers, receive)
    except Exception as exc:
        for name in dict.fromkeys(name for name, *_ in buffers):
            if name not in received:  # whatever was not received yet goes too
                receiver.discard(name)
        return Failure(_rebuild_error("the task's result could not be rebuilt here", exc))
    finally:
        if lost:
            _session.check_sweeper()
    sizes: dict[str, int] = {}
    for name, _, offset, length in buffers:
        sizes[name] = max(sizes.get(name, 0), offset + length)
    return Delivered(value, released, list(sizes.values()))


class Delivered:
    """A rebuilt result, with what its task's release needs: the argument copies its
    worker let go of, and the sizes of the large buffers it came in (what to lend the
    function's next tasks)."""

    __slots__ = ("released", "sizes", "value")

    def __init__(self, value: object, released: list[str], sizes: list[int]) -> None:
        self.value = value
        self.released = frozenset(released)
        self.sizes = sizes


class Failure:
    """An outcome whose future raises ``error`` instead of returning: the task's
    exception (:func:`load_raised`), or the reason its result could not be rebuilt."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _rebuild_error(what: str, cause: Exception) -> ResultError:
    """A :class:`~sharexec.errors.ResultError` saying ``what``, and why: ``cause``."""
    error = ResultError(f"{what}: {cause!r}")
    error.__cause__ = cause
    return error


# ---------------------------------------------------------------------------------------
# A task's exception, on its way back to the parent
# ---------------------------------------------------------------------------------------


class Raised:
    """A task's exception on its way back, pickled on its own so that the parent
    rebuilds it apart from anything else (:func:`load_raised`).

    The standard library's worker sends the exception itself (loky's too), in the
    message that carries the call's outcome: one that cannot be pickled kills the
    worker or fails the whole message (every call of a batch), one that pickles but
    cannot be rebuilt in the parent (an ``__init__`` whose arguments are not the
    exception's ``args``, a class the parent cannot import) breaks the pool. Here each
    exception is a payload of its own, with its type's name and the worker's traceback
    as text: one that cannot be pickled is replaced by a ``RuntimeError`` that names it,
    and one that cannot be rebuilt fails its own future with a
    :class:`~sharexec.errors.ResultError`. A task's exception is sent as its result
    (see ``_worker.run``): the future raises it (:class:`Failure`).
    """

    __slots__ = ("kind", "payload", "traceback")

    def __init__(self, exc: BaseException) -> None:
        self.kind = _type_name(type(exc))
        self.traceback = "".join(traceback.format_exception(exc))
        try:
            self.payload = _dumps_in_band(exc)
        except Exception as why:
            said = "".join(traceback.format_exception_only(exc)).strip()
            stand_in = RuntimeError(
                f"the task raised {said}, which cannot be sent back to the parent: {why!r}"
            )
            self.payload = pickle.dumps(stand_in, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce__(self) -> tuple[Callable[[bytes, str, str], Failure], tuple[bytes, str, str]]:
        return load_raised, (self.payload, self.kind, self.traceback)


def load_raised(payload: bytes, kind: str, text: str) -> Failure:
    """Rebuild a task's exception in the parent (:class:`Raised`): the future raises it,
    with the worker's traceback (``text``) as its ``__cause__``, as loky's do.

    Runs in loky's manager thread, as :func:`load_result`: an exception that cannot be
    rebuilt fails its own future only, with a :class:`~sharexec.errors.ResultError` that
    names its type (``kind``); the worker's traceback is then the ``__cause__`` of the
    rebuild's error, which is the ``ResultError``'s.
    """
    remote = remote_traceback(text)
    try:
        error = pickle.loads(payload)
        if not isinstance(error, BaseException):
            raise TypeError(f"it was rebuilt as {_type_name(type(error))}, not an exception")
    except Exception as why:
        why.__cause__ = remote
        return Failure(
            _rebuild_error(f"the task raised {kind}, which could not be rebuilt here", why)
        )
    error.__cause__ = remote
    return Failure(error)


def _type_name(kind: type) -> str:
    """``kind``'s name as a traceback shows it: its module too, unless builtins."""
    module = getattr(kind, "__module__", None)
    name = getattr(kind, "__qualname__", None) or repr(kind)
    return name if module in (None, "builtins", "__main__") else f"{module}.{name}"


def _dumps_in_band(obj: object, pickler_class: type[Pickler] | None = None) -> bytes:
    """``obj`` pickled by ``pickler_class`` (:class:`Pickler` by default), every buffer
    in band."""
    out = io.BytesIO()
    pickler = (pickler_class or Pickler)(out, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        pickler.dump(obj)
    finally:
        pickler.clear_memo()  # it holds obj, in a cycle only the GC would break
    return out.getvalue()
