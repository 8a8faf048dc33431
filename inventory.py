"""The fleet, read from rigs.yaml next to this file (or the file $RIGUP_RIGS names).

Each group of the fleet file becomes a pyinfra group; each host carries its merged data (fleet-wide
`data`, then its group's `data`, then its own keys). See rigs.example.yaml for the format.
"""

from rigup.desired.fleet import load_fleet

globals().update(load_fleet().pyinfra_groups())
