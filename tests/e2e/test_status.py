"""`rigup status` on hosts provisioned by the real deploy: in sync after the converge, then drift and
ill health made on purpose (a hand edit on a rig, a stopped service, a fleet change not yet deployed),
each seen in the table, the JSON and the exit code, and gone once undone.

One 2-host bed (rig-01 canary, rig-02 rigs) of its own, deployed once with `pyinfra -y inventory.py
deploy.py`; the scenarios run in file order and each one restores what it changed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import HostSpec
from rigup_testbed.image import REPO_ROOT
from tests.e2e.helpers import run
from tests.e2e.test_serving import VARIANT, Bed, sh

pytestmark = pytest.mark.e2e

COMPOSE = f"/opt/rigup/variants/{VARIANT}/compose.yaml"
UNIT = f"rigup-{VARIANT}.service"


def test_fresh_hosts_are_reached_over_ssh_and_reported_undeployed(testbed: Testbed, fleet_file: Path) -> None:
    """Before any deploy: SSH with the fleet's settings (strict host keys) works on every host in
    parallel, and each is drift (no provenance) and unhealthy (no service, no driver, no API)."""
    proc = run([sys.executable, "-m", "rigup", "status", "--json"], fleet_file, 300)
    report = json.loads(proc.stdout)
    assert proc.returncode == 3, proc.stderr
    assert {h["host"] for h in report["hosts"]} == {h.name for h in testbed.hosts}
    for host in report["hosts"]:
        found = {i["item"].strip(): i for i in host["items"]}
        assert "ssh" not in found, found.get("ssh")  # reached, so the rest are facts from the host
        assert found["provenance"]["state"] == "drift"
        assert found["service"]["actual"] == "not installed, not enabled"
        assert found["driver"]["actual"] == "nvidia-smi not installed"
        assert found["health"]["state"] == "unhealthy"


@pytest.fixture(scope="module")
def bed(testbed_factory: Callable[..., Testbed]) -> Iterator[Bed]:
    testbed = testbed_factory([HostSpec("rig-01", group="canary"), HostSpec("rig-02", group="rigs")], "rigst",
                              host_layer=True)
    b = Bed(testbed, testbed.workdir)
    b.write()
    b.deploy()
    yield b


def status(bed: Bed, *args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "rigup", "status", "--json", *args],
        cwd=REPO_ROOT, env=bed.env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def items(report: dict[str, Any], host: str) -> dict[str, dict[str, Any]]:
    (entry,) = [h for h in report["hosts"] if h["host"] == host]
    return {i["item"].strip(): i for i in entry["items"]}


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    return {h["host"]: h["verdict"] for h in report["hosts"]}


def wait_healthy(bed: Bed, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        code, report = status(bed)
        if code == 0 or time.monotonic() > deadline:
            return report
        time.sleep(3)


def test_converged_fleet_is_in_sync(bed: Bed) -> None:
    code, report = status(bed)
    assert code == 0, json.dumps(report, indent=1)
    assert verdicts(report) == {"rig-01": "OK", "rig-02": "OK"}
    found = items(report, "rig-01")
    assert found["release"]["state"] == "ok" and found["gate"]["actual"].startswith("passed")
    assert found["service"]["actual"] == "active, enabled"
    assert found["health"]["state"] == "ok" and found["files"]["actual"] == "unchanged"
    assert found["gpus"]["actual"].startswith("2 x ") and found["vram MiB"]["state"] == "info"
    proc = subprocess.run([sys.executable, "-m", "rigup", "status", "--limit", "canary"], cwd=REPO_ROOT,
                          env=bed.env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "rig-01" in proc.stdout and "rig-02" not in proc.stdout
    assert "1 host(s): 0 drifted, 0 unhealthy" in proc.stdout


def test_hand_edit_on_a_rig_is_drift(bed: Bed) -> None:
    host = bed.host("rig-01")
    sh(host, f"echo '# tuned by hand' >> {COMPOSE}")
    try:
        code, report = status(bed)
        assert code == 1 and verdicts(report) == {"rig-01": "DRIFT", "rig-02": "OK"}
        edited = items(report, "rig-01")["file compose.yaml"]
        assert edited["state"] == "drift" and "changed on the rig" in edited["note"]
    finally:
        sh(host, f"sed -i '/^# tuned by hand$/d' {COMPOSE}")
    assert status(bed)[0] == 0


def test_stopped_service_is_unhealthy(bed: Bed) -> None:
    host = bed.host("rig-02")
    sh(host, f"systemctl stop {UNIT}")
    try:
        code, report = status(bed)
        assert code == 2 and verdicts(report) == {"rig-01": "OK", "rig-02": "UNHEALTHY"}
        found = items(report, "rig-02")
        assert found["service"]["state"] == "unhealthy" and found["service"]["actual"].startswith("inactive")
        assert found["health"]["state"] == "unhealthy" and "no response" in found["health"]["actual"]
    finally:
        sh(host, f"systemctl start {UNIT}")
    assert verdicts(wait_healthy(bed)) == {"rig-01": "OK", "rig-02": "OK"}


def test_fleet_change_not_yet_deployed_is_drift(bed: Bed) -> None:
    bed.group_data = {"rigs": {"variant_overrides": {"max_model_len": 65536}}}
    bed.write(relock=False)  # same pins: only the engine setting moves
    try:
        code, report = status(bed)
        assert code == 1 and verdicts(report) == {"rig-01": "OK", "rig-02": "DRIFT"}
        found = items(report, "rig-02")
        assert found["release"]["state"] == "drift" and found["release"]["note"] == "converge to apply"
        assert found["engine.max_model_len"]["desired"] == "65536"
        assert found["files.compose.yaml"]["state"] == "drift"  # the rendered compose file differs too
        assert found["health"]["state"] == "ok"  # it still serves what it was given
    finally:
        bed.group_data = {}
        bed.write(relock=False)
    assert status(bed)[0] == 0
