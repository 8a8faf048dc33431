"""The GPU power unit and the static files the host layer installs, checked by the real tools."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest

from rigup import REPO_ROOT

UNIT = "rigup-gpu-power.service"


def render(**values: object) -> str:
    # The settings pyinfra's files.template uses: StrictUndefined, trailing newline kept.
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    template = env.from_string((REPO_ROOT / "templates" / f"{UNIT}.j2").read_text())
    return template.render(nvidia_smi="/usr/bin/nvidia-smi", **values)


def test_unit_lines_follow_the_knobs():
    both = render(persistence=True, power_cap_watts=230)
    assert [l for l in both.splitlines() if l.startswith("ExecStart=")] == [
        "ExecStart=/usr/bin/nvidia-smi -pm 1",
        "ExecStart=/usr/bin/nvidia-smi -pl 230",
    ]
    cap_only = render(persistence=False, power_cap_watts=250)
    assert [l for l in cap_only.splitlines() if l.startswith("ExecStart=")] == ["ExecStart=/usr/bin/nvidia-smi -pl 250"]
    assert "After=nvidia-persistenced.service" in both and "Before=docker.service" in both
    with pytest.raises(jinja2.UndefinedError):
        jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(
            (REPO_ROOT / "templates" / f"{UNIT}.j2").read_text()
        ).render(persistence=True)


def test_unit_passes_systemd_analyze_verify(tmp_path: Path):
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze not installed (Debian package systemd)")
    root = tmp_path / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    (units / "docker.service").write_text("[Unit]\nDescription=stub\n[Service]\nExecStart=/usr/bin/true\n")
    smi = root / "usr/bin/nvidia-smi"
    smi.parent.mkdir(parents=True, exist_ok=True)
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    (units / UNIT).write_text(render(persistence=True, power_cap_watts=230))
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"--root={root}", f"/etc/systemd/system/{UNIT}"],
        capture_output=True, text=True, timeout=60,
    )
    messages = [l for l in proc.stderr.splitlines() if UNIT in l]
    assert proc.returncode == 0 and messages == [], proc.stderr


def test_udev_rule_runs_the_symlink_command():
    rule = (REPO_ROOT / "files/71-nvidia-dev-char.rules").read_text()
    (line,) = [l for l in rule.splitlines() if l and not l.startswith("#")]
    assert line == (
        'ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
        'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"'
    )


def test_unattended_upgrades_snippet_parses_with_apt_config(tmp_path: Path):
    if shutil.which("apt-config") is None:
        pytest.skip("apt-config not available")
    snippet = REPO_ROOT / "files/52rigup-nvidia-driver"
    proc = subprocess.run(
        ["apt-config", "-c", str(snippet), "dump", "Unattended-Upgrade::Package-Blacklist"],
        capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert 'Unattended-Upgrade::Package-Blacklist:: "nvidia-";' in proc.stdout
    assert 'Unattended-Upgrade::Package-Blacklist:: "libnvidia-";' in proc.stdout


def test_nouveau_blacklist():
    lines = [l for l in (REPO_ROOT / "files/blacklist-nouveau.conf").read_text().splitlines() if l and l[0] != "#"]
    assert lines == ["blacklist nouveau", "options nouveau modeset=0"]
