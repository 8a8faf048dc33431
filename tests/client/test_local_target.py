"""A fleet host named @local (pyinfra's local connector) is reached without SSH: its API is on
127.0.0.1 and the commands status and verify run on it execute here."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rigup.client.ssh import LazySsh, LocalSession
from rigup.client.targets import fleet_targets
from rigup.desired.fleet import load_fleet
from rigup.desired.knobs import load_defaults
from rigup.desired.pod_keys import pod_key
from rigup.desired.recipe import resolve
from tests.support.responder import responder


def local_fleet(tmp_path: Path, extra: str = "") -> Path:
    fleet = tmp_path / "rigs.yaml"
    fleet.write_text(f'groups:\n  local:\n    hosts:\n      "@local": {{variant: single{extra}}}\n')
    return fleet


def test_the_local_host_is_a_target_on_loopback_whose_commands_run_here(tmp_path: Path) -> None:
    (target,) = fleet_targets(fleet=load_fleet(local_fleet(tmp_path)))
    assert target.name == "@local" and target.api_url == "http://127.0.0.1:8020"
    assert target.ssh is not None and target.ssh.local
    runner = LazySsh(target.ssh)
    result = runner.run("id -u; echo $RIGUP_MARK", timeout=10)
    assert result.rc == 0 and result.stdout.split() == [str(os.getuid())]  # this process's user, no SSH
    assert isinstance(runner.session, LocalSession)
    assert runner.run("exit 3").rc == 3


def test_status_reads_the_local_host_without_ssh(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # In this process, so the recipe is read from the upstream fixture trees (tests/conftest.py), not github.
    from rigup.cli import main

    monkeypatch.setenv("RIGUP_RIGS", str(local_fleet(tmp_path)))
    main(["status", "--json"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    (host,) = json.loads(out)["hosts"]
    items = {i["item"]: i for i in host["items"]}
    assert host["host"] == "@local" and host["url"] == "http://127.0.0.1:8020"
    # The unit and provenance were read here (nothing is installed on this machine), not over SSH.
    assert items["service"]["actual"] == "not installed, not enabled"
    assert items["provenance"]["actual"] == "none (never passed the health gate)"
    assert "ssh" not in json.dumps(items).lower()
    main(["status"])  # the table, with progress lines: where the state comes from
    err = capsys.readouterr().err
    assert "[@local] gathering state here (pyinfra's local connector) ..." in err and "SSH" not in err


def test_status_names_its_exit_code_for_a_fleet_it_cannot_use(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from rigup.cli import main

    monkeypatch.setenv("RIGUP_RIGS", str(tmp_path / "missing.yaml"))
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--help"])
    assert exit_info.value.code == 0
    assert "4 the fleet\nfile or --limit could not be used" in capsys.readouterr().out
    assert main(["status"]) == 4
    assert "fleet file not found" in capsys.readouterr().err


def test_verify_checks_the_local_api(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from rigup.cli import main

    served = resolve({**load_defaults(), "variant": "single"}).served_model_name
    with responder(tmp_path, "--max-model-len", "48000", model=served) as server:
        port = int(server.url.rsplit(":", 1)[1])
        monkeypatch.setenv("RIGUP_RIGS", str(local_fleet(tmp_path, f", variant_overrides: {{port: {port}}}")))
        pod_key({}, "@local", "single", tmp_path)  # the pod's own key, as its converge made it beside the fleet file
        code = main(["verify", "--json", "--log-file", str(server.log_file)])
    report = json.loads(capsys.readouterr().out)
    (host,) = report["hosts"]
    assert host["host"] == "@local" and host["url"] == f"http://127.0.0.1:{port}"
    results = {r["check"]: r["outcome"] for r in host["results"]}
    assert results["models"] == "pass" and code == host["failed"] == 0, host["results"]
