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
def _defaults() -> dict[str, Any]:
    namespace: dict[str, Any] = {}
    exec(compile(KNOBS_FILE.read_text(), str(KNOBS_FILE), "exec"), namespace)
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


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
