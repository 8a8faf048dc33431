"""What every parser shares: ParseError and line splitting."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any


class ParseError(ValueError):
    """Output that does not have the expected shape."""


class _Jsonable:
    """Lets pyinfra's CLI (`pyinfra INVENTORY fact rigup.facts.X`) print our dataclasses."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]


def _lines(output: str | Iterable[str]) -> list[str]:
    if isinstance(output, str):
        return output.splitlines()
    return [line.rstrip("\n") for line in output]

