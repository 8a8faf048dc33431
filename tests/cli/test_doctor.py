"""`rigup doctor`: facts read through pyinfra's API from @fake hosts answering with the captures."""

from __future__ import annotations

import argparse
import io
import json
import textwrap
from pathlib import Path

import pytest

from rigup.cli import doctor
from rigup.desired.knobs import load_defaults
from tests.support.fit_fake import fit_responses, fit_text, offline_lock
from tests.tasks.test_hostlayer_fake import responses


def fake(name: str, kind: str, fit: dict | None = None, **data) -> tuple[str, dict]:
    """A @fake host answering like `kind`; `fit`: other answers for the fit facts (fit_responses)."""
    answers = {**responses(kind), **(fit or {})}  # same keys: fit's answers, still ahead of "nvidia-smi --query-gpu"
    return (
        f"@fake/{name}",
        {**load_defaults(), "fake_delay": 0, "fake_delay_jitter": 0, "fake_responses": answers, **data},
    )


@pytest.fixture
def lock_dir(tmp_path: Path) -> Path:
    offline_lock(load_defaults(), tmp_path / "rigs.lock.yaml")
    return tmp_path


def test_collect_reads_facts_and_runs_checks(lock_dir: Path):
    reports = doctor.collect([fake("rig-a", "converged"), fake("rig-b", "one-gpu")], lock_dir=lock_dir)
    a, b = reports
    assert a.ok and a.facts is not None and len(a.facts.gpus) == 2
    assert not b.ok
    assert [c.name for c in b.checks if c.failed] == ["gpu-layout"]
    table = doctor.format_table(reports)
    row = next(line for line in table.splitlines() if "gpu-layout" in line)
    assert row.split()[:3] == ["@fake/rig-b", "gpu-layout", "FAIL"]
    assert "variant 'dual' runs tensor parallel 2; this host has 1 GPU(s)" in row and "[key: variant]" in row
    assert "@fake/rig-a  summary" in table and "18/18 checks passed" in table
    assert "  os  " not in table  # passed info checks only with --verbose
    verbose = doctor.format_table(reports, verbose=True)
    assert "  os  " in verbose
    # the fit, from the facts nvidia-smi gave: measured envelope, the loaded driver's CUDA, PCIe without P2P
    assert "@fake/rig-a  vram-fit            ok      variant 'dual' fits: envelope 262144 tokens at 0.92" in verbose
    assert "@fake/rig-a  cuda-compat         ok      driver CUDA 13.0 >= image CUDA runtime 13.0" in verbose
    assert "@fake/rig-a  interconnect        ok      PCIe (detected: GPU0-GPU1 PHB; P2P not supported)" in verbose
    # rig-b's 550 driver is replaced by this run: the planned branch decides CUDA (driver-cuda), not 550's 12.4
    assert "cuda-compat" not in {c.name for c in b.checks}
    assert a.facts.driver_cuda == "13.0" and b.facts is not None and b.facts.driver_cuda == "12.4"


FIT_CASES = [
    # (id, kind, fit answers, knobs, {check: status in the table})
    ("3080-20gb-cards", "converged", fit_responses("converged", memory=fit_text("2x3080-20g/memory.csv")), {},
     {"vram-fit": "FAIL", "gpu-layout": "ok"}),
    ("3080-20gb-warn-policy", "converged", fit_responses("converged", memory=fit_text("2x3080-20g/memory.csv")),
     {"preflight_vram_misfit": "warn"}, {"vram-fit": "warn"}),
    ("busy-gpu", "converged", fit_responses("converged", memory=fit_text("busy-3090/memory.csv")), {},
     {"vram-fit": "FAIL"}),
    ("driver-cuda-12.4-on-580", "converged", fit_responses("converged", cuda="12.4"), {},
     {"cuda-compat": "FAIL", "driver-cuda": "ok"}),
    ("mixed-cards", "converged", fit_responses("converged", memory=fit_text("mixed-3090-3080/memory.csv")), {},
     {"gpu-mix": "warn", "vram-fit": "FAIL"}),
    ("bad-misfit-knob", "converged", None, {"preflight_vram_misfit": "maybe"}, {"vram-policy": "FAIL"}),
    ("no-driver-yet", "fresh", None, {}, {"vram-fit": "ok", "gpu-layout": "ok"}),
]


@pytest.mark.parametrize("kind,fit,data,expected", [c[1:] for c in FIT_CASES], ids=[c[0] for c in FIT_CASES])
def test_fit_findings_in_the_table(lock_dir: Path, kind: str, fit: dict | None, data: dict, expected: dict[str, str]):
    (report,) = doctor.collect([fake("rig-x", kind, fit, **data)], lock_dir=lock_dir)
    rows = {line.split()[1]: line.split()[2] for line in doctor.format_table([report], verbose=True).splitlines()[1:]}
    assert {name: rows.get(name) for name in expected} == expected
    assert report.ok == ("FAIL" not in expected.values())


def test_fit_messages_name_the_cards_and_the_fix(lock_dir: Path):
    small = fit_responses("converged", memory=fit_text("2x3080-20g/memory.csv"))
    (report,) = doctor.collect([fake("rig-x", "converged", small)], lock_dir=lock_dir)
    (vram,) = [c for c in report.checks if c.name == "vram-fit"]
    assert "GPU 0 (NVIDIA GeForce RTX 3080): 20480 MiB" in vram.message and vram.key == "preflight_vram_misfit"
    assert vram.fix and "preflight_vram_misfit: warn" in vram.fix  # no documented envelope of a TP=2 variant fits 20 GB
    old = fit_responses("converged", cuda="12.4")
    (report,) = doctor.collect([fake("rig-x", "converged", old)], lock_dir=lock_dir)
    (cuda,) = [c for c in report.checks if c.name == "cuda-compat"]
    assert "the driver supports CUDA 12.4" in cuda.message and "error 804" in cuda.message
    assert cuda.fix == "install driver branch 580 or newer (nvidia_driver_branch: 580)"


def test_missing_lock_is_a_warning(tmp_path: Path):
    (report,) = doctor.collect([fake("rig-a", "converged")], lock_dir=tmp_path)
    (lock,) = [c for c in report.checks if c.name == "lock"]
    assert not lock.ok and not lock.failed and str(tmp_path / "rigs.lock.yaml") in lock.message
    assert report.ok


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

    def collector(hosts, lock_dir):
        seen.extend(hosts)
        assert lock_dir == tmp_path  # a relative lock_file sits next to the fleet file
        return doctor.collect([fake("rig-b", "one-gpu")], lock_dir=lock_dir)

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
    assert any(c["name"] == "gpu-layout" and not c["ok"] for c in host["checks"])
    assert host["facts"]["gpu_memory"][0]["memory_total_mib"] == 24576 and host["facts"]["driver_cuda"] == "12.4"
    assert host["facts"]["topology"] == {"gpus": [0], "links": {}, "p2p": None}


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


def test_what_could_not_be_checked_is_a_failure() -> None:
    from rigup.checks.preflight import Check
    from rigup.cli.doctor import HostReport

    passed = Check("os", True, "info", "Ubuntu 24.04")
    assert HostReport("rig", True, [passed]).ok
    assert not HostReport("rig", True, []).ok  # reachable, but nothing was checked
    assert not HostReport("rig", True, [passed], error="a fact could not be read (see the log above)").ok
    assert not HostReport("rig", True, error="CalledProcessError: sudo: not found").ok
    assert not HostReport("rig", False, error="could not connect").ok
    doc = HostReport("rig", True, [], error="sudo: not found").to_json()
    assert doc["ok"] is False and doc["error"] == "sudo: not found"


def test_doctor_reports_the_fleet_cas_days_to_expiry_and_makes_nothing(tmp_path: Path, capsys) -> None:
    from rigup.desired.fleet_ca import ensure_ca, issue, sans_of

    fleet = tmp_path / "rigs.yaml"
    fleet.write_text("groups: {rigs: {hosts: {rig-01: {ssh_hostname: 10.0.0.1}}}}\n")
    args = argparse.Namespace(fleet=str(fleet), limit=[], data=[], json=False, verbose=False)
    out = io.StringIO()
    doctor.run(args, out, lambda hosts, lock_dir: doctor.collect([fake("rig-b", "one-gpu")], lock_dir=lock_dir))
    assert f"fleet CA  CA: none yet at {tmp_path / 'fleet-ca' / 'ca.crt'}" in out.getvalue()
    assert not (tmp_path / "fleet-ca").exists()  # doctor is read-only
    data = {**load_defaults(), "ssh_hostname": "10.0.0.1"}
    ca = ensure_ca(data, base_dir=tmp_path)
    issue(ca, "rig-01", "node-exporter", sans_of(["rig-01"]), days=20, renew_days=30 - 20)
    args.json = True
    out = io.StringIO()
    doctor.run(args, out, lambda hosts, lock_dir: doctor.collect([fake("rig-b", "one-gpu")], lock_dir=lock_dir))
    ages = json.loads(out.getvalue())["fleet_ca"]["certificates"]
    assert [a["what"] for a in ages] == ["CA", "rig-01/node-exporter"]
    assert 3649 < ages[0]["days_left"] <= 3650 and 19 < ages[1]["days_left"] <= 20
    assert doctor.format_certificates([doctor.CertificateAge("rig-01/prometheus", tmp_path, 12.0)], 30) == (
        f"fleet CA  rig-01/prometheus: 12 days to expiry (renew at next converge)  {tmp_path}")
