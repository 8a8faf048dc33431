"""What every parser shares: ParseError and line splitting."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any


class ParseError(ValueError):
    """Output that does not have the expected shape."""


class JsonDataclass:
    """Base of rigup's dataclasses of parsed output: their to_json() (dataclasses.asdict) lets pyinfra's CLI
    (`pyinfra INVENTORY fact rigup.facts.X`) and rigup.facts.util.summarize print them."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


def split_lines(output: str | Iterable[str]) -> list[str]:
    """A tool's output (one string, or lines as pyinfra gives them) as lines without their newlines."""
    if isinstance(output, str):
        return output.splitlines()
    return [line.rstrip("\n") for line in output]

