"""The cluster firewall rigup writes (rigup.desired.cluster.firewall_text), checked by the real nft and
applied in network namespaces: a member reaches Ray's pinned ports and the ephemeral range, a host
outside the cluster does not, and the API port stays open to everyone."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigup.desired.cluster import FIREWALL_TABLE, Cluster, RayPorts, firewall_text

CLUSTER = Cluster("big", "qwen-multi4-autoround-int4-mtp", ("rig-a", "rig-b"), 2, {})
PORTS = RayPorts(6379, 6380, 6381, 52365, 10002, 10100)
NFT = shutil.which("nft")
needs_nft = pytest.mark.skipif(NFT is None or os.geteuid() != 0, reason="needs root and nft (scripts/setup installs it)")


def _rules() -> str:
    return firewall_text(CLUSTER, {"rig-a": "10.254.0.1", "rig-b": "10.254.0.2"}, PORTS, (32768, 60999), 8030)


def test_the_rules_admit_the_members_to_every_ray_port_and_the_ephemeral_range() -> None:
    text = _rules()
    assert "elements = { 10.254.0.1, 10.254.0.2 }" in text
    assert "tcp dport { 6379, 6380, 6381, 52365-52368, 10002-10100, 32768-60999 } ct state new drop" in text
    assert text.index("ip saddr @members accept") < text.index("tcp dport 8030 accept") < text.index("drop")
    assert text.count(f"table inet {FIREWALL_TABLE}") == 3  # declare, delete, define: re-applying replaces it


@needs_nft
def test_nft_accepts_the_rules(tmp_path: Path) -> None:
    path = tmp_path / "rules.nft"
    path.write_text(_rules())
    proc = subprocess.run([str(NFT), "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def lan() -> Iterator[dict[str, str]]:
    """Three hosts on one bridge: the member the rules guard (rfwa, 10.254.0.1), another member (rfwb,
    10.254.0.2) and an outsider (rfwx, 10.254.0.9)."""
    names = {"rfwa": "10.254.0.1", "rfwb": "10.254.0.2", "rfwx": "10.254.0.9"}
    try:
        _ip("netns", "add", "rfwbr")
        _ip("-n", "rfwbr", "link", "add", "br0", "type", "bridge")
        _ip("-n", "rfwbr", "link", "set", "br0", "up")
        for name, address in names.items():
            _ip("netns", "add", name)
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p-{name}", "netns", "rfwbr")
            _ip("-n", "rfwbr", "link", "set", f"p-{name}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in [*names, "rfwbr"]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _connects(source: str, address: str, port: int) -> bool:
    probe = (f"import socket; s = socket.socket(); s.settimeout(1.5); "
             f"print(s.connect_ex(({address!r}, {port})))")
    proc = subprocess.run(["ip", "netns", "exec", source, "python3", "-c", probe], capture_output=True, text=True,
                          timeout=30)
    return proc.stdout.strip() == "0"


@needs_nft
def test_outside_the_cluster_no_ray_or_nccl_port_answers(lan: dict[str, str], tmp_path: Path) -> None:
    listeners = []
    ports = (6379, 10050, 40000, 8030)  # the GCS, a Ray worker, an ephemeral (NCCL-like) one, the API
    try:
        for port in ports:
            listeners.append(subprocess.Popen(
                ["ip", "netns", "exec", "rfwa", "python3", "-c",
                 f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {port})); s.listen(8); time.sleep(60)"]))
        time.sleep(0.5)
        assert all(_connects("rfwx", "10.254.0.1", port) for port in ports)  # no rules yet: everything answers
        path = tmp_path / "rules.nft"
        path.write_text(firewall_text(CLUSTER, {"rig-a": "10.254.0.1", "rig-b": "10.254.0.2"}, PORTS,
                                      (32768, 60999), 8030))
        subprocess.run(["ip", "netns", "exec", "rfwa", str(NFT), "-f", str(path)], check=True, timeout=30)
        subprocess.run(["ip", "netns", "exec", "rfwa", str(NFT), "-f", str(path)], check=True, timeout=30)  # again
        assert [_connects("rfwb", "10.254.0.1", port) for port in ports] == [True] * 4  # the other member
        assert [_connects("rfwx", "10.254.0.1", port) for port in ports] == [False, False, False, True]
    finally:
        for proc in listeners:
            proc.kill()
            proc.wait()
