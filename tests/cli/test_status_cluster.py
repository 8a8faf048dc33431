"""`rigup status` on a cluster's members (issue 41): right after a converge, each member's desired release is
the one the converge recorded, so status says OK (exit 0), not DRIFT. The converge's side is rendered through
the serving task's plans (rigup.operations.serving_plans.PodPlans) on a fresh rig whose driver arrives while
the deploy runs, with the member's network and the GPU topology as a test-bed rig reports them; status reads
the same facts from a scripted rig."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rigup.cli import status as S
from rigup.client.targets import Target, fleet_targets
from rigup.desired.cluster import cluster_of, member_data, member_net
from rigup.desired.fleet import Fleet, load_fleet
from rigup.desired.fleet_plan import fleet_entries, plan_fleet
from rigup.desired.knobs import knob
from rigup.desired.release import parse_provenance
from rigup.facts.gpu import GpuTopology
from rigup.operations.serving_plans import PodPlans
from rigup.parsers.iproute import parse_peer_routes
from tests.cli.test_status import BOOTED, SMI_2X3090, LocalRunner, provenance
from tests.support.bed_topology import bed_topology_output
from tests.support.fit_fake import offline_lock
from tests.support.opharness import ScriptedHost, scripted

VARIANT = "qwen-multi4-autoround-int4-mtp"  # upstream's entrypoint sources detect_nvlink.sh: NVLINK_MODE
ADDRESS = {"rig-a": "10.0.0.11", "rig-b": "10.0.0.12"}
HEALTHY = S.Health(True, "serves qwen3.6-27b-autoround-int4 (12 ms)")


def fleet(tmp_path: Path) -> Fleet:
    key = tmp_path / "api.key"
    key.write_text("sk-status-cluster-0f3b9e21c7\n")
    key.chmod(0o600)
    path = tmp_path / "rigs.yaml"
    path.write_text(
        f"data: {{serving_api_key_file: {key}, lock_file: {tmp_path / 'rigs.lock.yaml'}}}\n"
        "groups:\n  rigs:\n    hosts:\n"
        + "".join(f"      {name}: {{ssh_hostname: {address}}}\n" for name, address in ADDRESS.items())
        + f"clusters:\n  - {{name: big, variant: {VARIANT}, hosts: [rig-a, rig-b], port: 8040}}\n"
    )
    loaded = load_fleet(path)
    offline_lock(loaded.resolved_data("rig-a"), tmp_path / "rigs.lock.yaml")
    return loaded


def peer_routes_output(host: str, resolves: bool = True) -> str:
    """What ClusterPeerRoutes prints on `host`: one LAN, the other member reached directly over lan0."""
    lines = []
    for peer, address in ADDRESS.items():
        if peer == host:
            continue
        route = {"dst": address, "dev": "lan0", "prefsrc": ADDRESS[host], "flags": [], "uid": 0, "cache": []}
        lines += [f"==> peer {peer} {address if resolves else '-'}"] + ([json.dumps([route])] if resolves else [])
    lines += ["==> local_ports 32768 60999", "==> links", "lo 65536 -1", "lan0 1500 10000", "==> clock 1764900000.0"]
    return "\n".join(lines) + "\n"


def converged_release(data: dict[str, Any], host: str) -> dict[str, Any]:
    """The release the first converge of a fresh member records: planned with no driver (no topology), its
    files written after the driver task ran, from the host data with its network read (cluster_host_data)."""
    network = member_net(cluster_of(knob(data, "cluster")), host, parse_peer_routes(peer_routes_output(host)))
    rig = ScriptedHost({GpuTopology: GpuTopology().process(bed_topology_output().splitlines())}, name=host)
    with scripted(rig, False):
        plans = PodPlans(rig, member_data(data, network), None, require_lock=False)
    with scripted(rig, True):
        (plan,) = plans.now()
    assert plan.release is not None
    return dict(plan.release)


def converged_rig(release: dict[str, Any], host: str) -> LocalRunner:
    """The member as the converge left it: its record, its unit running, its files as recorded, its GPUs,
    topology and routes as a test-bed rig reports them."""
    text = provenance(release)
    hashes = "".join(f"{key} {sha}\n" for key, sha in parse_provenance(text).files.items())

    class Rig(LocalRunner):
        def close(self) -> None:
            pass

    return Rig({
        "pid1=": BOOTED,
        "sha256sum": hashes,
        "provenance.json": text,
        "rigup-*.service": f"{release['unit']} enabled active\n",
        "--query-gpu=index,name": SMI_2X3090,
        "--query-gpu=index,memory.used": "0, 22100, 24576\n1, 21900, 24576\n",
        "nvidia-smi topo -m": bed_topology_output(),
        "getent ahostsv4": peer_routes_output(host),
    })


def statuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rigs: dict[str, LocalRunner]) -> dict[str, S.HostStatus]:
    loaded = fleet(tmp_path)
    targets: list[Target] = fleet_targets(fleet=loaded)
    monkeypatch.setattr(S, "check_health", lambda target: HEALTHY)
    found = {}
    for target in targets:
        assert target.host is not None
        monkeypatch.setattr(S, "LazySsh", lambda settings, rig=rigs[target.host]: rig)
        found[target.host] = S.host_status(target, quiet=True, peers=plan_fleet(fleet_entries(loaded)).cluster_peers(target.host))
    return found


def test_right_after_a_converge_both_members_are_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = fleet(tmp_path)
    rigs = {host: converged_rig(converged_release(loaded.resolved_data(host), host), host) for host in ADDRESS}
    found = statuses(tmp_path, monkeypatch, rigs)
    for host, status in found.items():
        drifted = [(i.item, i.desired, i.actual) for i in status.items if i.state != S.OK and i.state != S.INFO]
        assert drifted == [], (host, drifted)
        assert status.verdict == "OK"
    assert S.exit_code(list(found.values())) == 0
    # the worker's gate asks the head at the address the worker reaches it by, not a compose variable
    release = json.loads(provenance(converged_release(loaded.resolved_data("rig-b"), "rig-b")))["release"]
    assert release["health_url"] == "http://10.0.0.11:8040/v1/models"


def test_status_reads_each_members_routes_to_the_others_as_the_deploy_does(tmp_path: Path) -> None:
    loaded = fleet(tmp_path)
    planned = plan_fleet(fleet_entries(loaded))  # what cmd_status asks
    assert planned.cluster_peers("rig-a") == {"rig-b": "10.0.0.12"}
    assert planned.cluster_peers("rig-b") == {"rig-a": "10.0.0.11"}
    rig = converged_rig(converged_release(loaded.resolved_data("rig-b"), "rig-b"), "rig-b")
    gathered = S.gather_facts(rig, "/opt/rigup", "/opt/rigup/state/pods/big/provenance.json", {"rig-a": "10.0.0.11"})
    assert gathered.peer_routes is not None and gathered.peer_routes.addresses == {"rig-a": "10.0.0.11"}
    (command,) = [c for c, _ in rig.commands if "getent ahostsv4" in c]
    assert "'10.0.0.11'" in command or "10.0.0.11" in command


def test_a_member_that_cannot_reach_the_others_is_unhealthy_saying_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = fleet(tmp_path)
    rigs = {host: converged_rig(converged_release(loaded.resolved_data(host), host), host) for host in ADDRESS}
    rigs["rig-b"].canned["getent ahostsv4"] = peer_routes_output("rig-b", resolves=False)
    found = statuses(tmp_path, monkeypatch, rigs)
    (network,) = [i for i in found["rig-b"].items if i.item == "cluster network"]
    assert network.state == S.UNHEALTHY
    assert network.actual == "rig-a (member of clusters[0] (big)) does not resolve to an IPv4 address on rig-b"
    assert found["rig-a"].verdict == "OK"
