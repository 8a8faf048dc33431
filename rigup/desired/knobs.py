"""The knobs group_data/all.py declares, with their defaults, for code that runs outside pyinfra.

pyinfra loads group_data itself during a deploy; the CLI tools (render, lock, doctor, status) and the
fleet file validation need the same names and defaults, so they read the one file the same way.
"""

from __future__ import annotations

import copy
import functools
import json
import types
from typing import Any

from rigup import DEPLOY_ROOT

KNOBS_FILE = DEPLOY_ROOT / "group_data" / "all.py"


@functools.cache
def _declared() -> dict[str, Any]:
    """Every name group_data/all.py assigns, pyinfra's global arguments (_sudo) included."""
    namespace: dict[str, Any] = {}
    exec(compile(KNOBS_FILE.read_text(), str(KNOBS_FILE), "exec"), namespace)
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("__") and not isinstance(value, types.ModuleType)
    }


@functools.cache
def _defaults() -> dict[str, Any]:
    """The knobs proper (what a fleet file may set under its own names)."""
    return {name: value for name, value in _declared().items() if not name.startswith("_")}


def load_defaults() -> dict[str, Any]:
    """Knob name -> default value (a fresh copy: callers may mutate it)."""
    return copy.deepcopy(_defaults())


def parse_data_value(text: str) -> Any:
    """Parse a `--data key=value` value the way pyinfra's CLI does: bools, ints, JSON, else text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return json.loads(text)
    except ValueError:
        return text


_UNSET = object()


def knob(data: Any, name: str) -> Any:
    """The host's value of knob `name`, else its one default in group_data/all.py.

    `data` is pyinfra's host.data or a mapping of knobs. Deploys already see every default (pyinfra
    loads group_data); partial mappings (a CLI preview, a test) get the same defaults from here, so
    no other module repeats one. An undeclared name is a programming error (KeyError)."""
    value = data.get(name, _UNSET)
    return _declared()[name] if value is _UNSET else value


def knob_int(data: Any, name: str, minimum: int) -> int:
    """knob() for an integer knob with a lower bound; ValueError naming the knob, the value and what is allowed."""
    value = knob(data, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer of at least {minimum}, got {value!r}")
    return value
