"""The host layer (preflight, NVIDIA driver, Docker, container toolkit) on the test bed.

One 6-host bed, each host one scenario, converged together with the real pyinfra CLI
(`pyinfra -y --json inventory.py tests/e2e/hostlayer_deploy.py`):

  rig-fresh   fresh 2x3090: driver installed, rebooted, verified, held; Docker, toolkit, smoke test
  rig-old     driver 550 installed, held and loaded beforehand: upgraded to 580, rebooted
  rig-never   driver_reboot: never: driver installed, REBOOT REQUIRED reported, no reboot, no smoke test
  rig-sb      Secure Boot on, no signed modules for its kernel: fails preflight, nothing changes
  rig-one     1x3090 given the TP=2 variant: fails preflight, nothing changes
  rig-dirty   a hand-made Docker source entry (other keyring) and a daemon.json with user keys

Then a second converge must change nothing on the converged hosts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import Host, HostSpec
from tests.e2e.helpers import changed, converge_json, op, reboot, sh, skip_without_disk, snapshot

pytestmark = pytest.mark.e2e

SPECS = [
    HostSpec("rig-fresh", group="canary"),
    HostSpec("rig-old"),
    HostSpec("rig-never", data={"driver_reboot": "never"}),
    HostSpec("rig-sb", secure_boot=True),
    HostSpec("rig-one", hardware="1x3090"),
    HostSpec("rig-dirty"),
]
CONVERGED = ("rig-fresh", "rig-old", "rig-dirty")
REFUSED = ("rig-sb", "rig-one")
USER_DAEMON_JSON = {"log-driver": "json-file", "log-opts": {"max-size": "10m", "max-file": "3"}}
DRIVER_OP = "Install and load the NVIDIA driver (stop serving, install, reboot, verify)"
SMOKE_OP = "Check a CUDA container sees every GPU (after a driver, Docker or toolkit change)"
PREFLIGHT_OP = "Run preflight checks (a failed check fails this host)"


def boot_times(host: Host) -> list[float]:
    """When the supervisor started `host`, one entry a boot (seconds since the epoch)."""
    path = host.run_dir / "boots"
    return [float(x) for x in path.read_text().split()] if path.exists() else []


def deploy(fleet: Path) -> tuple[int, dict[str, Any], str]:
    return converge_json(fleet, "hostlayer deploy over the bed")


# --------------------------------------------------------------------------------------------
# the bed, prepared, and two converges


@pytest.fixture(scope="module")
def bed(testbed_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Testbed:
    skip_without_disk(tmp_path_factory)
    return testbed_factory(SPECS)


@pytest.fixture(scope="module")
def prepared(bed: Testbed) -> dict[str, str]:
    old = bed.host("rig-old")
    sh(old, "sudo apt-get update -q")
    sh(old, "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q nvidia-driver-550")
    sh(old, "sudo apt-mark hold nvidia-driver-550 nvidia-utils-550 nvidia-dkms-550 nvidia-kernel-common-550")
    reboot(old)
    assert "Kernel Module  550.163.01" in sh(old, "cat /proc/driver/nvidia/version")

    dirty = bed.host("rig-dirty")
    url = bed.urls["engine_docker_apt_url"]  # the repository the fleet installs Docker from (the real engine)
    # Docker's documented manual setup with its own keyring file, plus an old line without signed-by.
    sh(dirty, f"sudo mkdir -p /etc/apt/keyrings && curl -fsS {url}/gpg | sudo tee /etc/apt/keyrings/docker.asc >/dev/null")
    sh(dirty, f"echo 'deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] {url} bookworm stable' "
              "| sudo tee /etc/apt/sources.list.d/docker.list >/dev/null")
    sh(dirty, f"echo 'deb {url} bookworm stable' | sudo tee -a /etc/apt/sources.list >/dev/null")
    sh(dirty, "sudo mkdir -p /etc/docker && echo '" + json.dumps(USER_DAEMON_JSON) + "' | sudo tee /etc/docker/daemon.json")
    return {h: snapshot(bed.host(h)) for h in REFUSED}


@pytest.fixture(scope="module")
def fleet(bed: Testbed, prepared: dict[str, str]) -> Path:
    # (the hub's registry speaks HTTPS with the bed's CA, which the rigs trust; the fleet also tells Docker of
    # a plain-HTTP LAN mirror, as users often do, so rigup's merge into daemon.json has something to merge)
    return bed.write_fleet(bed.workdir / "hostlayer-rigs.yaml", data={"docker_insecure_registries": [lan_mirror(bed)]})


def lan_mirror(bed: Testbed) -> str:
    """A plain-HTTP registry on the bed's network that no image is pulled from (host:port)."""
    return f"{bed.ledger.info['hub_ip']}:5999"


@pytest.fixture(scope="module")
def first(bed: Testbed, fleet: Path) -> Iterator[tuple[int, dict[str, Any], str, dict[str, list[float]]]]:
    before = {h.name: boot_times(h) for h in bed.hosts}
    code, results, log = deploy(fleet)
    yield code, results, log, before


@pytest.fixture(scope="module")
def second(bed: Testbed, fleet: Path, first: Any) -> tuple[int, dict[str, Any], str]:
    return deploy(fleet)


# --------------------------------------------------------------------------------------------
# first converge


def test_refused_hosts_fail_preflight_and_stay_untouched(bed: Testbed, first: Any, prepared: dict[str, str]) -> None:
    code, results, log, before = first
    assert code == 1  # failed hosts make the run fail
    pre = op(results, PREFLIGHT_OP)
    assert set(REFUSED) <= set(pre["error"])
    for name in REFUSED:
        assert changed(results, name) == [], name
        assert snapshot(bed.host(name)) == prepared[name], f"{name} changed although preflight failed"
        assert boot_times(bed.host(name)) == before[name]
    assert "rig-one: gpu-layout: variant 'dual' runs tensor parallel 2; this host has 1 GPU(s)" in log
    assert "rig-sb: secure-boot: Secure Boot is on" in log and "[key: nvidia_driver_source]" in log


def test_fresh_host_gets_driver_docker_toolkit_and_passes_smoke(bed: Testbed, first: Any) -> None:
    code, results, log, before = first
    host = bed.host("rig-fresh")
    assert len(boot_times(host)) == len(before["rig-fresh"]) + 1  # exactly one reboot
    assert "Open Kernel Module for x86_64  580.95.05" in sh(host, "cat /proc/driver/nvidia/version")
    held = sh(host, "apt-mark showhold").split()
    assert {"nvidia-driver-580-open", "nvidia-utils-580", "nvidia-dkms-580-open", "nvidia-kernel-common-580"} <= set(held)
    smi = sh(host, "nvidia-smi --query-gpu=power.limit,persistence_mode --format=csv,noheader,nounits")
    assert smi.split("\n")[:2] == ["230.00, Enabled", "230.00, Enabled"]
    assert "nouveau" in sh(host, "cat /etc/modprobe.d/blacklist-nouveau.conf")
    assert '"libnvidia-";' in sh(host, "cat /etc/apt/apt.conf.d/52rigup-nvidia-driver")
    assert sh(host, "systemctl is-enabled rigup-gpu-power.service").strip() == "enabled"
    assert "nvidia" in sh(host, "sudo docker info --format '{{json .Runtimes}}'")
    assert sh(host, "docker compose version --short || sudo docker compose version --short").strip()
    smoke = op(results, SMOKE_OP)
    assert "rig-fresh" in smoke["success"], (smoke, log[-6000:])
    assert "rig-fresh" in op(results, DRIVER_OP)["success"]


def test_old_driver_is_upgraded_with_one_reboot(bed: Testbed, first: Any) -> None:
    code, results, log, before = first
    host = bed.host("rig-old")
    assert len(boot_times(host)) == len(before["rig-old"]) + 1
    assert "580.95.05" in sh(host, "cat /proc/driver/nvidia/version")
    packages = sh(host, "dpkg-query -W -f='${Package} ${db:Status-Abbrev}\\n' 'nvidia-*' 2>/dev/null || true")
    installed = {line.split()[0] for line in packages.splitlines() if line.split()[1:2] in (["ii"], ["hi"])}
    assert "nvidia-driver-580-open" in installed
    assert not {p for p in installed if "550" in p}, installed


def test_reboots_one_host_at_a_time(bed: Testbed, first: Any) -> None:
    """rollout_batch is 1: the second host's reboot starts only after the first came back."""
    _, _, _, before = first
    new_boots = sorted(
        boot_times(bed.host(name))[len(before[name])] for name in ("rig-fresh", "rig-old")
    )
    assert new_boots[1] - new_boots[0] >= 5, new_boots  # reconnect wait alone is 5 s


def test_never_policy_installs_reports_and_does_not_reboot(bed: Testbed, first: Any) -> None:
    code, results, log, before = first
    host = bed.host("rig-never")
    assert boot_times(host) == before["rig-never"]
    assert "REBOOT REQUIRED" in log and "driver_reboot=never" in log
    assert "nvidia-driver-580-open" in sh(host, "apt-mark showhold")
    assert host.ssh("test -e /proc/driver/nvidia/version", check=False).returncode != 0
    assert "rig-never" not in op(results, SMOKE_OP)["success"]  # containers would not see GPUs yet


def test_conflicting_docker_source_is_replaced_and_user_daemon_keys_kept(bed: Testbed, first: Any) -> None:
    host = bed.host("rig-dirty")
    assert sh(host, "grep -c '^# disabled by rigup' /etc/apt/sources.list.d/docker.list").strip() == "1"
    assert "# disabled by rigup" in sh(host, "cat /etc/apt/sources.list")
    sh(host, "sudo apt-get update -q")  # apt works again (no conflicting Signed-By)
    daemon = json.loads(sh(host, "sudo cat /etc/docker/daemon.json"))
    assert daemon["log-driver"] == "json-file" and daemon["log-opts"] == USER_DAEMON_JSON["log-opts"]
    assert "nvidia" in daemon["runtimes"]  # nvidia-ctk's merge
    assert daemon["insecure-registries"] == [lan_mirror(bed)]  # rigup's merge
    assert "nvidia" in sh(host, "sudo docker info --format '{{json .Runtimes}}'")


# --------------------------------------------------------------------------------------------
# second converge


def test_second_converge_changes_nothing(bed: Testbed, first: Any, second: Any) -> None:
    _, _, _, before = first
    code, results, log = second
    for name in CONVERGED:
        assert changed(results, name) == [], (name, changed(results, name))
    # the never-reboot host is not converged: it reports again, and nothing else changes
    assert changed(results, "rig-never") == [f"tasks/nvidia_driver.py | {DRIVER_OP}"]
    assert "REBOOT REQUIRED" in log
    for name in ("rig-fresh", "rig-old", "rig-never"):
        assert len(boot_times(bed.host(name))) == len(before[name]) + (0 if name == "rig-never" else 1)
    assert code == 1 and set(REFUSED) <= set(op(results, PREFLIGHT_OP)["error"])
