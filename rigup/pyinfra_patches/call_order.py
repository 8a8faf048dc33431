"""pyinfra's per-operation bookkeeping without the source reads: same order, less control-machine CPU.

pyinfra places each operation by the line numbers of its call stack
(`pyinfra.api.util.get_operation_order_from_stack`, run for every operation on every host). It gets
them with `inspect.stack()` and `inspect.getframeinfo()`, whose default reads every frame's source
line and looks its module up by scanning `sys.modules`; the line numbers and file names are all it
uses. It also rebuilds the list of its global arguments from their type hints
(`all_global_arguments`) for every fact and operation call. On rigup's deploy (50 operations a host)
those two were the largest items of the control machine's CPU after ssh itself.

`lean_call_order()` makes pyinfra ask for frames without source context (context=0: the same frames,
file names and line numbers, so the same order) and computes the argument list once. It changes
nothing else, and does nothing where pyinfra's internals are not as expected (another pyinfra version
keeps its own behaviour).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from pyinfra.api import arguments as pyinfra_arguments
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api import util as pyinfra_util

_INSTALLED: dict[str, Any] = {}


def _frames_without_source() -> list[inspect.FrameInfo]:
    return inspect.stack(context=0)[1:]  # without this function's own frame, as inspect.stack() is called


def _frameinfo_without_source(frame: Any, context: int = 0) -> inspect.Traceback:
    return inspect.getframeinfo(frame, context=0)


@functools.cache
def _global_arguments() -> tuple[tuple[str, type], ...]:
    return tuple(_INSTALLED["all_global_arguments"]())


def _all_global_arguments() -> list[tuple[str, type]]:
    return list(_global_arguments())  # a fresh list: a caller may change what it gets


def lean_call_order() -> bool:
    """Install the lean stack reads and the argument list cache (idempotent); False where this pyinfra
    does not have the functions they replace."""
    if _INSTALLED:
        return True
    if not (getattr(pyinfra_util, "stack", None) is inspect.stack
            and getattr(pyinfra_util, "getframeinfo", None) is inspect.getframeinfo
            and callable(getattr(pyinfra_arguments, "all_global_arguments", None))
            and getattr(pyinfra_facts, "all_global_arguments", None) is pyinfra_arguments.all_global_arguments):
        return False
    _INSTALLED["all_global_arguments"] = pyinfra_arguments.all_global_arguments
    pyinfra_util.stack = _frames_without_source  # type: ignore[assignment]
    pyinfra_util.getframeinfo = _frameinfo_without_source  # type: ignore[assignment]
    pyinfra_arguments.all_global_arguments = _all_global_arguments  # type: ignore[assignment]
    pyinfra_facts.all_global_arguments = _all_global_arguments  # type: ignore[attr-defined]
    return True
