"""The door to loky's internals (sharexec._loky): its check at import, and that it is the
only door."""

from __future__ import annotations

import ast
import dis
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import loky
import pytest

from sharexec import _loky

pytestmark = pytest.mark.timeout(120)

DOOR = Path(_loky.__file__).parent  # sharexec/_loky/
PACKAGE = DOOR.parent  # sharexec/


def test_the_installed_loky_has_every_internal_sharexec_uses():
    assert _loky.check._problems() == []


# Each case changes loky in a fresh interpreter, before sharexec._loky is imported, as a
# loky version that differs might; the error must name what differs.
LOKY_CHANGES = {
    "a module attribute is gone": (
        "del process_executor._RecycledWorkerPid",
        "loky.process_executor._RecycledWorkerPid is missing",
    ),
    "an instance attribute is no longer set": (
        # loky's own constructor, with _flags renamed
        """
        import inspect, textwrap
        init = process_executor.ProcessPoolExecutor.__init__
        source = textwrap.dedent(inspect.getsource(init))
        namespace = dict(vars(process_executor))
        exec(source.replace("self._flags", "self._state"), namespace)
        process_executor.ProcessPoolExecutor.__init__ = namespace["__init__"]
        """,
        "loky.process_executor.ProcessPoolExecutor: no method sets ._flags any more",
    ),
    "a signature changed": (
        """
        class _WorkItem:
            def __init__(self, future, fn, args, kwargs, priority):
                self.future = future
        process_executor._WorkItem = _WorkItem
        """,
        "loky.process_executor._WorkItem.__init__ takes "
        "(self, future, fn, args, kwargs, priority), not (self, future, fn, args, kwargs)",
    ),
    "an overridden hook is no longer called": (
        """
        def _ensure_executor_running(self):
            self._adjust_process_count()
        process_executor.ProcessPoolExecutor._ensure_executor_running = (
            _ensure_executor_running
        )
        """,
        "_ensure_executor_running no longer uses _start_executor_manager_thread",
    ),
}


@pytest.mark.parametrize("change", list(LOKY_CHANGES))
def test_a_loky_that_differs_fails_the_import_naming_the_versions(change):
    edit, expected = LOKY_CHANGES[change]
    code = "\n".join(
        ["from loky import process_executor", textwrap.dedent(edit), "import sharexec._loky"]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: sharexec supports loky {_loky.SUPPORTED_LOKY}, ")
    assert f"the installed loky {loky.__version__} differs" in last
    assert expected in last
    assert last.endswith(f"pip install 'loky{_loky.SUPPORTED_LOKY}'")


def test_forkingpicklers_registrations_are_read_live():
    """What registers with ForkingPickler after sharexec was imported (torch does, when
    it is imported) is seen at once; nothing registers through the door."""
    from multiprocessing.reduction import ForkingPickler

    class Late:
        pass

    def reduce(obj):
        return Late, ()

    assert Late not in _loky.FORKING_REDUCERS
    ForkingPickler.register(Late, reduce)
    try:
        assert _loky.FORKING_REDUCERS[Late] is reduce
        assert Late in list(_loky.FORKING_REDUCERS)
        with pytest.raises(TypeError):
            _loky.FORKING_REDUCERS[Late] = reduce
    finally:
        del ForkingPickler._extra_reducers[Late]
    assert Late not in _loky.FORKING_REDUCERS


def test_the_supported_versions_are_the_pin():
    with open(PACKAGE.parent / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert f"loky{_loky.SUPPORTED_LOKY}" in dependencies


def test_the_bytecode_scan_finds_what_dis_finds():
    # Every class whose instance attributes the check looks for, and this test's own
    # code (an attribute set through EXTENDED_ARG: more than 256 names).
    many = "\n".join(f"    self.a{i} = {i}" for i in range(300))
    namespace: dict[str, object] = {}
    exec(f"def f(self):\n{many}\n    self.last = None", namespace)
    codes = [namespace["f"].__code__]  # type: ignore[attr-defined]
    for cls in (
        loky.ProcessPoolExecutor,
        loky.Future,
        loky.process_executor._SafeQueue,
        loky.process_executor._ExecutorManagerThread,
        loky.process_executor._ExecutorFlags,
        loky.process_executor._WorkItem,
        loky.process_executor._ResultItem,
        loky.backend.queues.SimpleQueue,
    ):
        codes.extend(_loky.check._codes(cls))
    for code in codes:
        expected = {i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}
        assert _loky.check._stored_attributes(code) == expected, code
    assert "last" in _loky.check._stored_attributes(codes[0])


# The roots whose private names only the door may use.
_GUARDED = ("loky", "multiprocessing", "concurrent")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _internals_named(source: str) -> list[str]:
    """Private names of loky, multiprocessing or concurrent.futures that ``source`` names:
    imported, or read as an attribute of what it imported from them."""
    found = []
    bound = set()  # names bound to what was imported from the guarded packages
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _GUARDED:
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append(alias.name)
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] in _GUARDED
        ):
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                if any(_private(part) for part in path.split(".")):
                    found.append(path)
                bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(".".join([root.id, *reversed(chain)]))
    return found


def test_the_scan_for_internals_sees_each_way_of_naming_them():
    source = textwrap.dedent(
        """
        import loky
        import multiprocessing.queues as mpq
        from loky._base import Future
        from loky.process_executor import _WorkItem, ProcessPoolExecutor
        from loky.backend import reduction as red
        loky.process_executor._global_shutdown
        mpq._sentinel
        red._dispatch_table.get
        loky.__version__, red.register, ProcessPoolExecutor._flags
        """
    )
    assert sorted(_internals_named(source)) == [
        "ProcessPoolExecutor._flags",
        "loky._base.Future",
        "loky.process_executor._WorkItem",
        "loky.process_executor._global_shutdown",
        "mpq._sentinel",
        "red._dispatch_table",
    ]


def test_no_module_but_the_door_names_internals_of_loky_or_multiprocessing():
    """What a static look can see: imports of private names, and private attributes of
    what was imported from loky, multiprocessing or concurrent. Attributes that loky sets
    on instances (``self._flags``) are the door's too, by review."""
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if DOOR not in p.parents]
    assert len(outside) > 15  # sharexec's modules, the door's excluded
    named = {str(p.relative_to(PACKAGE)): _internals_named(p.read_text()) for p in outside}
    assert {name: found for name, found in named.items() if found} == {}
    # ...and the door does name them (the scan would see it).
    assert _internals_named((DOOR / "executor.py").read_text())


def test_the_door_imports_no_numpy():
    code = "import sys, sharexec._loky; print('numpy' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False"], out.stderr
