"""`rigup doctor`: facts read through pyinfra's API from @fake hosts answering with the captures."""

from __future__ import annotations

import argparse
import io
import json
import textwrap
from pathlib import Path

from rigup import doctor
from rigup.knobs import load_defaults
from tests.unit.test_hostlayer_tasks_fake import responses


def fake(name: str, kind: str, **data) -> tuple[str, dict]:
    return (
        f"@fake/{name}",
        {**load_defaults(), "fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": responses(kind), **data},
    )


def test_collect_reads_facts_and_runs_checks():
    reports = doctor.collect([fake("rig-a", "converged"), fake("rig-b", "one-gpu")])
    a, b = reports
    assert a.ok and a.facts is not None and len(a.facts.gpus) == 2
    assert not b.ok
    assert [c.name for c in b.checks if c.failed] == ["tensor-parallel"]
    table = doctor.format_table(reports)
    row = next(line for line in table.splitlines() if "tensor-parallel" in line)
    assert row.split()[:3] == ["@fake/rig-b", "tensor-parallel", "FAIL"]
    assert "variant 'dual' needs 2 GPUs" in row and "[key: variant]" in row
    assert "@fake/rig-a  summary" in table and "12/12 checks passed" in table
    assert "  os  " not in table  # passed info checks only with --verbose
    assert "  os  " in doctor.format_table(reports, verbose=True)


def test_collect_reports_the_test_bed_os_knob():
    (report,) = doctor.collect([fake("rig-a", "converged", preflight_os_allowed=["debian 12"])])
    (os_check,) = [c for c in report.checks if c.name == "os"]
    assert not os_check.ok and os_check.key == "preflight_os_allowed"


def test_json_output_and_exit_code(tmp_path: Path):
    fleet = tmp_path / "rigs.yaml"
    fleet.write_text(
        textwrap.dedent(
            """
            data: {gpu_power_cap_watts: 250}
            groups:
              canary:
                hosts:
                  rig-01: {ssh_hostname: 10.0.0.1}
              rigs:
                data: {variant: dual}
                hosts:
                  rig-02: {ssh_hostname: 10.0.0.2, gpu_count: 2}
            """
        )
    )
    seen: list[tuple[str, dict]] = []

    def collector(hosts):
        seen.extend(hosts)
        return doctor.collect([fake("rig-b", "one-gpu")])

    args = argparse.Namespace(fleet=str(fleet), limit=["rigs"], data=["preflight_disk_margin_gb=5"], json=True, verbose=False)
    out = io.StringIO()
    assert doctor.run(args, out, collector) == 1
    assert [name for name, _ in seen] == ["rig-02"]
    data = seen[0][1]
    assert data["gpu_power_cap_watts"] == 250 and data["gpu_count"] == 2 and data["preflight_disk_margin_gb"] == 5
    assert data["driver_reboot"] == "auto"  # defaults from group_data/all.py filled in
    doc = json.loads(out.getvalue())
    assert doc["ok"] is False
    (host,) = doc["hosts"]
    assert host["facts"]["gpus"][0]["name"] == "NVIDIA GeForce RTX 3090"
    assert any(c["name"] == "tensor-parallel" and not c["ok"] for c in host["checks"])


def test_unreachable_host_fails(tmp_path: Path):
    # an SSH host on a closed loopback port: connect fails, the report says so
    report = doctor.collect([("127.0.0.1", {**load_defaults(), "ssh_port": 1, "ssh_connect_retries": 0})])[0]
    assert not report.reachable and not report.ok
    assert "connect" in doctor.format_table([report])


def test_bad_fleet_file_exit_2(tmp_path: Path, capsys):
    bad = tmp_path / "rigs.yaml"
    bad.write_text("groups: {g: {hosts: {h: {nonsense_key: 1}}}}\n")
    args = argparse.Namespace(fleet=str(bad), limit=[], data=[], json=False, verbose=False)
    assert doctor.run(args, io.StringIO()) == 2
    assert "nonsense_key" in capsys.readouterr().err


def test_registered_in_the_cli():
    from rigup.cli import build_parser

    args = build_parser().parse_args(["doctor", "--json", "--limit", "canary"])
    assert args.func is doctor.run and args.json and args.limit == ["canary"]
