"""The fit checks (rigup.checks.fit through rigup.checks.preflight) on the test bed.

One 3-host bed, converged together with the real pyinfra CLI (`pyinfra -y --json inventory.py
tests/e2e/hostlayer_deploy.py`), after `python -m rigup doctor --json` read the same checks:

  rig-ok     fresh 2x RTX 3090: passes preflight, driver installed, rebooted, re-checked, Docker,
             toolkit: the host layer converges in the same run as the refused hosts
  rig-small  2x RTX 3080 20 GB with driver 580 already installed and loaded, whose driver reports
             CUDA 12.4 (hardware.json "driver_cuda"): the variant 'dual' does not fit 20480 MiB and the
             CUDA 13.0 image would not start: fails preflight, nothing changes on it
  rig-late   fresh 2x RTX 3080 20 GB: lspci's PCI id 10de:2206 is shared by 10 GB and 20 GB boards, so
             preflight only warns (VRAM unknown until the driver loads); the driver is installed and
             the host rebooted, then the re-run of the checks fails it before Docker is installed
  rig-nosd   fresh 2x RTX 3090 whose systemctl was taken away: the capability checks fail it (systemd)
             before anything changes on it
  rig-container  not a booted host: a second sshd on rig-ok (port 2222) in pid and mount namespaces of
             its own, where process 1 is sshd and /run/systemd is empty, as in a container or WSL
             without systemd. systemctl is installed but answers "System has not been booted with
             systemd": preflight's verdict fails it, not a fact pyinfra cannot read

Before the converge, `pyinfra inventory.py hostlayer_deploy.py --dry` over the same fleet fails every
refused host while it plans (exit 1), and plans nothing after preflight for them.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from tests.e2e.helpers import (
    HOSTLAYER_DEPLOY,
    PYINFRA,
    changed,
    converge_json,
    op,
    reboot,
    run_json,
    sh,
    skip_without_disk,
    snapshot,
)

pytestmark = pytest.mark.e2e

SPECS = [
    HostSpec("rig-ok", group="canary"),
    HostSpec("rig-small", hardware="2x3080-20gb"),
    HostSpec("rig-late", hardware="2x3080-20gb"),
    HostSpec("rig-nosd"),
]
PREFLIGHT_OP = "Run preflight checks (a failed check fails this host)"
REFUSED = ("rig-small", "rig-nosd", "rig-container")
CONTAINER_PORT = 2222
# A shell's own pid and mount namespaces, /run/systemd hidden by an empty tmpfs, sshd as its process 1.
CONTAINER_SSHD = ("unshare --pid --fork --mount --propagation private --mount-proc sh -c "
                  f"'mount -t tmpfs tmpfs /run/systemd && exec /usr/sbin/sshd -D -p {CONTAINER_PORT}'")
DRIVER_OP = "Install and load the NVIDIA driver (stop serving, install, reboot, verify)"
RECHECK_OP = "Re-run the preflight checks with the new driver loaded (VRAM, CUDA, GPUs)"
SMOKE_OP = "Check a CUDA container sees every GPU (after a driver, Docker or toolkit change)"


# --------------------------------------------------------------------------------------------
# the bed, prepared, doctor, one converge


@pytest.fixture(scope="module")
def bed(testbed_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Testbed:
    skip_without_disk(tmp_path_factory)
    return testbed_factory(SPECS)


@pytest.fixture(scope="module")
def prepared(bed: Testbed) -> dict[str, Any]:
    """rig-small: driver 580 installed and loaded by hand, its nvidia-smi saying CUDA 12.4."""
    small = bed.host("rig-small")
    hardware = json.loads(sh(small, "cat /etc/rigup-testbed/hardware.json"))
    hardware["driver_cuda"] = "12.4"
    sh(small, f"echo '{json.dumps(hardware)}' | sudo tee /etc/rigup-testbed/hardware.json >/dev/null")
    sh(small, "sudo apt-get update -q")
    sh(small, "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q nvidia-driver-580-open")
    reboot(small)
    assert sh(small, "nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits").split() == ["20480", "20480"]
    assert "CUDA Version        : 12.4" in sh(small, "nvidia-smi --version")
    nosd = bed.host("rig-nosd")
    sh(nosd, "sudo mv /usr/bin/systemctl /usr/bin/systemctl.away")  # not rebooted while it is away
    ok = bed.host("rig-ok")
    sh(ok, f"sudo sh -c \"setsid {CONTAINER_SSHD} >/dev/null 2>&1 < /dev/null &\"")
    deadline = time.monotonic() + 20
    while f":{CONTAINER_PORT} " not in sh(ok, "ss -ltn") and time.monotonic() < deadline:
        time.sleep(0.5)
    return {
        "snapshot": snapshot(small, install_root=True),
        "nosd_snapshot": snapshot(nosd, install_root=True),
        "boots": {h.name: h.boots() for h in bed.hosts},
    }


@pytest.fixture(scope="module")
def fleet(bed: Testbed, prepared: dict[str, Any]) -> Path:
    path = bed.write_fleet(bed.workdir / "fit-rigs.yaml")  # no lock file next to it: hardware phases only
    doc = yaml.safe_load(path.read_text())
    ok = bed.host("rig-ok")
    known_hosts = bed.workdir / "container-known-hosts"
    key = next(line.split()[1:] for line in ok.known_hosts.read_text().splitlines() if line.split()[0] == ok.ip)
    known_hosts.write_text(f"[{ok.ip}]:{CONTAINER_PORT} {' '.join(key)}\n")
    rig_ok = doc["groups"]["canary"]["hosts"]["rig-ok"]
    doc["groups"]["rigs"]["hosts"]["rig-container"] = {**rig_ok, "ssh_port": CONTAINER_PORT,
                                                        "ssh_known_hosts_file": str(known_hosts)}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def dry(fleet: Path, doctor: Any) -> tuple[int, dict[str, Any], str]:
    return run_json([PYINFRA, "--dry", "--json", "inventory.py", HOSTLAYER_DEPLOY], fleet, 600)


@pytest.fixture(scope="module")
def doctor(fleet: Path) -> tuple[int, dict[str, Any], str]:
    return run_json([sys.executable, "-m", "rigup", "doctor", "--fleet", str(fleet), "--json"], fleet, 300)


@pytest.fixture(scope="module")
def converge(bed: Testbed, fleet: Path, doctor: Any, dry: Any) -> Iterator[tuple[int, dict[str, Any], str]]:
    yield converge_json(fleet, "hostlayer deploy over the fit bed")


def checks_of(doc: dict[str, Any], host: str) -> dict[str, dict[str, Any]]:
    (report,) = [h for h in doc["hosts"] if h["host"] == host]
    return {c["name"]: c for c in report["checks"]}


# --------------------------------------------------------------------------------------------


def test_doctor_reports_the_fit_from_the_hosts_facts(doctor: tuple[int, dict[str, Any], str]) -> None:
    code, doc, log = doctor
    assert code == 1, log  # rig-small fails
    ok = {h["host"]: h["ok"] for h in doc["hosts"]}
    assert ok == {"rig-ok": True, "rig-small": False, "rig-late": True, "rig-nosd": False, "rig-container": False}, log
    container = checks_of(doc, "rig-container")
    assert not container["systemd"]["ok"] and container["systemd"]["message"].startswith("process 1 is 'sshd'"), container
    nosd = checks_of(doc, "rig-nosd")
    assert [n for n, c in nosd.items() if c["severity"] == "error" and not c["ok"]] == ["systemd", "docker"], nosd
    assert "deploy to a host booted with systemd" in nosd["systemd"]["fix"]
    assert nosd["privileges"]["ok"] and nosd["apt"]["ok"]

    small = checks_of(doc, "rig-small")
    assert [n for n, c in small.items() if not c["ok"] and c["severity"] == "error"] == ["cuda-compat", "vram-fit"]
    assert "GPU 0 (NVIDIA GeForce RTX 3080): 20480 MiB" in small["vram-fit"]["message"]
    assert small["cuda-compat"]["message"].startswith("the driver supports CUDA 12.4 but ")
    assert small["driver-cuda"]["ok"]  # branch 580 itself would do: the loaded driver says otherwise
    assert small["interconnect"]["message"].startswith("PCIe (detected: GPU0-GPU1 PIX")  # topology read on the rig
    (report,) = [h for h in doc["hosts"] if h["host"] == "rig-small"]
    assert [g["memory_total_mib"] for g in report["facts"]["gpu_memory"]] == [20480, 20480]

    late = checks_of(doc, "rig-late")
    assert late["vram-fit"]["severity"] == "warning" and late["vram-fit"]["message"].startswith(
        "VRAM unknown until the driver loads: GPU 0 (NVIDIA GeForce RTX 3080): boards with 10 GB and 20 GB share PCI device id 2206"
    )
    assert "lock" in late and late["lock"]["severity"] == "warning"  # no lock file: hardware checks still ran
    assert checks_of(doc, "rig-ok")["vram-fit"]["ok"]


def test_too_small_host_fails_preflight_and_stays_untouched(bed: Testbed, prepared: dict[str, Any], converge: Any) -> None:
    code, results, log = converge
    assert code == 1  # failed hosts make the run fail
    assert "rig-small" in op(results, PREFLIGHT_OP)["error"]
    assert changed(results, "rig-small") == []
    small = bed.host("rig-small")
    assert snapshot(small, install_root=True) == prepared["snapshot"], "rig-small changed although preflight failed"
    assert small.boots() == prepared["boots"]["rig-small"]
    assert "rig-small: vram-fit: variant 'dual' (max_model_len 262144, gpu_memory_utilization 0.92) does not fit" in log
    assert "rig-small: cuda-compat: the driver supports CUDA 12.4" in log and "[key: nvidia_driver_branch]" in log


def test_healthy_host_converges_in_the_same_run(bed: Testbed, prepared: dict[str, Any], converge: Any) -> None:
    code, results, log = converge
    host = bed.host("rig-ok")
    assert host.boots() == prepared["boots"]["rig-ok"] + 1  # the driver's reboot
    assert "rig-ok" in op(results, RECHECK_OP)["success"], log[-4000:]
    assert "Open Kernel Module for x86_64  580.95.05" in sh(host, "cat /proc/driver/nvidia/version")
    assert "rig-ok" in op(results, SMOKE_OP)["success"], log[-6000:]
    assert "nvidia" in sh(host, "sudo docker info --format '{{json .Runtimes}}'")


def test_ambiguous_card_is_rechecked_after_the_reboot(bed: Testbed, prepared: dict[str, Any], converge: Any) -> None:
    code, results, log = converge
    host = bed.host("rig-late")
    assert "rig-late" not in op(results, PREFLIGHT_OP)["error"]  # a warning only: the PCI id cannot tell
    assert "rig-late" in op(results, DRIVER_OP)["success"]
    assert host.boots() == prepared["boots"]["rig-late"] + 1
    assert "rig-late" in op(results, RECHECK_OP)["error"]
    assert "preflight failed with the driver loaded" in log
    assert "rig-late: vram-fit: variant 'dual' (max_model_len 262144, gpu_memory_utilization 0.92) does not fit" in log
    # stopped before Docker: nothing after the re-check ran on it
    assert "docker-ce" not in sh(host, "dpkg-query -W -f='${Package} ${db:Status-Abbrev}\\n' 'docker*' 2>/dev/null || true")
    assert "rig-late" not in op(results, SMOKE_OP)["success"]


def test_host_without_systemctl_fails_the_capability_checks_untouched(
    bed: Testbed, prepared: dict[str, Any], converge: Any
) -> None:
    code, results, log = converge
    assert "rig-nosd" in op(results, PREFLIGHT_OP)["error"]
    assert changed(results, "rig-nosd") == []
    nosd = bed.host("rig-nosd")
    assert snapshot(nosd, install_root=True) == prepared["nosd_snapshot"], "rig-nosd changed although preflight failed"
    assert "rig-nosd: systemd: " in log and "need systemd" in log


def test_dry_run_fails_every_refused_host_and_plans_nothing_after_preflight(dry: Any) -> None:
    code, doc, log = dry
    assert code == 1, log[-4000:]  # what a real run would do: those hosts fail
    for name in REFUSED:
        assert re.search(rf"\[{name}\]\s+preflight failed", log), log[-4000:]  # pyinfra pads the host prefix
    assert "rig-container: systemd: process 1 is 'sshd', /run/systemd/system is absent" in log, log[-4000:]
    assert "could not load fact" not in log and "pyinfra error" not in log, log[-4000:]
    later = [o for o in doc["plan"] if not o["name"].startswith("tasks/preflight.py")]
    planned = {name for o in later for name in o["hosts_with_change"] + o["hosts_with_conditional_change"]}
    assert {"rig-ok", "rig-late"} <= planned, doc["plan"]  # the healthy hosts' plan is still made and printed
    assert not planned & set(REFUSED), doc["plan"]


def test_host_whose_systemd_is_not_running_gets_the_preflight_verdict(converge: Any) -> None:
    code, results, log = converge
    assert code == 1
    assert "rig-container" in op(results, PREFLIGHT_OP)["error"]
    assert changed(results, "rig-container") == []
    assert "rig-container: systemd: process 1 is 'sshd'" in log and "could not load fact" not in log
