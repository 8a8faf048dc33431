"""rigup.pyinfra_patches.call_order: pyinfra orders and names operations exactly as before, from frames read
without their source."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pyinfra
import pytest
from pyinfra.api import arguments as pyinfra_arguments
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api import util as pyinfra_util

from rigup.pyinfra_patches import call_order


def _nested(depth: int, probe):
    if depth == 0:
        return probe()
    return _nested(depth - 1, probe)


def _what_pyinfra_sees(state) -> tuple[list[int], str, tuple[str, int, str]]:
    def probe():
        info = pyinfra_util.get_caller_frameinfo()
        return (pyinfra_util.get_operation_order_from_stack(state), pyinfra_util.get_call_location(),
                (info.filename, info.lineno, info.function))

    return _nested(3, probe)


@pytest.fixture
def pyinfra_as_shipped(monkeypatch: pytest.MonkeyPatch):
    """pyinfra's own functions, whether or not an earlier test installed the lean ones."""
    def restore():
        monkeypatch.setattr(pyinfra_util, "stack", inspect.stack)
        monkeypatch.setattr(pyinfra_util, "getframeinfo", inspect.getframeinfo)
        original = call_order._INSTALLED.get("all_global_arguments", pyinfra_arguments.all_global_arguments)
        monkeypatch.setattr(pyinfra_arguments, "all_global_arguments", original)
        monkeypatch.setattr(pyinfra_facts, "all_global_arguments", original)
        monkeypatch.setattr(call_order, "_INSTALLED", {})
        call_order._global_arguments.cache_clear()

    restore()
    yield restore
    call_order._global_arguments.cache_clear()


def test_operation_order_and_call_location_are_unchanged(pyinfra_as_shipped, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pyinfra, "is_cli", True)
    state = SimpleNamespace(current_deploy_filename=__file__, current_op_file_number=7)
    seen = []
    for lean in (False, True):  # one call line for both, so their stacks are the same
        if lean:
            assert call_order.lean_call_order() is True
            assert pyinfra_util.stack is not inspect.stack  # installed
        seen.append(_what_pyinfra_sees(state))
    before, after = seen
    assert after == before
    order, location, (filename, _, function) = after
    assert order[0] == 7 and len(order) > 3  # the op file number, then this file's call lines
    assert filename == __file__ and function == "_nested"  # probe's caller, as pyinfra asks
    assert location.startswith("line ") and location.endswith("test_call_order.py")


def test_global_arguments_are_listed_once_and_handed_out_fresh(pyinfra_as_shipped) -> None:
    shipped = pyinfra_arguments.all_global_arguments()
    calls = []
    original = pyinfra_arguments.all_global_arguments

    def counted():
        calls.append(1)
        return original()

    pyinfra_arguments.all_global_arguments = counted
    pyinfra_facts.all_global_arguments = counted
    assert call_order.lean_call_order() is True
    first = pyinfra_arguments.all_global_arguments()
    first.clear()  # a caller changing its copy changes nobody else's
    assert pyinfra_arguments.all_global_arguments() == shipped == pyinfra_facts.all_global_arguments()
    assert len(calls) == 1
    assert ("_sudo", bool) in shipped


def test_another_pyinfra_keeps_its_own_behaviour(pyinfra_as_shipped, monkeypatch: pytest.MonkeyPatch) -> None:
    def own_stack():
        return inspect.stack()

    monkeypatch.setattr(pyinfra_util, "stack", own_stack)
    assert call_order.lean_call_order() is False
    assert pyinfra_util.stack is own_stack
    assert pyinfra_util.getframeinfo is inspect.getframeinfo
