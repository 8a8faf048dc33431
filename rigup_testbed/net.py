"""Network of a test bed: one flat /24 on a bridge inside the hub namespace.

    root namespace                hub namespace (<inst>-hub)             host namespace (<inst>-<host>)
    <inst>-ctl  .254/24  ──veth── [br0 .1/24] ──veth── eth0 .11/24 (default via .1)
                                        └── hub services listen on .1

The control machine (pytest, or a user's pyinfra) reaches every host directly on the /24 (on-link, no
forwarding); hosts reach the hub at .1. Nothing is routed anywhere else: hosts have no way out.
The subnet is RIGUP_TESTBED_SUBNET when set, else the first 10.213.N.0/24 that no route or address of
the root namespace overlaps.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

from rigup_testbed.state import Ledger, TestbedError, run

HUB_HOST = 1
CONTROL_HOST = 254
FIRST_HOST = 11
MAX_HOSTS = 200
IFNAME_MAX = 15


@dataclass(frozen=True)
class Network:
    instance: str
    subnet: ipaddress.IPv4Network

    @property
    def hub_netns(self) -> str:
        return f"{self.instance}-hub"

    @property
    def hub_ip(self) -> str:
        return str(self.subnet[HUB_HOST])

    @property
    def control_ip(self) -> str:
        return str(self.subnet[CONTROL_HOST])

    @property
    def control_link(self) -> str:
        return f"{self.instance}-ctl"

    @property
    def prefixlen(self) -> int:
        return self.subnet.prefixlen

    def host_ip(self, index: int) -> str:
        if not 0 <= index < MAX_HOSTS - FIRST_HOST:
            raise TestbedError(f"host index {index} out of range")
        return str(self.subnet[FIRST_HOST + index])

    def host_netns(self, name: str) -> str:
        return f"{self.instance}-{name}"

    def host_link(self, index: int) -> str:
        return f"{self.instance}-h{index}"


def _root_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix the root namespace routes or owns (the default route excluded)."""
    nets: list[ipaddress.IPv4Network] = []
    for route in json.loads(run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = route.get("dst", "")
        if dst in ("default", "") or route.get("type") in ("broadcast",):
            continue
        try:
            net = ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        if not net.is_loopback:
            nets.append(net)
    for link in json.loads(run(["ip", "-j", "-4", "addr"]).stdout or "[]"):
        for addr in link.get("addr_info", []):
            net = ipaddress.IPv4Network(f"{addr['local']}/{addr['prefixlen']}", strict=False)
            if not net.is_loopback:
                nets.append(net)
    return nets


def pick_subnet(exclude: list[ipaddress.IPv4Network] | None = None) -> ipaddress.IPv4Network:
    """The subnet to use: $RIGUP_TESTBED_SUBNET (must not collide) or the first free 10.213.N.0/24."""
    taken = _root_networks() + list(exclude or [])
    wanted = os.environ.get("RIGUP_TESTBED_SUBNET")
    if wanted:
        subnet = ipaddress.IPv4Network(wanted, strict=True)
        if subnet.prefixlen > 24:
            raise TestbedError(f"RIGUP_TESTBED_SUBNET {subnet} is smaller than a /24")
        clash = [n for n in taken if n.overlaps(subnet)]
        if clash:
            raise TestbedError(f"RIGUP_TESTBED_SUBNET {subnet} overlaps {', '.join(map(str, clash))} in use")
        return subnet
    for third in range(0, 256):
        subnet = ipaddress.IPv4Network(f"10.213.{third}.0/24")
        if not any(n.overlaps(subnet) for n in taken):
            return subnet
    raise TestbedError("no free 10.213.N.0/24; set RIGUP_TESTBED_SUBNET")


def _check_names(net: Network) -> None:
    for name in (net.control_link, net.host_link(MAX_HOSTS - FIRST_HOST - 1)):
        if len(name) > IFNAME_MAX:
            raise TestbedError(f"instance name {net.instance!r} too long: interface {name!r} > {IFNAME_MAX} chars")


def create_hub(ledger: Ledger, net: Network) -> None:
    """Hub namespace with the bridge, and the control link from the root namespace."""
    _check_names(net)
    if Path("/run/netns", net.hub_netns).exists():
        raise TestbedError(f"network namespace {net.hub_netns} already exists (another test bed? try `down`)")
    ledger.add("netns", name=net.hub_netns)
    run(["ip", "netns", "add", net.hub_netns])
    hub = ["ip", "-n", net.hub_netns]
    run([*hub, "link", "set", "lo", "up"])
    run([*hub, "link", "add", "br0", "type", "bridge"])
    run([*hub, "addr", "add", f"{net.hub_ip}/{net.prefixlen}", "dev", "br0"])
    run([*hub, "link", "set", "br0", "up"])
    # Control link: one end stays in the root namespace with .254, the other joins the bridge.
    ledger.add("link", name=net.control_link)
    run(["ip", "link", "add", net.control_link, "type", "veth", "peer", "name", "ctl0", "netns", net.hub_netns])
    run([*hub, "link", "set", "ctl0", "master", "br0", "up"])
    run(["ip", "addr", "add", f"{net.control_ip}/{net.prefixlen}", "dev", net.control_link])
    run(["ip", "link", "set", net.control_link, "up"])


def create_host_netns(ledger: Ledger, net: Network, name: str, index: int) -> str:
    """Namespace for host `name` with eth0 on the hub bridge; returns the host's IP."""
    ns = net.host_netns(name)
    ip = net.host_ip(index)
    if Path("/run/netns", ns).exists():
        raise TestbedError(f"network namespace {ns} already exists")
    ledger.add("netns", name=ns)
    run(["ip", "netns", "add", ns])
    outer = net.host_link(index)
    # Both ends are created inside the namespaces we own; deleting the host namespace removes the pair.
    run(["ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", outer, "netns", net.hub_netns])
    run(["ip", "-n", net.hub_netns, "link", "set", outer, "master", "br0", "up"])
    host = ["ip", "-n", ns]
    run([*host, "link", "set", "lo", "up"])
    run([*host, "addr", "add", f"{ip}/{net.prefixlen}", "dev", "eth0"])
    run([*host, "link", "set", "eth0", "up"])
    run([*host, "route", "add", "default", "via", net.hub_ip])
    # What systemd's sysctl.d sets on a real rig (it cannot inside nspawn: /proc/sys is read-only there).
    run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ping_group_range=0 2147483647"])
    return ip


def shape_port(net: Network, name: str, index: int, rate: str) -> None:
    """Limit host `name`'s port on the bed's switch to `rate` each way (tc tbf on both ends of its veth:
    its uplink at eth0, its downlink at the bridge's side), like a switched LAN of that speed.
    unshape_port takes it off; deleting the namespaces does too."""
    for ns, dev in ((net.host_netns(name), "eth0"), (net.hub_netns, net.host_link(index))):
        run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", rate, "burst", "256k", "latency", "50ms"])  # fmt: skip


def unshape_port(net: Network, name: str, index: int) -> None:
    for ns, dev in ((net.host_netns(name), "eth0"), (net.hub_netns, net.host_link(index))):
        run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
