"""The fleet's boundary (rigup.desired.boundary): holes from the FleetPlan's roles, firewall_allow's checks,
and the rendered table checked by the real nft and applied in network namespaces, Docker-style published
(DNAT'd) ports included."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup.desired.boundary import (
    CONTROL,
    TABLE,
    BoundaryError,
    Hole,
    holes,
    host_rules,
    parse_allow,
    peer_hostnames,
    rules,
    table_text,
)
from rigup.desired.fleet import load_fleet
from rigup.desired.fleet_plan import FleetPlan, fleet_entries, plan_fleet
from rigup.desired.knobs import KnobError, check_knob

NFT = shutil.which("nft")
needs_nft = pytest.mark.skipif(NFT is None or os.geteuid() != 0, reason="needs root and nft (scripts/setup installs it)")

FLEET = """
    data:
      image_mirror_host: rig-01
    groups:
      rigs:
        hosts:
          rig-01: {ssh_hostname: 10.0.0.1}
          rig-02: {ssh_hostname: 10.0.0.2}
      gateway:
        data: {serves_variant: false}
        hosts:
          gw: {ssh_hostname: 10.0.0.9, image_mirror_host: null, gateway_api_key_file: KEY}
"""


def fleet_plan(tmp_path: Path, text: str = FLEET) -> FleetPlan:
    key = tmp_path / "gateway.key"
    key.write_text("sk-gateway\n")
    key.chmod(0o600)
    path = tmp_path / "rigs.yaml"
    path.write_text(textwrap.dedent(text).replace("KEY", str(key)))
    return plan_fleet(fleet_entries(load_fleet(path)))


def by_service(fleet: FleetPlan, name: str) -> dict[str, Hole]:
    return {hole.service: hole for hole in holes(fleet, name)}


def test_each_service_admits_the_members_that_use_it(tmp_path: Path) -> None:
    fleet = fleet_plan(tmp_path)
    rig = by_service(fleet, "rig-01")
    assert rig["SSH"].sources is None and rig["SSH"].ports == ("22",)
    pod_port = str(fleet.pods("rig-01")[0].recipe.host_port)
    assert rig["each pod's vLLM API"] == Hole("each pod's vLLM API", (pod_port,), ("gw", CONTROL))
    assert rig["node_exporter"].ports == ("9100",) and rig["node_exporter"].sources == ("gw", CONTROL)
    assert rig["the DCGM exporter (Docker-published)"].ports == ("9400",)
    assert rig["the image mirror (registry)"] == Hole("the image mirror (registry)", ("5000",), ("rig-02",))
    assert rig["the chain server (models and images rig to rig)"].sources == ("rig-02",)
    assert "the entrance (the fleet's API)" not in rig and "Prometheus" not in rig
    gateway = by_service(fleet, "gw")
    assert gateway["the entrance (the fleet's API)"] == Hole("the entrance (the fleet's API)", ("4000",), None)
    assert gateway["Prometheus"] == Hole("Prometheus", ("9090",), (CONTROL,))
    assert set(gateway) == {"SSH", "the entrance (the fleet's API)", "Prometheus"}
    assert peer_hostnames(fleet, "rig-01") == {"rig-02": "10.0.0.2", "gw": "10.0.0.9"}


def test_node_exporter_admits_the_entrance_which_reads_the_sentinels_quarantines(tmp_path: Path) -> None:
    # the monitor on a host of its own: the entrance (rigup-quarantine-routes) still reads each rig's node_exporter
    text = FLEET.replace("      image_mirror_host: rig-01\n", "      image_mirror_host: rig-01\n      monitor_group: monitors\n")
    text += """      monitors:
        data: {serves_variant: false}
        hosts:
          mon: {ssh_hostname: 10.0.0.8, image_mirror_host: null}
"""
    rig = by_service(fleet_plan(tmp_path, text), "rig-01")
    assert rig["node_exporter"].sources == ("gw", "mon", CONTROL)
    assert rig["the DCGM exporter (Docker-published)"].sources == ("mon", CONTROL)


def test_a_host_taken_out_of_a_role_loses_its_holes(tmp_path: Path) -> None:
    # rig-02 no longer pulls through rig-01's mirror, and no rig is in the chains: their holes go
    text = FLEET.replace("rig-02: {ssh_hostname: 10.0.0.2}",
                         "rig-02: {ssh_hostname: 10.0.0.2, image_mirror_host: null, model_fleet_source: 'off'}")
    rig = by_service(fleet_plan(tmp_path, text), "rig-01")
    assert "the image mirror (registry)" not in rig  # nobody else pulls through it
    assert "the chain server (models and images rig to rig)" not in rig  # no peer in the chains
    assert "each pod's vLLM API" in rig and "SSH" in rig


def test_a_cluster_member_admits_its_members_to_every_port(tmp_path: Path) -> None:
    text = FLEET + textwrap.indent(textwrap.dedent("""
        clusters:
          - name: big
            variant: qwen-multi4-autoround-int4-mtp
            hosts: [rig-01, rig-02]
    """), "    ")
    fleet = fleet_plan(tmp_path, text)
    ray = by_service(fleet, "rig-02")["Ray, NCCL, Gloo (a cluster)"]
    assert ray == Hole("Ray, NCCL, Gloo (a cluster)", ("1-65535",), ("rig-01",))
    assert "Ray, NCCL, Gloo (a cluster)" not in by_service(fleet, "gw")


def test_firewall_allow_is_checked_with_one_line_naming_the_entry() -> None:
    assert check_knob("firewall_allow", ["192.168.1.0/24", "10.8.0.5 8000-8100", "fd00::/8 22"])
    with pytest.raises(KnobError, match=r"'firewall_allow': '10.0.0.300' in '10.0.0.300' is not an address"):
        check_knob("firewall_allow", ["10.0.0.300"])
    with pytest.raises(KnobError, match=r"'9000-8000' in '10.0.0.1 9000-8000' is not a port"):
        check_knob("firewall_allow", ["10.0.0.1 9000-8000"])
    assert [(str(a.network), a.ports) for a in parse_allow(["10.8.0.5 8000-8100"])] == [("10.8.0.5/32", "8000-8100")]


def test_a_peer_that_does_not_resolve_stops_the_run_naming_it(tmp_path: Path) -> None:
    fleet = fleet_plan(tmp_path)
    with pytest.raises(BoundaryError, match=r"cannot admit gw \(10.0.0.9\): the name does not resolve on this host"):
        host_rules(fleet, "rig-01", "10.0.0.254", {"rig-02": ["10.0.0.2"], "gw": []})


def _text() -> str:
    return table_text("rfba", rules("rfba", [Hole("SSH", ("22",), None), Hole("API", ("8030", "9400"), ("mon",)),
                                             Hole("cluster", ("1-65535",), ("peer",))],
                                    {"mon": ["10.254.1.2", "fd00::2"], "peer": ["10.254.1.3"]},
                                    parse_allow(["192.168.7.0/24", "10.254.1.8 7000"])))


def test_the_table_is_default_deny_and_replaces_only_rigups_table() -> None:
    text = _text()
    assert text.count(f"table inet {TABLE}") == 3  # declare, delete, define: re-applying replaces it alone
    assert "type filter hook input priority filter - 2; policy drop;" in text
    assert "ip saddr { 10.254.1.2 } tcp dport { 8030, 9400 } accept" in text
    assert "ip6 saddr { fd00::2 } tcp dport { 8030, 9400 } accept" in text
    assert "ip saddr { 10.254.1.2 } meta l4proto tcp ct original proto-dst { 8030, 9400 } accept" in text
    assert "ip saddr { 192.168.7.0/24 } accept" in text and "ip saddr { 10.254.1.8/32 } tcp dport { 7000 } accept" in text


@needs_nft
def test_nft_accepts_the_table(tmp_path: Path) -> None:
    path = tmp_path / "rules.nft"
    path.write_text(_text())
    proc = subprocess.run([str(NFT), "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


# namespace names of this process (another test process may run this test at the same time)
NS = f"rfb{os.getpid() % 100000}"


@pytest.fixture
def lan() -> Iterator[None]:
    """The guarded host (NS+a, 10.254.1.1) with a "container" behind it (NS+c, 172.30.9.2, reached by DNAT of
    port 9400 as Docker publishes one), the monitor (NS+m, .2), a cluster peer (NS+p, .3) and an outsider
    (NS+x, .9), on one bridge (NS+br); each namespace is its own network, so the addresses do not collide."""
    hosts = {f"{NS}a": "10.254.1.1", f"{NS}m": "10.254.1.2", f"{NS}p": "10.254.1.3", f"{NS}x": "10.254.1.9"}
    names = [*hosts, f"{NS}c", f"{NS}br"]
    try:
        _ip("netns", "add", f"{NS}br")
        _ip("-n", f"{NS}br", "link", "add", "br0", "type", "bridge")
        _ip("-n", f"{NS}br", "link", "set", "br0", "up")
        for name, address in hosts.items():
            _ip("netns", "add", name)
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p-{name}", "netns", f"{NS}br")
            _ip("-n", f"{NS}br", "link", "set", f"p-{name}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("netns", "add", f"{NS}c")
        _ip("-n", f"{NS}a", "link", "add", "ctr0", "type", "veth", "peer", "name", "eth0", "netns", f"{NS}c")
        _ip("-n", f"{NS}a", "addr", "add", "172.30.9.1/24", "dev", "ctr0")
        _ip("-n", f"{NS}a", "link", "set", "ctr0", "up")
        _ip("-n", f"{NS}c", "addr", "add", "172.30.9.2/24", "dev", "eth0")
        _ip("-n", f"{NS}c", "link", "set", "eth0", "up")
        _ip("-n", f"{NS}c", "route", "add", "default", "via", "172.30.9.1")
        subprocess.run(["ip", "netns", "exec", f"{NS}a", "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True, timeout=30)
        docker_like = ("table ip dockerlike {\n chain prerouting {\n  type nat hook prerouting priority dstnat;\n"
                       "  tcp dport 9400 dnat to 172.30.9.2:9400\n }\n}\n")
        subprocess.run(["ip", "netns", "exec", f"{NS}a", str(NFT), "-f", "-"], input=docker_like, text=True, check=True,
                       timeout=30)
        yield
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _connects(source: str, address: str, port: int) -> bool:
    probe = (f"import socket; s = socket.socket(); s.settimeout(1.5); "
             f"print(s.connect_ex(({address!r}, {port})))")
    proc = subprocess.run(["ip", "netns", "exec", source, "python3", "-c", probe], capture_output=True, text=True,
                          timeout=30)
    return proc.stdout.strip() == "0"


@needs_nft
def test_only_the_holes_answer_published_ports_included(lan: None, tmp_path: Path) -> None:
    listen = "import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {})); s.listen(8); time.sleep(60)"
    servers = [subprocess.Popen(["ip", "netns", "exec", f"{NS}a", "python3", "-c", listen.format(port)])
               for port in (22, 8030, 6379)]
    servers.append(subprocess.Popen(["ip", "netns", "exec", f"{NS}c", "python3", "-c", listen.format(9400)]))
    ports = (22, 8030, 6379, 9400)  # SSH, a pod, Ray's GCS, the DCGM exporter published by DNAT
    try:
        time.sleep(0.5)
        assert [_connects(f"{NS}x", "10.254.1.1", p) for p in ports] == [True] * 4  # no table yet: all answer
        path = tmp_path / "rules.nft"
        path.write_text(_text())
        for _ in range(2):  # loading it again replaces it
            subprocess.run(["ip", "netns", "exec", f"{NS}a", str(NFT), "-f", str(path)], check=True, timeout=30)
        assert [_connects(f"{NS}x", "10.254.1.1", p) for p in ports] == [True, False, False, False]
        assert [_connects(f"{NS}m", "10.254.1.1", p) for p in ports] == [True, True, False, True]
        assert [_connects(f"{NS}p", "10.254.1.1", p) for p in ports] == [True, True, True, True]
        assert _connects(f"{NS}a", "127.0.0.1", 8030)  # the host itself
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
