"""Shared plumbing of rigup's facts: tools that may be missing are guarded in the command itself (the
fact then returns None instead of making pyinfra warn), and parse errors become FactProcessError."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from pyinfra.api import FactProcessError
from pyinfra.api.command import QuoteString

from rigup.parsers.common import JsonDataclass, ParseError

ABSENT = "@rigup-absent"  # printed instead of output when the tool is not installed
T = TypeVar("T")
SECTION_MARKER = "@rigup-section"


# How a fact runs one of rigup's rig-side scripts (rigup-servingctl; rigfetch.py, a zipapp, keeps its own
# bytecode): through Python's import machinery, which keeps the script's bytecode in a __pycache__ beside
# it. Run by path, Python compiles the script again on every call: 10-20 ms of each converged re-run's
# reads, for each script.
# The script's main(argv) gets the arguments; its `if __name__ == "__main__"` block does not run.
_RUN_CACHED = ("import sys, importlib.machinery as m, importlib.util as u; "
               'l = m.SourceFileLoader("rigup_rig_script", sys.argv[1]); '
               "mod = sys.modules[l.name] = u.module_from_spec(u.spec_from_loader(l.name, l)); l.exec_module(mod); "
               "sys.exit(mod.main(sys.argv[2:]))")


def python_script(script: Any, *args: Any) -> list[Any]:
    """The words of a command that runs the rig-side Python `script` (a path, quoted) with `args`."""
    return ["python3", "-c", QuoteString(_RUN_CACHED), script, *args]


def run_if_installed(tool: str, command: str) -> str:
    """A shell command that runs `command` if `tool` is on PATH, else prints ABSENT; it never fails."""
    return f"if command -v {tool} >/dev/null 2>&1; then {command}; else echo '{ABSENT}'; fi"


def parse_fact_output(output: list[str], parser: Callable[[list[str]], T]) -> T:
    """`parser(output)`, its ParseError raised as pyinfra's FactProcessError."""
    try:
        return parser(output)
    except ParseError as exc:
        raise FactProcessError(str(exc)) from exc


def tool_absent(output: list[str]) -> bool:
    """Whether a run_if_installed command printed only ABSENT: the tool is not installed."""
    return [line.strip() for line in output if line.strip()] == [ABSENT]


def summarize(values: Iterable[Any]) -> list[Any]:
    """Facts as JSON-able values (for `rigup doctor --json`)."""
    out: list[Any] = []
    for value in values:
        out.append(value.to_json() if isinstance(value, JsonDataclass) else value)
    return out


def split_sections(output: list[str]) -> list[list[str]]:
    """The output of a command that echoes SECTION_MARKER between its parts, one list of lines a part."""
    parts: list[list[str]] = [[]]
    for line in output:
        if line.strip() == SECTION_MARKER:
            parts.append([])
        else:
            parts[-1].append(line)
    return parts
