"""The boundary of a host whose firewall knob is off: taken away."""

from __future__ import annotations

from pyinfra import host as current_host
from pyinfra.api import StringCommand, operation
from pyinfra.facts.files import File

from rigup.desired.boundary import RULES_FILE, TABLE, UNIT


@operation()
def boundary_absent(unit_dir: str = "/etc/systemd/system"):
    """
    Take away rigup's boundary (firewall: false): stop its unit (whose stop deletes the nftables table),
    and remove the unit and the rules file. Nothing to do on a host that never had one.

    + unit_dir: where rigup writes systemd units
    """
    unit_file = f"{unit_dir}/{UNIT}"
    left = [path for path in (unit_file, RULES_FILE) if current_host.get_fact(File, path=path)]
    if not left:
        current_host.noop("no boundary on this host")
        return
    if unit_file in left:
        yield StringCommand("systemctl", "disable", "--now", UNIT)
    # the table too, should the unit have been stopped by hand with its rules left loaded
    yield StringCommand("sh", "-c", f"'nft delete table inet {TABLE} 2>/dev/null || true'")
    yield StringCommand("rm", "-f", *left)
    if unit_file in left:
        yield StringCommand("systemctl", "daemon-reload")
