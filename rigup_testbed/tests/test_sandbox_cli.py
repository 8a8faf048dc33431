"""`rigup sandbox up` on a machine that lacks the test bed's tools says which and to run scripts/setup,
before touching anything."""

from __future__ import annotations

import argparse
import os
import shutil

import pytest

from rigup_testbed import sandbox


def test_missing_tools_are_named_with_their_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool: None if tool in ("debootstrap", "systemd-nspawn") else real(tool))
    assert sandbox.missing_prerequisites()[:2] == ["debootstrap (debootstrap)", "systemd-nspawn (systemd-container)"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the root check comes first")
def test_sandbox_up_refuses_and_points_at_scripts_setup(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool: None if tool == "debootstrap" else "/usr/bin/" + tool)
    monkeypatch.setattr(sandbox, "_testbed", lambda: pytest.fail("the test bed must not be touched"))
    code = sandbox.run(argparse.Namespace(sandbox_command="up", hosts=1, hardware="1x3090", canary=1, replace=False, json=False))
    assert code == 2
    err = capsys.readouterr().err
    assert "this machine lacks debootstrap (debootstrap)" in err and "run scripts/setup" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("members", sorted(sandbox.SANDBOX_CLUSTER_VARIANTS))
def test_the_sandbox_clusters_variant_splits_over_its_two_gpu_rigs(members: int) -> None:
    from rigup.desired.cluster_entries import parse_clusters

    hosts = [f"rig-{i:02d}" for i in range(1, members + 1)]
    (cluster,) = parse_clusters([{"name": "big", "variant": sandbox.SANDBOX_CLUSTER_VARIANTS[members], "hosts": hosts}],
                                hosts)
    assert (cluster.gpus_per_host, cluster.pipeline_parallel) == (2, members)


class FakeBed:
    created = False
    timings: dict = {}
    urls: dict = {}

    def __init__(self) -> None:
        self.specs: list = []
        self.fleet_kwargs: dict = {}
        self.ledger = argparse.Namespace(info={"subnet": "10.99.0.0/24", "hub_ip": "10.99.0.1"}, path="ledger")

    def up(self, specs: list) -> None:
        self.specs = specs

    def write_fleet(self, path, **kwargs):
        self.fleet_kwargs = kwargs
        return path

    def status(self) -> list:
        return []


@pytest.mark.skipif(os.geteuid() != 0, reason="the root check comes first")
def test_sandbox_up_with_a_cluster_writes_it_into_the_fleet_file(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bed = FakeBed()
    monkeypatch.setattr(sandbox, "_testbed", lambda: bed)
    monkeypatch.setattr(sandbox, "missing_prerequisites", lambda: [])
    args = argparse.Namespace(sandbox_command="up", hosts=3, hardware="1x3090", canary=1, gateway=1, pods=0, cluster=2,
                              replace=False, json=True, verbose=False)
    assert sandbox.run(args) == 0
    assert [(s.name, s.hardware) for s in bed.specs] == [("rig-01", "2x3090"), ("rig-02", "2x3090"), ("rig-03", "1x3090")]
    assert bed.fleet_kwargs["clusters"] == [{"name": "big", "variant": "qwen-multi4-autoround-int4-mtp",
                                             "hosts": ["rig-01", "rig-02"]}]
    capsys.readouterr()
    assert sandbox.run(argparse.Namespace(**{**vars(args), "hosts": 2, "pods": 1})) == 2
    assert "--cluster N needs N rigs" in capsys.readouterr().err
