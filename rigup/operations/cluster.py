"""A cluster member's network, read on the host as the deploy plans it (rigup.desired.cluster)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rigup.desired.cluster import MemberNetwork, cluster_of, member_net
from rigup.desired.knobs import knob
from rigup.facts.network import ClusterPeerRoutes
from rigup.parsers.iproute import PeerRoutes


def peer_addresses(host: Any) -> dict[str, str]:
    """The other members of the host's cluster, by name, as the fleet file reaches them (ssh_hostname)."""
    member = knob(host.data, "cluster")
    names = [h for h in cluster_of(member).hosts if h != host.name] if member else []
    return {name: str(host.inventory.get_host(name).data.get("ssh_hostname") or name) for name in names}


def peer_routes(host: Any) -> PeerRoutes | None:
    """What the host reads about reaching the other members (None: not a member)."""
    if not knob(host.data, "cluster"):
        return None
    return host.get_fact(ClusterPeerRoutes, peers=peer_addresses(host))


def member_network(host: Any) -> MemberNetwork | None:
    """The host's interface and address towards its cluster, or the problem (None: not a member)."""
    read = peer_routes(host)
    if read is None:
        return None
    return member_net(cluster_of(knob(host.data, "cluster")), host.name, read)


def cluster_host_data(host: Any) -> dict[str, Any]:
    """The host's data with its cluster knob's `net` filled in from what it read (when it could be
    decided: preflight fails the host otherwise), so a member's compose names its real interface and
    addresses."""
    data = host.data.dict()
    network = member_network(host)
    if network is not None and network.net is not None:
        data["cluster"] = {**data["cluster"], "net": asdict(network.net)}
    return data
