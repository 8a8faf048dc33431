"""What each host of the fleet is: the one place the role knobs are interpreted.

A host's roles come from its knobs (serves_variant, image_mirror, cluster, gateway_group, monitor_group),
its inventory groups and, for the image mirror, the other hosts that name it. Everything that asks "does
this host serve a variant?", "is it the gateway?", "runs it a registry of the fleet's images?", "which
mirror, which cluster share?" asks here (rigup.desired.fleet_plan holds each host's roles for a run;
deploy.py's gates read them); tests/test_layout.py keeps those knobs read in this module.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rigup.desired.knobs import knob

# pyinfra's local connector: the machine rigup runs on, reached without SSH; it has no address another host
# of the fleet can use (a mirror, a chain's upstream, a gateway's route need one)
LOCAL_HOST = "@local"


def is_local(name: str) -> bool:
    """Whether `name` is pyinfra's local connector (LOCAL_HOST)."""
    return name == LOCAL_HOST


def serves_variant(data: Mapping[str, Any]) -> bool:
    """Whether the host is a rig (GPU, driver, Docker, sources, model, a variant); False: a gateway-only host."""
    return bool(knob(data, "serves_variant"))


def gateway_group(data: Mapping[str, Any]) -> str:
    """The inventory group whose hosts run the fleet's gateway (gateway_group)."""
    return str(knob(data, "gateway_group"))


def is_gateway(data: Mapping[str, Any], groups: Iterable[str]) -> bool:
    """Whether the host runs the fleet's gateway: it is in gateway_group."""
    return gateway_group(data) in set(groups)


def is_monitor(data: Mapping[str, Any], groups: Iterable[str]) -> bool:
    """Whether the host runs the fleet's Prometheus: it is in monitor_group."""
    return knob(data, "monitor_group") in set(groups)


def image_mirror(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """{host, address, port} of the mirror this host pulls rigup's images through (the image_mirror knob the
    fleet file's loader derives from image_mirror_host); None without a mirror."""
    return knob(data, "image_mirror") or None


def mirror_host(data: Mapping[str, Any]) -> str | None:
    """The host this one pulls rigup's images through (its image_mirror's host); None without a mirror."""
    mirror = image_mirror(data)
    return str(mirror["host"]) if mirror and mirror.get("host") is not None else None


def is_image_relay(data: Mapping[str, Any]) -> bool:
    """Whether the host runs a relay of the fleet's image mirror: it names a mirror and serves a variant
    (it pins images; a gateway-only host pulls none)."""
    return image_mirror(data) is not None and serves_variant(data)


def cluster_membership(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The host's share of its cluster (the cluster knob the fleet file's loader sets: the cluster's name,
    its rank, variant and hosts; rigup.desired.cluster.cluster_of reads it); None outside one."""
    return knob(data, "cluster") or None


def cluster_name(data: Mapping[str, Any]) -> str | None:
    """The cluster the host is a member of; None outside one."""
    member = cluster_membership(data)
    return str(member["name"]) if member else None


@dataclass(frozen=True)
class HostRoles:
    """Every role of one host in the fleet."""

    rig: bool  # serves a variant (serves_variant)
    gateway: bool  # in gateway_group
    monitor: bool  # in monitor_group
    image_mirror: bool  # some host names it as its image mirror
    image_relay: bool  # names a mirror and serves a variant
    cluster: str | None  # the cluster it is a member of

    @property
    def image_registry(self) -> bool:
        """Whether it runs a registry of the fleet's images (the mirror, or a relay)."""
        return self.image_mirror or self.image_relay


def named_mirrors(fleet: Iterable[Mapping[str, Any]]) -> set[str]:
    """The hosts some host of `fleet` (each host's data) names as its image mirror."""
    return {mirror for data in fleet if (mirror := mirror_host(data)) is not None}


def host_roles(name: str, data: Mapping[str, Any], groups: Iterable[str], mirrors: Collection[str]) -> HostRoles:
    """The roles of host `name`; `mirrors`: the hosts the fleet names as its image mirror (named_mirrors)."""
    groups = set(groups)
    return HostRoles(
        rig=serves_variant(data),
        gateway=is_gateway(data, groups),
        monitor=is_monitor(data, groups),
        image_mirror=name in mirrors,
        image_relay=is_image_relay(data),
        cluster=cluster_name(data),
    )
