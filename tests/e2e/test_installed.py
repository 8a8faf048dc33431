"""An installed rigup (a wheel, not the checkout) runs `rigup sandbox up`: the test bed, its stand-ins
and the deploy ship with the package, and user files land in the directory it runs in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from rigup_testbed.image import REPO_ROOT, cache_dir

pytestmark = pytest.mark.e2e


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]


def test_an_installed_wheel_brings_a_sandbox_up(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    built = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO_ROOT), "-w", str(wheels)], timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("rigup-*.whl")

    # A fresh venv; its dependencies come from this venv's site-packages through a .pth file, which
    # does not run this venv's own .pth files, so the editable install of the checkout stays out.
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).returncode == 0
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "rigup-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)])
    assert installed.returncode == 0, installed.stderr

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "RIGUP_HOME", "RIGUP_RIGS"}}
    env.update(RIGUP_TESTBED_CACHE=str(cache_dir()), RIGUP_SANDBOX_INSTANCE="rigwhl")
    where = run([str(python), "-c", "import rigup, rigup_testbed; print(rigup.__file__, rigup.DEPLOY_ROOT, rigup.WORK_DIR)"],
                cwd=work, env=env)
    module, deploy_root, work_dir = where.stdout.split()
    assert module.startswith(str(site)), where.stdout  # the wheel's code, not the checkout's
    assert Path(deploy_root) == site / "rigup" / "_deploy" and (Path(deploy_root) / "group_data" / "all.py").is_file()
    assert Path(work_dir) == work

    rigup = str(venv / "bin" / "rigup")
    try:
        up = run([rigup, "sandbox", "up", "--hosts", "1", "--hardware", "1x3090", "--json"], cwd=work, env=env, timeout=900)
        assert up.returncode == 0, up.stdout + up.stderr
        fleet_file = work / "sandbox" / "rigs.yaml"
        assert fleet_file.is_file()
        status = run([rigup, "sandbox", "status", "--json"], cwd=work, env=env, timeout=120)
        assert status.returncode == 0, status.stderr
        shown = json.loads(status.stdout)
        assert shown["up"] and shown["fleet_file"] == str(fleet_file), shown
        assert [(h["name"], h["hardware"], h["running"]) for h in shown["hosts"]] == [("rig-01", "1x3090", True)], shown
        # The booted host answers over SSH with the settings the fleet file gives.
        doctor = run([rigup, "doctor", "--fleet", str(fleet_file), "--json"], cwd=work, env=env, timeout=300)
        assert '"rig-01"' in doctor.stdout, doctor.stdout + doctor.stderr
    finally:
        down = run([rigup, "sandbox", "down"], cwd=work, env=env, timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
    assert not (work / "sandbox").exists()
