"""The fleet file: good files load into pyinfra groups, bad ones fail naming file, host and key."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rigup import REPO_ROOT
from rigup.desired.fleet import FleetError, load_fleet


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rigs.yaml"
    path.write_text(textwrap.dedent(text))
    return path


GOOD = """
    data:
      variant: dual
      gpu_power_cap_watts: 250
    groups:
      canary:
        hosts:
          rig-01: {ssh_hostname: 10.0.0.1, ssh_user: ops, gpu_count: 2}
      rigs:
        data: {variant: dual-dflash, gpu_power_cap_watts: 280}
        hosts:
          rig-02: {ssh_hostname: 10.0.0.2, gpu_power_cap_watts: 300}
          rig-03:
"""


def test_good_file_merges_fleet_group_and_host_data(tmp_path):
    fleet = load_fleet(write(tmp_path, GOOD))
    assert [h.name for h in fleet.hosts] == ["rig-01", "rig-02", "rig-03"]
    assert fleet.host("rig-01").data == {
        "variant": "dual", "gpu_power_cap_watts": 250,
        "ssh_hostname": "10.0.0.1", "ssh_user": "ops", "gpu_count": 2,
    }
    # host beats group beats fleet-wide data
    assert fleet.host("rig-02").data["gpu_power_cap_watts"] == 300
    assert fleet.host("rig-03").data["gpu_power_cap_watts"] == 280
    assert fleet.host("rig-03").data["variant"] == "dual-dflash"
    groups = fleet.pyinfra_groups()
    assert list(groups) == ["canary", "rigs"]
    assert groups["rigs"][0] == ("rig-02", fleet.host("rig-02").data)


def test_resolved_data_starts_from_group_data_defaults(tmp_path):
    data = load_fleet(write(tmp_path, GOOD)).resolved_data("rig-02")
    assert data["install_root"] == "/opt/rigup"  # untouched default from group_data/all.py
    assert data["variant"] == "dual-dflash"


def test_example_file_is_valid():
    fleet = load_fleet(REPO_ROOT / "rigs.example.yaml")
    assert {h.name for h in fleet.hosts} == {"rig-01", "rig-02", "rig-03", "rig-04", "rig-05", "rig-06", "rig-07", "gw-01"}
    gateway = fleet.host("gw-01")
    assert gateway.group == "gateway" and gateway.data["serves_variant"] is False
    from rigup.desired.recipe import pods_of

    pods = {name: [(p.name, p.variant, p.gpus) for p in pods_of(fleet.resolved_data(name))] for name in ("rig-04", "rig-05")}
    assert pods == {"rig-04": [("left", "dual", (0, 1)), ("right", "dual", (2, 3))],
                    "rig-05": [("pair", "dual", (0, 1)), ("solo", "single", (2,))]}


BAD = [
    ("groups: [", "not valid YAML"),
    ("- a\n- b\n", "expected a mapping"),
    ("hosts: {}\n", "top level: unknown key 'hosts'"),
    ("groups: {}\n", "'groups' must map at least one group"),
    ("groups:\n  all:\n    hosts: {a: {}}\n", "group 'all': group names are identifiers"),
    ("groups:\n  g:\n    hostz: {a: {}}\n", "group 'g': unknown key 'hostz'"),
    ("groups:\n  g:\n    hosts: {}\n", "group 'g': 'hosts' must map"),
    ("groups:\n  g:\n    hosts:\n      rig-01: {gpu_cuont: 2}\n",
     "host 'rig-01': unknown key 'gpu_cuont'"),
    ("groups:\n  g:\n    hosts:\n      rig-01: {variant: dual-nope}\n",
     "host 'rig-01': 'variant' 'dual-nope' is not in the catalog"),
    ("groups:\n  g:\n    hosts:\n      rig-01: {pods: [{name: a, variant: dual, gpus: [0, 1]}, {name: b, variant: single, gpus: [1]}]}\n",
     "host 'rig-01': 'pods': pods: GPU 1 is given to both a and b"),
    ("groups:\n  g:\n    hosts:\n      rig-01: {pods: [{name: a, variant: dual, gpus: [0, 1], variant_overrides: {bogus: 1}}]}\n",
     "host 'rig-01': pods[0] (a, set in host 'rig-01'): variant_overrides: unknown variant_overrides key 'bogus'"),
    ("groups:\n  g:\n    data: {variant_overrides: {max_model_len: 8192}}\n    hosts:\n"
     "      rig-01: {pods: [{name: a, variant: dual, gpus: [0, 1]}]}\n",
     "host 'rig-01': 'variant_overrides' (set in group 'g' data) beside 'pods' (set in host 'rig-01')"),
    ("groups:\n  g:\n    hosts:\n      rig-01: {gpu_count: two}\n",
     "host 'rig-01': 'gpu_count' must be int, got 'two'"),
    ("groups:\n  g:\n    hosts:\n      rig-01: {ssh_port: true}\n",
     "host 'rig-01': 'ssh_port' must be int"),
    ("groups:\n  g:\n    hosts:\n      rig-01: {ssh_password: hunter2}\n",
     "host 'rig-01': unknown key 'ssh_password'"),
    ("groups:\n  g:\n    data: {ssh_user: x}\n    hosts: {rig-01: {}}\n",
     "group 'g' data: 'ssh_user' is a per-host SSH setting"),
    ("groups:\n  a:\n    hosts: {rig-01: {}}\n  b:\n    hosts: {rig-01: {}}\n",
     "host 'rig-01' is listed in groups 'a' and 'b'"),
    ("data: {driver_reboot: 1}\ngroups:\n  g:\n    hosts: {rig-01: {}}\n",
     "data: 'driver_reboot' must be str, got 1"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m for _, m in BAD])
def test_bad_file_fails_naming_file_host_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(FleetError) as excinfo:
        load_fleet(path)
    assert str(path) in str(excinfo.value)
    assert message in str(excinfo.value)


def test_missing_file_says_how_to_fix(tmp_path):
    with pytest.raises(FleetError, match="fleet file not found.*RIGUP_RIGS"):
        load_fleet(tmp_path / "nope.yaml")


def run_pyinfra_inventory(fleet_file: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RIGUP_RIGS": str(fleet_file)}
    pyinfra = Path(sys.executable).with_name("pyinfra")
    return subprocess.run(
        [str(pyinfra), "inventory.py", "debug-inventory"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


def test_pyinfra_reads_the_fleet_through_inventory_py(tmp_path):
    result = run_pyinfra_inventory(write(tmp_path, GOOD))
    assert result.returncode == 0, result.stderr
    out = result.stdout + result.stderr
    assert "rig-01" in out and "rig-03" in out
    assert "dual-dflash" in out


def test_pyinfra_refuses_a_bad_fleet_with_the_key_named(tmp_path):
    bad = write(tmp_path, "groups:\n  g:\n    hosts:\n      rig-01: {gpu_cuont: 2}\n")
    result = run_pyinfra_inventory(bad)
    assert result.returncode != 0
    assert "unknown key 'gpu_cuont'" in result.stdout + result.stderr
