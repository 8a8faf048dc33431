"""The gateway task's facts and the unit decision they feed: a rig's served record, and whether the
gateway runs on its current files (systemd's monotonic start against the files' mtimes, as systemd 249,
Ubuntu 22.04's, prints it: no --timestamp=unix)."""

from __future__ import annotations

import json

import pytest
from pyinfra.api import FactProcessError

from rigup.facts.gateway import GatewayVenvs, VenvComplete
from rigup.facts.serving import RECORD_MARK, UNITS_MARK, ServedRecord
from rigup.facts.units import TextFile, UnitAgainstFiles
from rigup.operations.units import service_steps

# `systemctl show -p ActiveState -p UnitFileState -p ExecMainStartTimestampMonotonic -p NeedDaemonReload`
# prints the properties in its own order, one Key=value per line; then the clock/mtime lines.
SHOW_RUNNING = ["NeedDaemonReload=no", "ExecMainStartTimestampMonotonic=36000000000", "ActiveState=active",
                "UnitFileState=enabled"]
CLOCK = ["clock 1796140035.5 36035.5"]  # wall, monotonic: the unit started 35.5 s ago, at wall 1796140000.0


def unit_seen(show: list[str], mtimes: dict[str, float]) -> dict:
    lines = show + CLOCK + [f"mtime {t!r} {p}" for p, t in mtimes.items()]
    return UnitAgainstFiles().process(lines)


def test_the_start_is_mapped_to_wall_time_and_older_files_need_nothing() -> None:
    seen = unit_seen(SHOW_RUNNING, {"/opt/rigup/gateway/config.yaml": 1796139990.25})
    assert seen["started"] == pytest.approx(1796140000.0)
    assert seen["active"] == "active" and seen["enabled"] == "enabled" and seen["reload"] is False
    assert service_steps(seen) == []


def test_a_file_written_after_the_start_restarts_it_even_within_the_same_second() -> None:
    assert service_steps(unit_seen(SHOW_RUNNING, {"/opt/rigup/gateway/gateway.env": 1796140000.4})) == ["restart"]


def test_a_stopped_failed_or_never_started_unit_is_started_and_enabled() -> None:
    never = ["NeedDaemonReload=no", "ExecMainStartTimestampMonotonic=0", "ActiveState=failed", "UnitFileState=disabled"]
    seen = unit_seen(never, {"/etc/systemd/system/rigup-gateway.service": 1796139000.0})
    assert seen["started"] is None
    assert service_steps(seen) == ["start", "enable"]
    changed_unit = ["NeedDaemonReload=yes"] + SHOW_RUNNING[1:]
    assert service_steps(unit_seen(changed_unit, {"/etc/systemd/system/rigup-gateway.service": 1796140010.0})) == [
        "daemon-reload", "restart"]


def test_no_systemctl_output_is_an_error_not_a_stopped_unit() -> None:
    with pytest.raises(FactProcessError):
        UnitAgainstFiles().process(["clock 1796140035.5 36035.5"])
    with pytest.raises(FactProcessError):
        UnitAgainstFiles().process(SHOW_RUNNING)  # no clock line: python3 did not run


def test_served_record_reads_every_pods_provenance_and_running_units() -> None:
    record = {"variant": "dual", "unit": "rigup-dual.service", "gate": {"result": "passed"}}
    pod = {"variant": "single", "pod": "right", "unit": "rigup-right.service", "gate": {"result": "passed"}}
    out = [RECORD_MARK, *json.dumps(record, indent=2).splitlines(), "", RECORD_MARK, json.dumps(pod), "",
           UNITS_MARK, "rigup-dual.service", "rigup-gpu-power.service"]
    assert ServedRecord().process(out) == {"records": [record, pod],
                                           "active_units": ["rigup-dual.service", "rigup-gpu-power.service"]}
    assert ServedRecord().process([UNITS_MARK]) == {"records": [], "active_units": []}  # before any release
    torn = ServedRecord().process([RECORD_MARK, '{"variant": "du', "", RECORD_MARK, json.dumps(pod), "", UNITS_MARK])
    assert torn["records"] == [pod]  # a torn file gives no route; the others still do


def test_served_record_command_reads_the_host_record_and_each_pods() -> None:
    command = ServedRecord().command("/opt/rigup").get_raw_value()
    assert "/opt/rigup/state/provenance.json" in command
    assert "/opt/rigup/state/pods/*/provenance.json" in command


def test_small_facts() -> None:
    assert TextFile().process(["__absent__"]) is None
    assert TextFile().process(["a: 1", "b: 2"]) == "a: 1\nb: 2\n"
    assert VenvComplete().process([]) is None and VenvComplete().process(["abc123"]) == "abc123"
    assert GatewayVenvs().process(["/opt/rigup/gateway/venv-b", "/opt/rigup/gateway/venv-a"]) == [
        "/opt/rigup/gateway/venv-a", "/opt/rigup/gateway/venv-b"]
