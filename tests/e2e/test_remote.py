"""The control machine's read-only SSH path (rigup/client/ssh.py) on real test-bed hosts: the fleet's SSH
settings, sudo, and the service journal that verify and bench read SpecDecoding lines and patch
markers from (journalctl of the unit's current run, over SSH)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from rigup.checks.verify import acceptance_length
from rigup.cli.verify import SPEC_LINE
from rigup.client.ssh import JournalLog, LazySsh, RemoteError, SshSession, SshSettings
from rigup.client.targets import fleet_targets
from rigup.desired.fleet import load_fleet
from rigup_testbed.fleet import Testbed

pytestmark = pytest.mark.e2e


def test_ssh_session_runs_commands_as_the_fleet_user_and_as_root(testbed: Testbed, fleet_file: Path) -> None:
    target = fleet_targets(fleet=load_fleet(fleet_file))[0]
    assert target.ssh is not None and target.ssh.strict_host_key_checking
    with SshSession(target.ssh) as session:
        assert session.run("id -un").stdout.strip() == session.user != "root"
        assert session.run("id -un", sudo=True).stdout.strip() == "root"
        failed = session.run("echo oops >&2; exit 3")
        assert (failed.rc, failed.stderr.strip()) == (3, "oops")
        big = session.run("head -c 300000 /dev/zero | tr '\\0' x")
        assert len(big.stdout) == 300000  # output larger than one channel window


def test_unknown_host_key_is_refused_under_strict_checking(testbed: Testbed, fleet_file: Path, tmp_path: Path) -> None:
    target = fleet_targets(fleet=load_fleet(fleet_file))[0]
    assert target.ssh is not None
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    strict = SshSettings(**{**target.ssh.__dict__, "known_hosts_file": str(empty), "strict_host_key_checking": "yes"})
    with pytest.raises(RemoteError, match="host key unknown"):
        SshSession(strict).connect()
    lazy = LazySsh(strict)
    for _ in range(2):  # tried once, then the same failure at once
        with pytest.raises(RemoteError):
            lazy.run("true")


def test_journal_of_the_units_current_run_is_read(testbed: Testbed, fleet_file: Path) -> None:
    target = fleet_targets(fleet=load_fleet(fleet_file))[0]
    unit = "rigup-e2e-journal.service"
    ssh = LazySsh(target.ssh)
    try:
        def start(line: str) -> None:
            script = shlex.quote(f"echo {shlex.quote(line)}")
            ssh.run(f"systemctl stop {unit} 2>/dev/null; systemctl reset-failed {unit} 2>/dev/null; "
                    f"systemd-run --quiet --unit={unit} --remain-after-exit sh -c {script}", sudo=True)

        start("INFO [metrics.py:96] SpecDecoding metrics: Mean acceptance length: 1.20, Accepted: 3 tokens")
        start("INFO [metrics.py:96] SpecDecoding metrics: Mean acceptance length: 3.10, Accepted: 9 tokens")
        log = JournalLog(ssh, unit)
        for _ in range(50):  # journald may take a moment to index the new line
            lines = log.grep(SPEC_LINE, 5)
            if lines:
                break
        # Only this run of the unit counts: the first start's 1.20 is not in its invocation.
        assert [acceptance_length(lines)] == [3.10] and len(lines) == 1
        assert any("Mean acceptance length: 1.20" in line for line in log.tail(50))
        assert log.grep("no such marker", 5) == []
    finally:
        ssh.run(f"systemctl stop {unit}; systemctl reset-failed {unit} 2>/dev/null; true", sudo=True)
        ssh.close()
