"""Fleet monitoring's parts from the OS archive, real on a test-bed rig: node_exporter (and Prometheus)
installed with apt from the hub's stand-in Ubuntu archive, whose `universe` holds Debian bookworm's own
packages (rigup_testbed/debarchive.py), signatures checked against the archive's key as on every rig.

  * apt-get update over the hub's signed archive (main, restricted, universe) says nothing bad, and the
    install needs no --allow-unauthenticated;
  * prometheus-node-exporter's unit runs as Debian ships it, serves node_exporter_build_info on :9100 and
    reads the textfile collector's default directory;
  * prometheus' unit runs (its systemd hardening works in the bed), and promtool accepts its config.

The served set was computed for the image without reading it; the image's real dpkg status must agree.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable

import pytest

from rigup_testbed import debarchive
from rigup_testbed.fleet import Testbed
from rigup_testbed.hosts import Host, HostSpec
from rigup_testbed.image import ensure_image
from tests.e2e.test_serving import sh as root  # a command as root on a rig; it must succeed

pytestmark = pytest.mark.e2e

APT = "DEBIAN_FRONTEND=noninteractive apt-get -q -o Dpkg::Use-Pty=0"
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"  # the Debian package's default (its README.textfile)


@pytest.fixture(scope="module")
def rig(testbed_factory: Callable[..., Testbed]) -> Host:
    return testbed_factory([HostSpec("rig-01", group="rigs")], "rigmon").host("rig-01")


@pytest.fixture(scope="module")
def updated(rig: Host) -> str:
    return root(rig, f"{APT} update 2>&1")


def wait_for(rig: Host, command: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while True:
        proc = rig.ssh(f"sudo -n sh -c {shlex.quote(command)}", check=False)
        if proc.returncode == 0 or time.monotonic() > deadline:
            assert proc.returncode == 0, f"{command}: {proc.stdout}{proc.stderr}"
            return proc.stdout
        time.sleep(0.5)


def test_the_served_universe_fits_the_built_image() -> None:
    text = (ensure_image().root / "var/lib/dpkg/status").read_text()
    assert debarchive.missing_in_image(debarchive.universe_manifest(), text) == []


def test_node_exporter_installs_from_the_signed_universe_and_serves_metrics(rig: Host, updated: str) -> None:
    assert re.search(r"bookworm/universe amd64 Packages", updated), updated
    assert not re.search(r"^(W|E):", updated, re.M), updated
    sources = root(rig, "cat /etc/apt/sources.list.d/ubuntu.sources")
    assert "Components: main restricted universe\n" in sources + "\n" and "Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg" in sources
    version = next(d.version for d in debarchive.universe_manifest() if d.name == "prometheus-node-exporter")
    policy = root(rig, "apt-cache policy prometheus-node-exporter")
    assert f"Candidate: {version}" in policy and "ubuntu-archive bookworm/universe amd64 Packages" in policy, policy
    out = root(rig, f"{APT} install -y prometheus-node-exporter 2>&1")
    assert "cannot be authenticated" not in out and not re.search(r"^(W|E):", out, re.M), out
    assert root(rig, "dpkg-query -W -f='${Status} ${Version}' prometheus-node-exporter") == f"install ok installed {version}"
    # enabled and started by the package's own maintainer scripts, as the real Debian unit
    assert root(rig, "systemctl is-enabled prometheus-node-exporter.service") == "enabled"
    wait_for(rig, "systemctl is-active --quiet prometheus-node-exporter.service")
    assert root(rig, "systemctl show -p User --value prometheus-node-exporter.service") == "prometheus"
    metrics = wait_for(rig, "curl -sf localhost:9100/metrics")
    assert re.search(r'^node_exporter_build_info\{.*version="1\.', metrics, re.M), metrics[:2000]
    # the textfile collector reads the package's directory without any ARGS
    assert root(rig, "grep -E '^ARGS=' /etc/default/prometheus-node-exporter") == 'ARGS=""'
    root(rig, f"echo 'rigup_testbed_textfile_probe 1' > {TEXTFILE_DIR}/probe.prom")
    assert re.search(r"^rigup_testbed_textfile_probe 1$", wait_for(rig, "curl -sf localhost:9100/metrics"), re.M)
    assert "degraded" not in root(rig, "systemctl is-system-running || true")


def test_prometheus_runs_as_debian_ships_it(rig: Host, updated: str) -> None:
    out = root(rig, f"{APT} install -y prometheus 2>&1")
    assert "cannot be authenticated" not in out and not re.search(r"^(W|E):", out, re.M), out
    wait_for(rig, "systemctl is-active --quiet prometheus.service")
    assert root(rig, "systemctl show -p User --value prometheus.service") == "prometheus"
    assert root(rig, "systemctl show -p EnvironmentFiles --value prometheus.service").startswith("/etc/default/prometheus")
    assert "Ready" in wait_for(rig, "curl -sf localhost:9090/-/ready")
    assert root(rig, "ps -o user= -C prometheus") == "prometheus"
    check = root(rig, "promtool check config /etc/prometheus/prometheus.yml 2>&1")
    assert "SUCCESS" in check, check
    # the packaged config scrapes itself and the local node_exporter: both are up
    up = wait_for(rig, "curl -sf 'localhost:9090/api/v1/query?query=sum(up)' | grep -q '\"2\"' && echo ok", timeout=60)
    assert up.strip() == "ok"
