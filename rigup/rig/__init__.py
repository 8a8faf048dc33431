"""Scripts that run on a rig: Python 3 standard library only, uploaded by the tasks."""

from pathlib import Path

SERVINGCTL_SCRIPT = Path(__file__).with_name("servingctl.py")
QUARANTINE_ROUTES_SCRIPT = Path(__file__).with_name("quarantine_routes.py")
ENTRANCE_USAGE_SCRIPT = Path(__file__).with_name("entrance_usage.py")
