"""The stand-ins' Python modules (rigup_testbed/standins/), loaded on this machine: the test bed's hub
reads facts from the same code the rigs and images run, instead of keeping a second copy."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

STANDINS = Path(__file__).resolve().parent / "standins"


def load_standin(name: str) -> ModuleType:
    """standins/<name>.py as a module. The stand-ins import their helpers as top-level modules (they are
    installed flat on the hosts), so their directory goes on sys.path."""
    if str(STANDINS) not in sys.path:
        sys.path.insert(0, str(STANDINS))
    spec = importlib.util.spec_from_file_location(name, STANDINS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
