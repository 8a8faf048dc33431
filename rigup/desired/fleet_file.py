"""Where the fleet file is: $RIGUP_RIGS, else rigs.yaml in rigup's working directory. Apart from the fleet
file's reader (rigup.desired.fleet) so that the lock, which sits beside the fleet file, finds it without
importing what the fleet file is checked against."""

from __future__ import annotations

import os
from pathlib import Path

from rigup import WORK_DIR

FLEET_ENV = "RIGUP_RIGS"
DEFAULT_FLEET_FILE = WORK_DIR / "rigs.yaml"


def fleet_path() -> Path:
    """The fleet file to read: $RIGUP_RIGS, else rigs.yaml next to inventory.py."""
    configured = os.environ.get(FLEET_ENV)
    return Path(configured).expanduser().resolve() if configured else DEFAULT_FLEET_FILE
