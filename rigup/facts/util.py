"""Shared plumbing of rigup's facts: tools that may be missing are guarded in the command itself (the
fact then returns None instead of making pyinfra warn), and parse errors become FactProcessError."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from pyinfra.api import FactProcessError

from rigup.parsers.common import ParseError, _Jsonable

ABSENT = "@rigup-absent"  # printed instead of output when the tool is not installed
T = TypeVar("T")
_SPLIT = "@rigup-section"


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
