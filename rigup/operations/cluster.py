"""A cluster member's network, read on the host as the deploy plans it (rigup.desired.cluster), a member's
firewall, and the firewall of a host that is no longer a member."""

from __future__ import annotations

import posixpath
from io import StringIO
from typing import Any

from pyinfra import host as current_host
from pyinfra.api import StringCommand, operation
from pyinfra.facts.files import File
from pyinfra.operations import files

from rigup.desired.cluster import (
    FIREWALL_FILE,
    FIREWALL_TABLE,
    FIREWALL_UNIT,
    MemberNetwork,
    cluster_of,
    firewall_unit_text,
    member_data,
    member_net,
)
from rigup.desired.roles import cluster_membership
from rigup.facts.network import ClusterPeerRoutes
from rigup.operations.units import unit_runs_current_files
from rigup.parsers.iproute import PeerRoutes
from rigup.runstate import fleet_plan


def peer_addresses(host: Any) -> dict[str, str]:
    """The other members of the host's cluster, by name, as the fleet file reaches them (ssh_hostname):
    the run's FleetPlan knows them."""
    return fleet_plan(host.state).cluster_peers(host.name)


def peer_routes(host: Any) -> PeerRoutes | None:
    """What the host reads about reaching the other members (None: not a member)."""
    if cluster_membership(host.data) is None:
        return None
    return host.get_fact(ClusterPeerRoutes, peers=peer_addresses(host))


def member_network(host: Any) -> MemberNetwork | None:
    """The host's interface and address towards its cluster, or the problem (None: not a member)."""
    read = peer_routes(host)
    member = cluster_membership(host.data)
    if read is None or member is None:
        return None
    return member_net(cluster_of(member), host.name, read)


def cluster_host_data(host: Any) -> dict[str, Any]:
    """The host's data with its cluster knob's `net` filled in from what it read (when it could be
    decided: preflight fails the host otherwise), so a member's compose names its real interface and
    addresses."""
    return member_data(host.data.dict(), member_network(host))


@operation()
def cluster_firewall(rules: str, unit_dir: str = "/etc/systemd/system"):
    """
    A cluster member's firewall: ``rules`` in its rules file and rigup-cluster-firewall.service (its unit
    written here) enabled and active on them, restarted when the rules or the unit changed after it started
    (the unit's start loads the table, its stop deletes it). The counterpart of cluster_firewall_absent.

    + rules: the nftables table (rigup.desired.cluster.firewall_text: the members alone to Ray's and NCCL's ports)
    + unit_dir: where rigup writes systemd units
    """
    unit_file = f"{unit_dir}/{FIREWALL_UNIT}"
    yield from files.directory._inner(path=posixpath.dirname(FIREWALL_FILE), mode="755")
    yield from files.put._inner(src=StringIO(rules), dest=FIREWALL_FILE, mode="644")
    yield from files.put._inner(src=StringIO(firewall_unit_text()), dest=unit_file, mode="644")
    yield from unit_runs_current_files._inner(unit=FIREWALL_UNIT, files=[FIREWALL_FILE, unit_file])


@operation()
def cluster_firewall_absent(unit_dir: str = "/etc/systemd/system"):
    """
    Take away the firewall a cluster left on a host that is in no cluster now: stop its unit (whose stop
    deletes the nftables table), and remove the unit and the rules file. Nothing to do on a host that
    never was a member.

    + unit_dir: where rigup writes systemd units
    """
    unit_file = f"{unit_dir}/{FIREWALL_UNIT}"
    left = [path for path in (unit_file, FIREWALL_FILE) if current_host.get_fact(File, path=path)]
    if not left:
        current_host.noop("no cluster firewall on this host")
        return
    if unit_file in left:
        yield StringCommand("systemctl", "disable", "--now", FIREWALL_UNIT)
    # the table too, should the unit have been stopped by hand with its rules left loaded
    yield StringCommand("sh", "-c", f"'nft delete table inet {FIREWALL_TABLE} 2>/dev/null || true'")
    yield StringCommand("rm", "-f", *left)
    if unit_file in left:
        yield StringCommand("systemctl", "daemon-reload")
