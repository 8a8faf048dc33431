"""A cluster member's network decided from what it read (rigup.desired.cluster.member_net), on captured
`ip -j route get` output (tests/fixtures/iproute)."""

from __future__ import annotations

from pathlib import Path

from rigup.checks.preflight import check_cluster_network
from rigup.desired.cluster import (
    Cluster,
    ClusterNet,
    MemberNetwork,
    clock_skew,
    member_data,
    member_net,
    mtu_disagreement,
)
from rigup.parsers.iproute import PeerRoutes

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "iproute"
TRIO = Cluster("big", "qwen-multi4-autoround-int4-mtp", ("rig-a", "rig-b", "rig-c"), 2, {})


def _route(name: str) -> str:
    return (FIXTURES / f"route-get-{name}.json").read_text()


def _read(routes: dict[str, str], speed: int | None = 10_000, mtu: int = 1500, **addresses: str | None) -> PeerRoutes:
    return PeerRoutes(addresses={**{p: "10.250.1.9" for p in routes}, **addresses}, routes=routes,
                      mtu={"fab0": mtu, "fab1": mtu, "eth0": 1500}, speed_mbps={"fab0": speed, "fab1": speed})


def test_the_head_advertises_its_own_address_on_the_one_interface_to_every_member() -> None:
    got = member_net(TRIO, "rig-a", _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab0-peer2")}))
    assert got.problem is None and got.net == ClusterNet("fab0", "10.250.1.1", "10.250.1.1")
    assert (got.mtu, got.speed_mbps, got.warnings) == (1500, 10_000, ())


def test_a_worker_joins_the_head_at_the_address_it_resolves_it_to() -> None:
    read = _read({"rig-a": _route("fab0-peer1"), "rig-c": _route("fab0-peer2")}, **{"rig-a": "10.250.1.2"})
    got = member_net(TRIO, "rig-b", read)
    assert got.net == ClusterNet("fab0", "10.250.1.1", "10.250.1.2")


def test_members_over_two_interfaces_are_refused_naming_each() -> None:
    got = member_net(TRIO, "rig-a", _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab1-peer")}))
    assert got.net is None
    assert got.problem is not None and got.problem.startswith("clusters[0] (big) on rig-a: the peers are reached over "
                                                              "different interfaces")
    assert "rig-b via fab0 (source 10.250.1.1)" in got.problem and "rig-c via fab1 (source 10.250.2.1)" in got.problem


def test_a_public_source_address_is_refused() -> None:
    read = _read({"rig-b": _route("eth0-default-gateway"), "rig-c": _route("eth0-default-gateway")})
    got = member_net(TRIO, "rig-a", read)
    assert got.net is None and "192.0.2.2, which is not a private address" in str(got.problem)


def test_a_member_that_does_not_resolve_is_named() -> None:
    read = _read({"rig-b": _route("fab0-peer1"), "rig-c": ""}, **{"rig-c": None})
    assert member_net(TRIO, "rig-a", read).problem == ("rig-c (member of clusters[0] (big)) does not resolve to an "
                                                       "IPv4 address on rig-a")


def test_a_slow_unknown_or_routed_link_is_a_warning_with_its_cost() -> None:
    slow = member_net(TRIO, "rig-a", _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab0-peer2")}, speed=1000))
    assert slow.net is not None and "at 1000 Mb/s, below 10 GbE" in slow.warnings[0] and "#11874" in slow.warnings[0]
    unknown = member_net(TRIO, "rig-a", _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab0-peer2")}, speed=None))
    assert "link speed on fab0 is unknown" in unknown.warnings[0]
    routed = member_net(TRIO, "rig-a", _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab0-via-gateway")}))
    assert routed.net is not None and routed.warnings[0] == ("rig-a reaches rig-c through a gateway: members on one "
                                                             "switched network keep NCCL and Ray off the router")


def test_members_must_agree_on_the_mtu() -> None:
    nets = [MemberNetwork("rig-a", None, None, mtu=9000), MemberNetwork("rig-b", None, None, mtu=1500)]
    assert mtu_disagreement(nets) == ("the members' interfaces disagree on the MTU (rig-a 9000, rig-b 1500): set one "
                                      "MTU on the cluster's network")
    assert mtu_disagreement(nets[:1]) is None


def test_preflight_fails_a_member_it_cannot_wire_and_reports_what_it_chose() -> None:
    bad = member_net(TRIO, "rig-a", _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab1-peer")}))
    (check,) = check_cluster_network(bad, [])
    assert check.failed and check.key == "clusters" and "different interfaces" in check.message
    good = member_net(TRIO, "rig-a", _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab0-peer2")}, speed=1000))
    checks = check_cluster_network(good, [MemberNetwork("rig-b", None, None, mtu=1500)])
    assert [(c.ok, c.severity) for c in checks] == [(False, "warning"), (True, "info")]
    assert checks[-1].message == "fab0 (1000 Mb/s, MTU 1500): this member is 10.250.1.1, the head 10.250.1.1"
    jumbo = check_cluster_network(good, [MemberNetwork("rig-b", None, None, mtu=9000)])
    assert any(c.failed and "disagree on the MTU" in c.message for c in jumbo)
    assert check_cluster_network(None, []) == []


def test_a_named_socket_interface_is_what_nccl_and_gloo_bind_to_when_the_member_has_it() -> None:
    read = _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab0-peer2")})
    named = Cluster("big", TRIO.variant, TRIO.hosts, 2, {}, 0, "fab1")
    got = member_net(named, "rig-a", read)
    assert got.net == ClusterNet("fab1", "10.250.1.1", "10.250.1.1")  # Ray and vLLM keep the routed address
    assert "socket_interface 'fab1' on rig-a is not fab0" in got.warnings[0] and "rendezvous fails" in got.warnings[0]
    assert member_net(TRIO, "rig-a", read).net == ClusterNet("fab0", "10.250.1.1", "10.250.1.1")
    same = member_net(Cluster("big", TRIO.variant, TRIO.hosts, 2, {}, 0, "fab0"), "rig-a", read)
    assert same.net == ClusterNet("fab0", "10.250.1.1", "10.250.1.1") and same.warnings == ()
    missing = member_net(Cluster("big", TRIO.variant, TRIO.hosts, 2, {}, 0, "ib0"), "rig-a", read)
    assert missing.net is None
    assert missing.problem == "clusters[0] (big): socket_interface: 'ib0' is not an interface of rig-a (interfaces: eth0, fab0, fab1)"


def test_members_clocks_far_apart_are_named() -> None:
    nets = [MemberNetwork("rig-a", None, None, clock_offset_s=0.02), MemberNetwork("rig-b", None, None, clock_offset_s=-4.5)]
    assert clock_skew(nets) == ("the members' clocks are 4.5 s apart (against the control machine's: rig-a +0.0 s, rig-b "
                                "-4.5 s): one request's logs and metrics on the head and the workers will not line up; "
                                "sync them (timedatectl set-ntp true)")
    assert clock_skew([nets[0], MemberNetwork("rig-b", None, None, clock_offset_s=0.9)]) is None
    assert clock_skew([nets[0], MemberNetwork("rig-b", None, None)]) is None  # unread: nothing to compare
    good = member_net(TRIO, "rig-a", PeerRoutes({"rig-b": "10.250.1.9", "rig-c": "10.250.1.9"},
                                                {"rig-b": _route("fab0-peer1"), "rig-c": _route("fab0-peer2")},
                                                {"fab0": 1500}, {"fab0": 10_000}, clock_offset_s=3.0))
    checks = check_cluster_network(good, [MemberNetwork("rig-b", None, None, mtu=1500, clock_offset_s=0.0)])
    assert [(c.name, c.severity) for c in checks if not c.ok] == [("cluster-clock", "warning")]


def test_the_network_read_fills_the_members_cluster_knob_and_a_problem_leaves_it_unread() -> None:
    """What the deploy renders from and `rigup status` compares with (rigup.desired.cluster.member_data)."""
    data = {"variant": TRIO.variant, "cluster": {"name": "big", "rank": 0}}
    read = _read({"rig-b": _route("fab0-peer1"), "rig-c": _route("fab0-peer2")})
    filled = member_data(data, member_net(TRIO, "rig-a", read))
    assert filled["cluster"] == {"name": "big", "rank": 0,
                                 "net": {"ifname": "fab0", "address": "10.250.1.1", "head_address": "10.250.1.1"}}
    assert "net" not in data["cluster"]  # the fleet's data is not changed
    unresolved = member_net(TRIO, "rig-a", _read({"rig-b": _route("fab0-peer1"), "rig-c": ""}, **{"rig-c": None}))
    assert unresolved.problem is not None and member_data(data, unresolved) == data
    assert member_data(data, None) == data
