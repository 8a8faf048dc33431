"""The fleet's boundary: which port of which host answers whom, as one structure, and the nftables table
rendered from it on every fleet host (tasks/boundary.py), the port table in docs/security.md and the
probe test's list of what must not answer.

Default deny: a host admits new connections only to SSH, the entrance's port on the entrance, and each
internal service from the fleet members that use it (SERVICES below: the port, where it listens, who
calls it, how it checks the caller). Everything else is dropped, on the input hook and, for ports
Docker publishes (its DNAT sends them through the forward hook, past any input rule), on the forward
hook by the port the client asked for (`ct original proto-dst`). Members are admitted by address: each
host's ssh_hostname as the host itself resolves it (rigup.facts.boundary.BoundaryView), and the control
machine by the address its SSH connection comes from (it runs `rigup status`, `top`, `verify`, `bench`).
Holes follow the FleetPlan's roles, so a host taken out of a role loses its holes at the next converge.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rigup.desired.knobs import FIREWALL_ALLOW_FORM, allow_problem, knob
from rigup.desired.models import in_fleet_chains
from rigup.desired.roles import HostRoles, is_local, mirror_host
from rigup.desired.templating import render_template

TABLE = "rigup_boundary"
RULES_FILE = "/etc/rigup/boundary.nft"
UNIT = "rigup-boundary.service"
CONTROL = "control machine"  # the source name of the address the deploy's SSH connection comes from


class BoundaryError(ValueError):
    """A boundary rigup cannot render: the message names the host, the knob or address, and what is allowed."""


@dataclass(frozen=True)
class Service:
    """One row of the port table: a service some fleet hosts run and the fleet members that may call it."""

    name: str
    port: str  # how the docs name the port: its knob and default
    runs_on: str  # which hosts (the docs' words)
    callers: str  # who may open a connection (the docs' words)
    checked: str  # how the service itself checks the caller, beyond the firewall
    ports: Callable[[Any, str], list[str]]  # (fleet plan, host) -> nftables port specs on that host ([] none)
    sources: Callable[[Any, str], list[str] | None]  # (fleet plan, host) -> admitted hosts; None: anyone
    # the probe test (tests/e2e/boundary_probe.py): the requests an outsider tries ("METHOD /path"; a bare
    # path is a GET), at `probe_ports` where given (a service on every port: where its HTTP APIs listen),
    # else at its ports; and the paths where a member the firewall admits, without credentials, is refused
    # (401 or 403): the service itself asks who is calling
    probes: tuple[str, ...] = ()
    probe_ports: tuple[str, ...] = ()
    asks: tuple[str, ...] = ()
    # the writes ("METHOD /path") a member the firewall admits is refused with 405: the service takes none over its
    # API from anyone (the image registries' read-only mode)
    read_only: tuple[str, ...] = ()


def _roles(fleet: Any, name: str) -> HostRoles:
    return fleet.roles(name)


def _data(fleet: Any, name: str) -> Mapping[str, Any]:
    return fleet.host(name).data


def _hosts(fleet: Any, wanted: Callable[[HostRoles], bool]) -> list[str]:
    return [h.name for h in fleet.hosts if wanted(h.roles)]


def _ssh_port(fleet: Any, name: str) -> list[str]:
    return [str(_data(fleet, name).get("ssh_port") or 22)]


def _entrance_port(fleet: Any, name: str) -> list[str]:
    return [str(knob(_data(fleet, name), "gateway_port"))] if _roles(fleet, name).gateway else []


def _pod_ports(fleet: Any, name: str) -> list[str]:
    return sorted({str(plan.recipe.host_port) for plan in fleet.pods(name)}, key=int)


def _exporter_port(knob_name: str) -> Callable[[Any, str], list[str]]:
    def ports(fleet: Any, name: str) -> list[str]:
        data = _data(fleet, name)
        return [str(knob(data, knob_name))] if _roles(fleet, name).rig and knob(data, "metrics_exporters") else []
    return ports


def _prometheus_port(fleet: Any, name: str) -> list[str]:
    if not _roles(fleet, name).monitor:
        return []
    address, _, port = str(knob(_data(fleet, name), "prometheus_listen_address")).rpartition(":")
    return [] if address.strip("[]").startswith("127.") or address == "[::1]" else [port]


def _grafana_port(fleet: Any, name: str) -> list[str]:
    data = _data(fleet, name)
    return [str(knob(data, "grafana_port"))] if _roles(fleet, name).monitor and knob(data, "grafana") else []


def _mirror_port(fleet: Any, name: str) -> list[str]:
    return [str(knob(_data(fleet, name), "image_mirror_port"))] if _roles(fleet, name).image_mirror else []


def _mirror_clients(fleet: Any, name: str) -> list[str]:
    """The hosts that pull through this mirror (they name it) and so fill their relays from it."""
    return [h.name for h in fleet.hosts if h.name != name and mirror_host(h.data) == name]


def _in_chains(roles: HostRoles, name: str, data: Mapping[str, Any]) -> bool:
    """Whether the host serves the fleet's chains: a rig (models) or a registry of the fleet's images (image
    blobs, FleetPlan.image_chain), with model_fleet_source auto."""
    return (roles.rig or roles.image_registry) and in_fleet_chains(name, data)


def _chain_port(fleet: Any, name: str) -> list[str]:
    data = _data(fleet, name)
    return [str(knob(data, "model_fleet_port"))] if _in_chains(_roles(fleet, name), name, data) else []


def _chain_peers(fleet: Any, name: str) -> list[str]:
    """The other hosts of the fleet's chains (models and image blobs pass host to host)."""
    return [h.name for h in fleet.hosts if h.name != name and _in_chains(h.roles, h.name, h.data)]


def _cluster_ports(fleet: Any, name: str) -> list[str]:
    # every port: Ray's pinned ones, and NCCL's, Gloo's and vLLM's sockets on unpinned (ephemeral) ports
    return ["1-65535"] if _roles(fleet, name).cluster is not None else []


def _cluster_peers(fleet: Any, name: str) -> list[str]:
    cluster = _roles(fleet, name).cluster
    return [member for member in fleet.clusters().get(cluster, []) if member != name] if cluster else []


def _pod_callers(fleet: Any, name: str) -> list[str]:
    return [*_hosts(fleet, lambda r: r.gateway or r.monitor), CONTROL]


def _monitors(fleet: Any, name: str) -> list[str]:
    return [*_hosts(fleet, lambda r: r.monitor), CONTROL]


def _exporter_readers(fleet: Any, name: str) -> list[str]:
    # the entrance reads each rig's sentinel quarantines there (rigup-quarantine-routes, docs/sentinel.md)
    return [*_hosts(fleet, lambda r: r.monitor or r.gateway), CONTROL]


def _control(fleet: Any, name: str) -> list[str]:
    return [CONTROL]


def _anyone(fleet: Any, name: str) -> None:
    return None


# vLLM's docs/usage/security.md: --api-key guards /v1, /v2 and /inference only; these answer anyone who reaches
# the port even with a key (/work/shared/reference/anchors-trust.md section 3), beside /v1's own
VLLM_PROBES = ("/v1/models", "POST /v1/chat/completions", "POST /v1/completions", "POST /invocations", "POST /pooling",
               "POST /classify", "POST /score", "POST /rerank", "POST /pause", "POST /resume", "POST /update_weights",
               "POST /tokenize", "POST /detokenize", "/health", "/version", "/load", "/metrics")
PROMETHEUS_PROBES = ("/api/v1/query?query=up", "/api/v1/targets", "/api/v1/status/config",
                     "POST /api/v1/admin/tsdb/snapshot", "POST /api/v1/admin/tsdb/delete_series?match[]=up",
                     "POST /-/reload", "/metrics")
# the Distribution registry's API: pull (catalog, a manifest) and push (start a blob upload, put a manifest) and
# delete (a manifest by digest)
REGISTRY_WRITES = ("POST /v2/rigup-probe/blobs/uploads/", "PUT /v2/rigup-probe/manifests/latest",
                   f"DELETE /v2/rigup-probe/manifests/sha256:{'0' * 64}")
REGISTRY_PROBES = ("/v2/", "/v2/_catalog", "/v2/library/debian/manifests/latest", *REGISTRY_WRITES)
# Ray's dashboard: its job submission API (the way ShadowRay ran code) and its state API; rigup starts the head
# with --include-dashboard=false, and the probe tries Ray's default dashboard port (8265) all the same
RAY_PROBES = ("/api/version", "/api/jobs/", "POST /api/jobs/", "/api/v0/nodes", "/nodes?view=summary")

SERVICES: tuple[Service, ...] = (
    Service("SSH", "ssh_port (22)", "every fleet host", "anyone", "SSH keys", _ssh_port, _anyone),
    Service("the entrance (the fleet's API)", "gateway_port (4000)", "gateway_group's hosts", "anyone",
            "TLS with the fleet CA's certificate (gateway_plain_http: none), and a client's key (gateway_clients, "
            "gateway_api_key_file)", _entrance_port, _anyone,
            # every vLLM path but /health, the front's own liveness answer ({"status":"ok"}) to anyone
            tuple(probe for probe in VLLM_PROBES if probe != "/health"), asks=("/v1/models", "/metrics/")),
    Service("each pod's vLLM API", "each pod's port (8000+)", "every rig", "the entrance, the monitor, the control "
            "machine, the host itself", "the pod's API key on /v1 only (its own, made on the control machine, or "
            "serving_api_key_file's); /metrics, /health, /invocations, /tokenize, /pause and more are unguarded by "
            "vLLM: the firewall", _pod_ports, _pod_callers, VLLM_PROBES, asks=("/v1/models",)),
    Service("node_exporter", "node_exporter_port (9100)", "every rig (metrics_exporters)", "the monitor, the entrance, the control "
            "machine", "TLS from the fleet CA and basic auth (the metrics password's bcrypt hash)",
            _exporter_port("node_exporter_port"), _exporter_readers, ("/metrics",), asks=("/metrics",)),
    Service("the DCGM exporter (Docker-published)", "gpu_exporter_port (9400)", "every rig (metrics_exporters)",
            "the monitor, the control machine", "TLS from the fleet CA and basic auth (the metrics password's bcrypt "
            "hash)", _exporter_port("gpu_exporter_port"), _monitors, ("/metrics",), asks=("/metrics",)),
    Service("Prometheus", "prometheus_listen_address (9090)", "monitor_group's hosts", "the control machine, the "
            "host itself", "TLS from the fleet CA and basic auth (the metrics password's bcrypt hash)", _prometheus_port,
            _control, PROMETHEUS_PROBES, asks=("/api/v1/query?query=up", "/-/ready")),
    Service("Grafana", "grafana_port (3000)", "monitor_group's hosts (grafana)", "the control machine",
            "Grafana's login", _grafana_port, _control, ("/api/health", "/api/datasources", "/api/search"),
            asks=("/api/datasources",)),
    Service("the image mirror (registry)", "image_mirror_port (5000)", "image_mirror_host", "the hosts pulling "
            "through it (their relays)", "pulls: none, the firewall; read-only over its API (storage.maintenance."
            "readonly): no push or delete from anyone, rigup fills its storage itself", _mirror_port, _mirror_clients,
            REGISTRY_PROBES, read_only=REGISTRY_WRITES),
    Service("the chain server (models and images rig to rig)", "model_fleet_port (8765)", "every rig and image "
            "registry in the fleet's chains (model_fleet_source auto)", "the other hosts of the chains", "a per-run token, only while "
            "a peer needs files", _chain_port, _chain_peers, ("/", "/_rigfetch/ping", "/_rigfetch/pieces/")),
    Service("Ray, NCCL, Gloo (a cluster)", "every port, Ray's pinned (cluster_ray_*) and the ephemeral range",
            "every cluster member", "the cluster's other members", "Ray: the cluster's token (RAY_AUTH_MODE=token, from each member's 0600 secret file); NCCL, Gloo: none, the firewall",
            _cluster_ports, _cluster_peers, RAY_PROBES, probe_ports=("8265",)),
)


@dataclass(frozen=True)
class Hole:
    """New connections one host admits to some of its ports: from `sources` (host names, CONTROL), or anyone."""

    service: str
    ports: tuple[str, ...]
    sources: tuple[str, ...] | None  # None: anyone


def holes(fleet: Any, name: str) -> list[Hole]:
    """What host `name` admits, service by service, from the run's FleetPlan (rigup.desired.fleet_plan)."""
    out = []
    for service in SERVICES:
        ports = service.ports(fleet, name)
        if not ports:
            continue
        sources = service.sources(fleet, name)
        if sources is not None:
            sources = [s for s in sources if not is_local(s)]  # pyinfra's own host: no address a peer sees
            if not sources:
                continue
        out.append(Hole(service.name, tuple(ports), None if sources is None else tuple(sources)))
    return out


def peer_hostnames(fleet: Any, name: str) -> dict[str, str]:
    """The fleet hosts host `name` admits by address, each as the fleet file reaches it (its ssh_hostname)."""
    wanted = {s for hole in holes(fleet, name) for s in hole.sources or () if s != CONTROL}
    return {h.name: str(h.data.get("ssh_hostname") or h.name) for h in fleet.hosts if h.name in wanted}


@dataclass(frozen=True)
class Allowed:
    """One firewall_allow entry: a network, and the ports it may open (None: every port)."""

    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    ports: str | None


def parse_allow(entries: Sequence[str]) -> list[Allowed]:
    """firewall_allow's entries (checked by the knob's rule: allow_problem)."""
    out = []
    for entry in entries:
        problem = allow_problem(entry)
        if problem is not None:
            raise BoundaryError(f"'firewall_allow': {problem}; it takes {FIREWALL_ALLOW_FORM}")
        words = entry.split()
        out.append(Allowed(ipaddress.ip_network(words[0], strict=False), words[1] if len(words) == 2 else None))
    return out


@dataclass(frozen=True)
class Rule:
    """One accept rule of the rendered table."""

    comment: str
    family: str | None  # "ip", "ip6", or None: no source match
    addresses: tuple[str, ...]
    ports: tuple[str, ...] | None  # None: every port


def rules(host: str, host_holes: Iterable[Hole], addresses: Mapping[str, Sequence[str]],
          allowed: Iterable[Allowed]) -> list[Rule]:
    """The accept rules of host `host`: each hole, its sources by address (`addresses`: source name ->
    the addresses the host resolved it to; a source with none is left out: it cannot be matched), then
    the user's own networks (firewall_allow)."""
    out = []
    for hole in host_holes:
        if hole.sources is None:
            out.append(Rule(f"{hole.service}: anyone", None, (), hole.ports))
            continue
        resolved = sorted({a for s in hole.sources for a in addresses.get(s, ())})
        who = ", ".join(hole.sources)
        for family, version in (("ip", 4), ("ip6", 6)):
            picked = tuple(a for a in resolved if ipaddress.ip_address(a).version == version)
            if picked:
                out.append(Rule(f"{hole.service}: {who}", family, picked, hole.ports))
    for entry in allowed:
        family = "ip" if entry.network.version == 4 else "ip6"
        out.append(Rule("firewall_allow", family, (str(entry.network),), None if entry.ports is None else (entry.ports,)))
    return out


def table_text(host: str, host_rules: Sequence[Rule]) -> str:
    """The nftables file of host `host`: `nft -f` of it replaces rigup's table alone, in one transaction."""
    return render_template("rigup-boundary.nft.j2", host=host, table=TABLE, rules=host_rules)


def unit_text() -> str:
    return render_template("rigup-boundary.service.j2", rules_file=RULES_FILE, table=TABLE)


def port_table(services: Sequence[Service] = SERVICES) -> str:
    """docs/security.md's port table (a test keeps the docs equal to it)."""
    lines = ["| Port | Service | Runs on | Who may connect | How the caller is checked |", "|---|---|---|---|---|"]
    lines += [f"| {s.port} | {s.name} | {s.runs_on} | {s.callers} | {s.checked} |" for s in services]
    return "\n".join(lines) + "\n"


def host_rules(fleet: Any, name: str, control: str | None, peers: Mapping[str, Sequence[str]]) -> list[Rule]:
    """Host `name`'s accept rules: its holes (holes), its sources by the addresses it read (`control`: where
    the deploy's SSH connection comes from; `peers`: each peer_hostnames host resolved), firewall_allow.
    A peer that resolves to nothing raises BoundaryError: its flows would be dropped without a word."""
    data = fleet.host(name).data
    wanted = peer_hostnames(fleet, name)
    unresolved = sorted(peer for peer in wanted if not peers.get(peer))
    if unresolved:
        shown = ", ".join(f"{peer} ({wanted[peer]})" for peer in unresolved)
        raise BoundaryError(f"the boundary cannot admit {shown}: the name does not resolve on this host; set the "
                            "peer's ssh_hostname to an address, or add it to firewall_allow")
    addresses: dict[str, Sequence[str]] = dict(peers)
    if control is not None:
        addresses[CONTROL] = [control]
    return rules(name, holes(fleet, name), addresses, parse_allow(knob(data, "firewall_allow") or []))
