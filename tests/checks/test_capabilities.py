"""Capability preflight: root or passwordless sudo, systemd as the running init, apt, Docker present
or installable, each failing with cause, key and fix; a host whose user cannot act as root is judged
from the capabilities alone (the other facts run through sudo and are not read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigup.checks.preflight import check_capabilities, privileges_missing
from rigup.desired.knobs import load_defaults
from rigup.facts.system import HostCapabilities
from rigup.operations.preflight import preflight_report
from rigup.parsers.system import parse_capabilities
from tests.support.hostlayer import fx
from tests.support.opharness import ScriptedHost, judge_preflight

BOOTED = parse_capabilities(fx("capabilities/booted-sudo-user.txt"))
CONTAINER = parse_capabilities(fx("capabilities/container-root-no-systemd.txt"))  # the lent H200 host's values
PASSWORD = parse_capabilities(fx("capabilities/sudo-asks-password.txt"))


def by_name(caps, **knobs):
    return {c.name: c for c in check_capabilities(caps, {**load_defaults(), "_sudo": True, **knobs})}


def test_a_booted_host_with_passwordless_sudo_passes_and_docker_is_installable() -> None:
    checks = by_name(BOOTED)
    assert all(c.ok for c in checks.values()), checks
    assert checks["privileges"].message == "uid 1000 with passwordless sudo"
    assert checks["docker"].message == "docker is not installed; the docker phase installs it from Docker's repository"


def test_the_lent_gpu_host_fails_on_sudo_systemd_and_docker_with_fixes() -> None:
    checks = by_name(CONTAINER)  # root, _sudo true (the default), no sudo binary
    assert checks["privileges"].failed and checks["privileges"].key == "_sudo"
    assert checks["privileges"].fix == "set _sudo: false for this host (root needs no sudo)"
    assert checks["systemd"].failed
    assert checks["systemd"].message.startswith("process 1 is 'process_api', /run/systemd/system is absent")
    assert checks["docker"].failed and "needs systemd and apt" in checks["docker"].message
    assert checks["apt"].ok
    as_root = by_name(CONTAINER, _sudo=False)
    assert as_root["privileges"].ok and as_root["systemd"].failed


def test_sudo_that_asks_for_a_password_or_a_non_root_user_without_sudo_fail() -> None:
    checks = by_name(PASSWORD)
    assert checks["privileges"].failed and "asks uid 1000 for a password" in checks["privileges"].message
    assert "NOPASSWD" in checks["privileges"].fix
    no_sudo = by_name(BOOTED, _sudo=False)
    assert no_sudo["privileges"].failed and "with _sudo false" in no_sudo["privileges"].message
    assert privileges_missing(list(checks.values())) and not privileges_missing(list(by_name(BOOTED).values()))


def test_preflight_reads_nothing_else_when_the_user_cannot_act_as_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only HostCapabilities is scripted: reading any other fact would fail this test.
    host = ScriptedHost({HostCapabilities: lambda _sudo: PASSWORD}, {**load_defaults(), "_sudo": True})
    checks = preflight_report(host)
    assert [c.name for c in checks] == ["privileges", "systemd", "apt", "docker"]
    assert host.fact_calls == [("HostCapabilities", {"_sudo": False})]  # read without sudo
    judged = judge_preflight(host, monkeypatch)  # the host fails while the deploy is planned
    assert not judged.passed and judged.failed_now == [host]
    assert judged.reported["title"] == "preflight failed (1 checks)"
    assert judged.reported["failed_lines"] == [
        "rig-test: privileges: sudo asks uid 1000 for a password [key: _sudo] -> fix: allow the SSH user "
        "passwordless sudo (NOPASSWD in /etc/sudoers.d/), or log in as root"
    ]


def test_the_probe_runs_and_parses_on_this_machine() -> None:
    import os
    import subprocess

    out = subprocess.run(["sh", "-c", HostCapabilities.command], capture_output=True, text=True, check=True).stdout
    caps = HostCapabilities().process(out.splitlines())
    assert caps.uid == os.getuid() and caps.pid1 == Path("/proc/1/comm").read_text().strip()
    assert caps.systemd_running == Path("/run/systemd/system").is_dir()


def test_a_gateway_only_host_needs_no_gpu_driver_or_docker() -> None:
    from rigup.checks.preflight import gateway_host_checks
    from rigup.parsers.system import DiskFree, OsInfo

    data = {**load_defaults(), "_sudo": True, "serves_variant": False}
    ubuntu = OsInfo(id="ubuntu", version_id="24.04", codename="noble", pretty_name="Ubuntu 24.04.1 LTS")
    roomy = {"/opt/rigup": DiskFree("/opt/rigup", "/opt", "/dev/sda1", "/", 100 * 10**9, 50 * 10**9)}
    checks = {c.name: c for c in gateway_host_checks(BOOTED, ubuntu, roomy, data)}
    assert set(checks) == {"privileges", "systemd", "apt", "os", "disk"} and all(c.ok for c in checks.values())
    full = {"/opt/rigup": DiskFree("/opt/rigup", "/opt", "/dev/sda1", "/", 100 * 10**9, 5 * 10**9)}
    disk = {c.name: c for c in gateway_host_checks(BOOTED, ubuntu, full, data)}["disk"]
    assert disk.failed and "needs 11.0 GB" in disk.message and disk.key == "preflight_disk_margin_gb"
    debian = OsInfo(id="debian", version_id="12", codename="bookworm", pretty_name="Debian 12")
    assert {c.name: c for c in gateway_host_checks(BOOTED, debian, roomy, data)}["os"].failed
    # a user who cannot act as root is judged from the capabilities alone
    assert [c.name for c in gateway_host_checks(PASSWORD, None, {}, data)] == ["privileges", "systemd", "apt"]
