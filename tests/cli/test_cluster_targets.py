"""A cluster as the operator tools see it: one endpoint (its head's), each member with its own host
state; verify and bench run against the head and say so for a worker."""

from __future__ import annotations

from pathlib import Path

from rigup.checks.verify import SKIP
from rigup.cli.bench import BenchSettings, bench_target, render_table
from rigup.cli.verify import verify_target
from rigup.client.targets import fleet_targets
from rigup.desired.fleet import load_fleet
from rigup.desired.pod_keys import pod_key

VARIANT = "qwen-multi4-autoround-int4-mtp"


def _targets(tmp_path: Path) -> dict:
    path = tmp_path / "rigs.yaml"
    path.write_text(
        "groups:\n  rigs:\n    hosts:\n"
        "      rig-a: {ssh_hostname: 10.0.0.11}\n"
        "      rig-b: {ssh_hostname: 10.0.0.12}\n"
        f"clusters:\n  - {{name: big, variant: {VARIANT}, hosts: [rig-a, rig-b], port: 8040}}\n"
    )
    pod_key({}, "rig-a", "big", tmp_path)  # the head's pod's key, as the converge made it beside the fleet file
    return {t.name: t for t in fleet_targets(fleet=load_fleet(path))}


def test_the_cluster_is_one_endpoint_its_heads(tmp_path: Path) -> None:
    targets = _targets(tmp_path)
    head, worker = targets["rig-a/big"], targets["rig-b/big"]
    assert head.api_url == worker.api_url == "http://10.0.0.11:8040"
    assert (head.cluster_head, worker.cluster_head) == (None, "rig-a/big")
    assert (worker.host, worker.ssh.hostname) == ("rig-b", "10.0.0.12")  # its own state is read on itself
    assert head.api_key == worker.api_key == pod_key({}, "rig-a", "big", tmp_path)  # the head's pod's key


def test_verify_and_bench_take_the_cluster_once_through_its_head(tmp_path: Path) -> None:
    worker = _targets(tmp_path)["rig-b/big"]
    report = verify_target(worker, options=None, quiet=True)  # type: ignore[arg-type]
    assert [(r.check, r.outcome) for r in report.results] == [("cluster", SKIP)]
    assert "verified as rig-a/big" in report.results[0].detail
    document = bench_target(worker, settings=BenchSettings(), quiet=True)
    assert document["skipped"].startswith("a worker of its cluster: benchmarked as rig-a/big")
    assert "benchmarked as rig-a/big" in render_table([document])
