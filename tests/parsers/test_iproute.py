"""iproute2 JSON parsers and the choice of one private interface towards every cluster peer, on real
captures (tests/fixtures/iproute/README.md says where each comes from)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigup.parsers.iproute import (
    Address,
    IprouteError,
    Link,
    RouteChoice,
    addresses,
    interface_for_peers,
    is_private,
    link_speed_mbps,
    links,
    route_to,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "iproute"


def fx(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_route_to_a_peer_on_an_attached_network() -> None:
    assert route_to(fx("route-get-fab0-peer1.json")) == RouteChoice("10.250.1.2", "fab0", "10.250.1.1", None)
    assert route_to(fx("route-get-fab1-peer.json")) == RouteChoice("10.250.2.2", "fab1", "10.250.2.1", None)
    assert route_to(fx("route-get-lan0-head.json")) == RouteChoice("10.250.1.1", "lan0", "10.250.1.2", None)


def test_route_to_through_a_gateway_names_it() -> None:
    assert route_to(fx("route-get-fab0-via-gateway.json")) == RouteChoice("10.250.9.5", "fab0", "10.250.1.1", "10.250.1.2")
    assert route_to(fx("route-get-eth0-default-gateway.json")) == RouteChoice(
        "198.51.100.7", "eth0", "192.0.2.2", "192.0.2.1"
    )


def test_route_to_ipv6_and_to_this_host() -> None:
    assert route_to(fx("route-get-fab0-ula6.json")) == RouteChoice("fd50::2", "fab0", "fd50::1", None)
    loop = route_to(fx("route-get-loopback.json"))
    assert (loop.dev, loop.src, loop.local) == ("lo", "127.0.0.1", True)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (fx("route-get-unreachable.txt"), "did not print JSON: 'RTNETLINK answers: Network is unreachable'"),
        ("", "printed nothing"),
        ("[]", "printed 0 routes, expected 1"),
        ('{"dst": "10.0.0.1"}', "not a list of objects"),
        ('[{"dst": "10.0.0.1"}]', "'dev' missing or not a str"),
    ],
)
def test_route_to_refuses_what_is_not_one_route(output: str, message: str) -> None:
    with pytest.raises(IprouteError, match=message.replace("(", r"\(").replace(")", r"\)")):
        route_to(output)


def test_addresses_of_the_two_link_head() -> None:
    found = addresses(fx("addr-two-fabric-links.json"))
    assert [(a.ifname, a.family, a.local, a.prefixlen, a.scope) for a in found] == [
        ("lo", "inet", "127.0.0.1", 8, "host"),
        ("lo", "inet6", "::1", 128, "host"),
        ("fab0", "inet", "10.250.1.1", 24, "global"),
        ("fab0", "inet6", "fd50::1", 64, "global"),
        ("fab0", "inet6", "fe80::7455:80ff:fec2:f2c", 64, "link"),
        ("fab1", "inet", "10.250.2.1", 24, "global"),
        ("fab1", "inet6", "fe80::7cec:b6ff:fe51:8ad1", 64, "link"),
    ]
    assert found[2] == Address("fab0", "inet", "10.250.1.1", 24, "global", 1500, "UP")
    assert {a.operstate for a in found if a.ifname == "lo"} == {"UNKNOWN"}


def test_addresses_of_the_host_skip_links_without_any() -> None:
    found = addresses(fx("addr-host.json"))
    assert {a.ifname for a in found} == {"lo", "eth0", "rigrc-ctl"}  # ifb0/ifb1 have none
    eth0 = [a for a in found if a.ifname == "eth0"]
    assert [(a.local, a.mtu) for a in eth0] == [("192.0.2.2", 1400), ("fd00::2", 1400), ("fe80::fc:ff:fe00:1", 1400)]


def test_addresses_refuses_what_ip_does_not_print() -> None:
    with pytest.raises(IprouteError, match="did not print JSON"):
        addresses("1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536")
    with pytest.raises(IprouteError, match="'local' missing"):
        addresses('[{"ifname": "x", "mtu": 1500, "addr_info": [{"family": "inet", "prefixlen": 8}]}]')


def test_links_tell_virtual_from_physical() -> None:
    head = links(fx("link-details-two-fabric-links.json"))
    assert [(k.ifname, k.kind) for k in head] == [("lo", None), ("fab0", "veth"), ("fab1", "veth")]
    host = {k.ifname: k for k in links(fx("link-details-host.json"))}
    assert host["eth0"] == Link("eth0", None, "ether", 1400, "UP", "virtio")
    assert (host["ifb0"].kind, host["ifb0"].operstate) == ("ifb", "DOWN")
    assert host["rigrc-ctl"].kind == "veth"


@pytest.mark.parametrize(
    ("address", "private"),
    [
        ("10.250.1.1", True),
        ("172.16.0.1", True),
        ("172.31.255.254", True),
        ("192.168.1.20", True),
        ("100.64.0.1", True),  # RFC 6598 (CGNAT, Tailscale)
        ("100.127.255.254", True),
        ("169.254.10.1", True),
        ("fd50::1", True),  # ULA
        ("fe80::7455:80ff:fec2:f2c%fab0", True),
        ("::ffff:10.0.0.1", True),
        ("172.32.0.1", False),
        ("100.128.0.1", False),
        ("192.0.2.2", False),  # documentation range: not one of the private networks
        ("8.8.8.8", False),
        ("2001:db8::1", False),
        ("127.0.0.1", False),  # loopback never reaches a peer
        ("::1", False),
        ("not-an-address", False),
    ],
)
def test_is_private(address: str, private: bool) -> None:
    assert is_private(address) is private


def test_one_interface_to_every_peer_is_chosen() -> None:
    choice = interface_for_peers({"rig-b": fx("route-get-fab0-peer1.json"), "rig-c": fx("route-get-fab0-peer2.json")})
    assert choice == ("fab0", "10.250.1.1")
    assert interface_for_peers({"rig-b": fx("route-get-fab0-via-gateway.json")}) == ("fab0", "10.250.1.1")
    assert interface_for_peers({"rig-b": fx("route-get-fab0-ula6.json")}) == ("fab0", "fd50::1")


def test_peers_over_different_interfaces_are_refused_by_name() -> None:
    problem = interface_for_peers({"rig-b": fx("route-get-fab0-peer1.json"), "rig-c": fx("route-get-fab1-peer.json")})
    assert isinstance(problem, str)
    assert "rig-b via fab0 (source 10.250.1.1), rig-c via fab1 (source 10.250.2.1)" in problem
    assert "Gloo connectFullMesh failed" in problem and "#5484" in problem


def test_a_public_source_address_is_refused() -> None:
    problem = interface_for_peers({"rig-b": fx("route-get-eth0-default-gateway.json")})
    assert isinstance(problem, str)
    assert problem.startswith("the peers (rig-b) are reached over eth0 from 192.0.2.2, which is not a private address")


def test_unreachable_and_local_peers_are_refused() -> None:
    problem = interface_for_peers({"rig-b": fx("route-get-fab0-peer1.json"), "rig-x": fx("route-get-unreachable.txt")})
    assert problem == ("no route to peer rig-x: `ip -j route get` did not print JSON: "
                       "'RTNETLINK answers: Network is unreachable'")
    problem = interface_for_peers({"rig-a": fx("route-get-loopback.json")})
    assert problem == "peer rig-a (127.0.0.1) is an address of this host (route via lo): list each rig once"
    assert interface_for_peers({}) == "no peers to reach: a cluster has at least 2 members"


@pytest.mark.parametrize(
    ("name", "speed"),
    [("speed-veth.txt", 10000), ("speed-virtio-unknown.txt", None), ("speed-loopback.txt", None)],
)
def test_link_speed_from_captures(name: str, speed: int | None) -> None:
    assert link_speed_mbps(fx(name)) == speed


def test_link_speed_edge_values() -> None:
    assert link_speed_mbps("1000\n") == 1000
    assert link_speed_mbps("0") is None
    assert link_speed_mbps("") is None
    assert link_speed_mbps(None) is None


def test_parsed_values_serialise_for_pyinfra_facts() -> None:
    assert route_to(fx("route-get-fab0-peer1.json")).to_json() == {
        "dst": "10.250.1.2", "dev": "fab0", "src": "10.250.1.1", "via": None, "local": False,
    }
