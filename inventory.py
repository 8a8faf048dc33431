"""The fleet, read from rigs.yaml next to this file (or the file $RIGUP_RIGS names).

Each group of the fleet file becomes a pyinfra group; each host carries its merged data (fleet-wide
`data`, then its group's `data`, then its own keys). See rigs.example.yaml for the format.

A fleet file rigup cannot use stops everything here, before pyinfra connects to anything: under the
pyinfra CLI with one line on stderr (`rigup: <file>: <host>: <problem>`) and exit status 2. pyinfra
wraps any other exception an inventory file raises in a traceback (pyinfra_cli.util.exec_file:
UnexpectedExternalError), but SystemExit is not an Exception and passes through pyinfra and click.
Loaded in-process (rigup rollout plans from this file), the FleetError itself is raised, as a
PyinfraError so that exec_file re-raises it unwrapped, and the caller reports it.
"""

import sys as _sys

import pyinfra as _pyinfra
from pyinfra.api.exceptions import PyinfraError as _PyinfraError

from rigup.desired.fleet import FleetError as _FleetError
from rigup.desired.fleet import load_fleet as _load_fleet


class _InventoryFleetError(_FleetError, _PyinfraError):
    """A FleetError that pyinfra's inventory loader passes on as it is."""


try:
    _groups = _load_fleet().pyinfra_groups()
except _FleetError as _exc:
    if _pyinfra.is_cli:
        print(f"rigup: {_exc}", file=_sys.stderr)
        raise SystemExit(2) from None
    raise _InventoryFleetError(str(_exc)) from None

globals().update(_groups)
