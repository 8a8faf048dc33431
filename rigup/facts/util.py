"""Shared plumbing of rigup's facts: tools that may be missing are guarded in the command itself (the
fact then returns None instead of making pyinfra warn), and parse errors become FactProcessError."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from pyinfra.api import FactProcessError
from pyinfra.api.command import QuoteString

from rigup.parsers.common import ParseError, _Jsonable

ABSENT = "@rigup-absent"  # printed instead of output when the tool is not installed
T = TypeVar("T")
_SPLIT = "@rigup-section"


# How a fact runs one of rigup's rig-side scripts (rigfetch.py, rigup-servingctl): through Python's
# import machinery, which keeps the script's bytecode in a __pycache__ beside it. Run by path, Python
# compiles the script again on every call: 10-20 ms of each converged re-run's reads, for each script.
# The script's main(argv) gets the arguments; its `if __name__ == "__main__"` block does not run.
_RUN_CACHED = ("import sys, importlib.machinery as m, importlib.util as u; "
               'l = m.SourceFileLoader("rigup_rig_script", sys.argv[1]); '
               "mod = sys.modules[l.name] = u.module_from_spec(u.spec_from_loader(l.name, l)); l.exec_module(mod); "
               "sys.exit(mod.main(sys.argv[2:]))")


def python_script(script: Any, *args: Any) -> list[Any]:
    """The words of a command that runs the rig-side Python `script` (a path, quoted) with `args`."""
    return ["python3", "-c", QuoteString(_RUN_CACHED), script, *args]


def _guarded(tool: str, command: str) -> str:
    """Run `command` if `tool` is on PATH, else print ABSENT; never fails."""
    return f"if command -v {tool} >/dev/null 2>&1; then {command}; else echo '{ABSENT}'; fi"


def _parse(output: list[str], parser: Callable[[list[str]], T]) -> T:
    try:
        return parser(output)
    except ParseError as exc:
        raise FactProcessError(str(exc)) from exc


def _absent(output: list[str]) -> bool:
    return [line.strip() for line in output if line.strip()] == [ABSENT]


def summarize(values: Iterable[Any]) -> list[Any]:
    """Facts as JSON-able values (for `rigup doctor --json`)."""
    out: list[Any] = []
    for value in values:
        out.append(value.to_json() if isinstance(value, _Jsonable) else value)
    return out


def _sections(output: list[str]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for line in output:
        if line.strip() == _SPLIT:
            parts.append([])
        else:
            parts[-1].append(line)
    return parts
