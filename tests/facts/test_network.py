"""rigup.facts.network.ClusterPeerRoutes: its command run here (sh, as pyinfra runs it) and parsed."""

from __future__ import annotations

import subprocess

import pytest

from rigup.facts.network import ClusterPeerRoutes
from rigup.parsers.iproute import IprouteError, parse_peer_routes, route_to


def test_the_command_reads_each_peers_address_and_route_and_every_links_mtu() -> None:
    command = ClusterPeerRoutes().command({"me": "127.0.0.1", "ghost": "no-such-host.invalid"})
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    read = ClusterPeerRoutes().process(proc.stdout.splitlines())
    assert read.addresses == {"me": "127.0.0.1", "ghost": None}
    assert route_to(read.routes["me"]).local and read.routes["ghost"] == ""
    assert read.mtu["lo"] == 65536 and read.speed_mbps["lo"] is None  # loopback has no speed


def test_the_ephemeral_port_range_is_read() -> None:
    command = ClusterPeerRoutes().command({"me": "127.0.0.1"})
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    first, last = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
    assert ClusterPeerRoutes().process(proc.stdout.splitlines()).local_ports == (int(first), int(last))


def test_the_hosts_clock_is_compared_with_the_readers_as_the_output_arrives() -> None:
    command = ClusterPeerRoutes().command({"me": "127.0.0.1"})
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    offset = ClusterPeerRoutes().process(proc.stdout.splitlines()).clock_offset_s
    assert offset is not None and -5 < offset <= 0  # the same clock, read just before the output arrived
    lines = proc.stdout.splitlines()
    assert lines[-1].startswith("==> clock ")
    assert parse_peer_routes([*lines[:-1], "==> clock 1000.5"], received_at=1003.0).clock_offset_s == -2.5
    assert parse_peer_routes(lines[:-1]).clock_offset_s is None
    with pytest.raises(IprouteError, match="bad clock line"):
        parse_peer_routes(["==> clock soon"])
