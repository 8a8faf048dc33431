"""Parsers of iproute2's JSON output (`ip -j ...`) and /sys/class/net: which interface and source address
a rig reaches its cluster peers over (rigup.desired.cluster).

vLLM's members talk over torch.distributed (Gloo) and NCCL sockets; both pick an interface of their own
unless told (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, and VLLM_HOST_IP for the address vLLM advertises,
which it otherwise takes from the route to 8.8.8.8: vllm/utils/network_utils.py get_ip). Members that
reach each other over different interfaces fail with "Gloo connectFullMesh failed" or hang in NCCL
(vllm-project/vllm#5484, #5094, #7074, #7815), so `interface_for_peers` requires one interface, and a
private source address, towards every peer.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rigup.parsers.common import JsonDataclass, ParseError

# Where cluster traffic may flow: RFC 1918, RFC 6598 shared address space (CGNAT, e.g. Tailscale's
# 100.64.0.0/10), IPv6 unique local addresses (RFC 4193) and link-local addresses (RFC 3927, RFC 4291).
PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "fc00::/7", "fe80::/10")
)


class IprouteError(ParseError):
    """`ip -j` output that is not what the command prints (or an error message instead of JSON)."""


@dataclass(frozen=True)
class RouteChoice(JsonDataclass):
    """What `ip -j route get <peer>` chose: the outgoing interface, the source address, the gateway."""

    dst: str
    dev: str
    src: str | None  # prefsrc; None when the kernel names none
    via: str | None  # the gateway; None: the peer is on a directly attached network
    local: bool = False  # the address is this host's own (type "local", through lo)


@dataclass(frozen=True)
class Address(JsonDataclass):
    """One address of `ip -j addr`, with its interface's MTU and state."""

    ifname: str
    family: str  # "inet" or "inet6"
    local: str
    prefixlen: int
    scope: str  # "global", "link", "host"
    mtu: int
    operstate: str  # "UP", "DOWN", "UNKNOWN" (loopback and some virtual links)


@dataclass(frozen=True)
class Link(JsonDataclass):
    """One interface of `ip -j -d link`: its kind tells a veth, bridge or tunnel from a NIC."""

    ifname: str
    kind: str | None  # linkinfo.info_kind ("veth", "bridge", "tun", ...); None: a physical device (or loopback)
    link_type: str  # "ether", "loopback", "none", ...
    mtu: int
    operstate: str
    parentbus: str | None  # "pci", "virtio", ...; None when the kernel names none


def _json_list(output: str, command: str) -> list[Any]:
    text = output.strip()
    if not text:
        raise IprouteError(f"`{command}` printed nothing")
    try:
        value = json.loads(text)
    except ValueError:
        first = text.splitlines()[0]
        raise IprouteError(f"`{command}` did not print JSON: {first!r}") from None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise IprouteError(f"`{command}` printed JSON that is not a list of objects: {text[:80]!r}")
    return value


def _field(item: Mapping[str, Any], key: str, kind: type, command: str) -> Any:
    value = item.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise IprouteError(f"`{command}`: {key!r} missing or not a {kind.__name__} in {item!r}")
    return value


def route_to(output: str) -> RouteChoice:
    """The route of `ip -j route get <peer-ip>`. Raises IprouteError on anything else, e.g. what ip prints
    (on stderr) for a peer it has no route to: "RTNETLINK answers: Network is unreachable"."""
    command = "ip -j route get"
    routes = _json_list(output, command)
    if len(routes) != 1:
        raise IprouteError(f"`{command}` printed {len(routes)} routes, expected 1")
    route = routes[0]
    gateway = route.get("gateway")
    src = route.get("prefsrc")
    return RouteChoice(
        dst=_field(route, "dst", str, command),
        dev=_field(route, "dev", str, command),
        src=src if isinstance(src, str) else None,
        via=gateway if isinstance(gateway, str) else None,
        local=route.get("type") == "local",
    )


def addresses(output: str) -> list[Address]:
    """Every address of `ip -j addr`, interface by interface in ip's order."""
    command = "ip -j addr"
    found = []
    for link in _json_list(output, command):
        ifname = _field(link, "ifname", str, command)
        mtu = _field(link, "mtu", int, command)
        operstate = str(link.get("operstate", "UNKNOWN"))
        infos = link.get("addr_info", [])
        if not isinstance(infos, list):
            raise IprouteError(f"`{command}`: {ifname}: addr_info is not a list")
        for info in infos:
            if not isinstance(info, dict):
                raise IprouteError(f"`{command}`: {ifname}: an addr_info entry is not an object")
            found.append(Address(
                ifname=ifname,
                family=_field(info, "family", str, command),
                local=_field(info, "local", str, command),
                prefixlen=_field(info, "prefixlen", int, command),
                scope=str(info.get("scope", "global")),
                mtu=mtu,
                operstate=operstate,
            ))  # fmt: skip
    return found


def links(output: str) -> list[Link]:
    """Every interface of `ip -j -d link` (the details flag adds linkinfo and parentbus)."""
    command = "ip -j -d link"
    found = []
    for link in _json_list(output, command):
        info = link.get("linkinfo")
        kind = info.get("info_kind") if isinstance(info, dict) else None
        bus = link.get("parentbus")
        found.append(Link(
            ifname=_field(link, "ifname", str, command),
            kind=kind if isinstance(kind, str) else None,
            link_type=str(link.get("link_type", "")),
            mtu=_field(link, "mtu", int, command),
            operstate=str(link.get("operstate", "UNKNOWN")),
            parentbus=bus if isinstance(bus, str) else None,
        ))  # fmt: skip
    return found


def is_private(address: str) -> bool:
    """Whether `address` ("10.250.1.1", "fd50::1", "fe80::1%fab0") is in PRIVATE_NETWORKS; any other
    address, loopback included, is not (False for text that is no address)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == net.version and ip in net for net in PRIVATE_NETWORKS)


def interface_for_peers(route_outputs: Mapping[str, str]) -> tuple[str, str] | str:
    """(interface, source address) this host reaches every peer over, from each peer's `ip -j route get
    <peer-ip>` output (peer name -> output); else the reason, naming the peers and interfaces.

    The peers must all be reached over the same interface from the same source address, a private one
    (`is_private`): that interface is GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, that address VLLM_HOST_IP."""
    if not route_outputs:
        return "no peers to reach: a cluster has at least 2 members"
    routes: dict[str, RouteChoice] = {}
    for peer, output in route_outputs.items():
        try:
            routes[peer] = route_to(output)
        except IprouteError as exc:
            return f"no route to peer {peer}: {exc}"
    for peer, route in routes.items():
        if route.local or route.dev == "lo":
            return f"peer {peer} ({route.dst}) is an address of this host (route via {route.dev}): list each rig once"
        if route.src is None:
            return f"peer {peer} ({route.dst}) is reached over {route.dev} with no source address"
    seen = sorted({(r.dev, r.src or "") for r in routes.values()})
    if len(seen) > 1:
        each = ", ".join(f"{peer} via {r.dev} (source {r.src})" for peer, r in routes.items())
        return (f"the peers are reached over different interfaces or source addresses: {each}; vLLM's Gloo and "
                f"NCCL need one interface to every member (\"Gloo connectFullMesh failed\", NCCL hangs: "
                f"vllm-project/vllm#5484, #5094, #7074, #7815): put the members on one network")
    dev, src = seen[0]
    if not is_private(src):
        peers = ", ".join(routes)
        return (f"the peers ({peers}) are reached over {dev} from {src}, which is not a private address: "
                f"NCCL and Gloo traffic is unencrypted and unauthenticated; give the members addresses on a private "
                f"network (10/8, 172.16/12, 192.168/16, 100.64/10, fc00::/7, link-local)")
    return dev, src


def link_speed_mbps(text: str | None) -> int | None:
    """/sys/class/net/<if>/speed in Mb/s; None when unknown: "-1" (virtio, a link down), an unreadable
    file (loopback, ifb: "Invalid argument") or None."""
    if text is None:
        return None
    try:
        speed = int(text.strip())
    except ValueError:
        return None
    return speed if speed > 0 else None


@dataclass(frozen=True)
class PeerRoutes(JsonDataclass):
    """What a cluster member reads about reaching its peers (rigup.facts.network.ClusterPeerRoutes): each
    peer's IPv4 address as the member resolves it (None: it does not resolve) and the raw `ip -j route get`
    output for it (route_to parses it), and every interface's MTU and speed (Mb/s; None: unknown)."""

    addresses: Mapping[str, str | None]
    routes: Mapping[str, str]
    mtu: Mapping[str, int]
    speed_mbps: Mapping[str, int | None]
    local_ports: tuple[int, int] = (32768, 60999)  # net.ipv4.ip_local_port_range (Linux's default)
    clock_offset_s: float | None = None  # the host's clock minus the reader's when the output arrived


def parse_peer_routes(lines: Any, received_at: float | None = None) -> PeerRoutes:
    """Sections `==> peer NAME ADDRESS` (ADDRESS "-" when it does not resolve) each followed by `ip -j route
    get` output (or its error), then `==> links` and `IFNAME MTU SPEED` lines, and `==> clock EPOCH` (the
    host's clock as the command ended), compared with `received_at` (the reader's, as the output arrived)."""
    addresses: dict[str, str | None] = {}
    routes: dict[str, list[str]] = {}
    mtu: dict[str, int] = {}
    speed: dict[str, int | None] = {}
    section: str | None = None
    local_ports = (32768, 60999)
    offset: float | None = None
    for raw in (lines.splitlines() if isinstance(lines, str) else lines):
        line = raw.rstrip("\n")
        if line.startswith("==> clock "):
            try:
                clock = float(line.split()[2])
            except (IndexError, ValueError):
                raise IprouteError(f"bad clock line: {line!r}") from None
            offset = None if received_at is None else round(clock - received_at, 3)
            section = None
        elif line.startswith("==> local_ports "):
            parts = line.split()[2:]
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise IprouteError(f"bad local port range: {line!r}")
            local_ports = (int(parts[0]), int(parts[1]))
        elif line.startswith("==> peer "):
            parts = line[len("==> peer "):].split()
            if len(parts) != 2:
                raise IprouteError(f"bad peer section header: {line!r}")
            section = parts[0]
            addresses[section] = None if parts[1] == "-" else parts[1]
            routes[section] = []
        elif line == "==> links":
            section = "links"
        elif section == "links":
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 3 or not parts[1].isdigit():
                raise IprouteError(f"bad link line (IFNAME MTU SPEED): {line!r}")
            mtu[parts[0]] = int(parts[1])
            speed[parts[0]] = link_speed_mbps(parts[2])
        elif section is not None:
            routes[section].append(line)
        elif line.strip():
            raise IprouteError(f"output before any section: {line!r}")
    return PeerRoutes(addresses, {peer: "\n".join(out) for peer, out in routes.items()}, mtu, speed, local_ports,
                      offset)
