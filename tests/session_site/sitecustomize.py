"""Run at the start of every Python process of a test session (see
``sharexec_test_members``): records the process, then runs the ``sitecustomize`` this
one hides, if there is one further down ``sys.path``."""

import os
import sys

import sharexec_test_members

sharexec_test_members.install()


def _run_hidden_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module
    spec.loader.exec_module(module)


_run_hidden_sitecustomize()
