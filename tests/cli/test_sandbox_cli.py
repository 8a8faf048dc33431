"""`rigup sandbox up` on a machine that lacks the test bed's tools says which and to run scripts/setup,
before touching anything."""

from __future__ import annotations

import argparse
import os
import shutil

import pytest

from rigup.cli import sandbox


def test_missing_tools_are_named_with_their_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.which
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool: None if tool in ("debootstrap", "systemd-nspawn") else real(tool))
    assert sandbox.missing_prerequisites()[:2] == ["debootstrap (debootstrap)", "systemd-nspawn (systemd-container)"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the root check comes first")
def test_sandbox_up_refuses_and_points_at_scripts_setup(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool: None if tool == "debootstrap" else "/usr/bin/" + tool)
    monkeypatch.setattr(sandbox, "_testbed", lambda: pytest.fail("the test bed must not be touched"))
    code = sandbox.run(argparse.Namespace(sandbox_command="up", hosts=1, hardware="1x3090", canary=1, replace=False, json=False))
    assert code == 2
    err = capsys.readouterr().err
    assert "this machine lacks debootstrap (debootstrap)" in err and "run scripts/setup" in err
    assert "Traceback" not in err
