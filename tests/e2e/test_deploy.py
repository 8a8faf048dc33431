"""The whole job on fresh test-bed rigs: lock, `pyinfra inventory.py deploy.py`, then converge again.

The first converge takes two fresh 2x RTX 3090 hosts to health-gated vLLM servers (driver installed
and loaded through a real reboot, Docker, toolkit, sources, verified model, serving unit). The second
must change nothing: pyinfra's JSON results list no host under `success` for any operation.
An HF token given to the control machine must not leak into pyinfra's output or onto the rigs
outside 0600 files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve
from rigup.layout import RigLayout
from rigup_testbed.fleet import Testbed
from rigup_testbed.image import CA_FILE_NAME, CA_STORE
from tests.e2e.helpers import PYINFRA, pod_key_of, run, run_json

pytestmark = pytest.mark.e2e

TOKEN = "hf_e2eSecretTokenThatMustNotLeak42"


def deploy(fleet: Path) -> tuple[dict[str, Any], str, float]:
    started = time.monotonic()
    argv = [PYINFRA, "-y", "--json", "inventory.py", "deploy.py"]
    code, results, log = run_json(argv, fleet, 1500, env={"HF_TOKEN": TOKEN})
    elapsed = time.monotonic() - started
    assert code == 0, log[-6000:]
    return results, log, elapsed


@pytest.fixture(scope="module")
def bed(testbed_factory: Any) -> Testbed:
    # Its own fresh hosts: the session's shared `testbed` is for tests that need undeployed rigs.
    from tests.e2e.conftest import default_specs

    return testbed_factory(default_specs())


@pytest.fixture(scope="module")
def fleet(bed: Testbed) -> Path:
    path = bed.write_fleet(bed.workdir / "deploy-rigs.yaml")
    locked = run([sys.executable, "-m", "rigup", "lock"], path, 1500, env={"HF_TOKEN": TOKEN})
    assert locked.returncode == 0, locked.stdout + locked.stderr
    return path


@pytest.fixture(scope="module")
def converges(fleet: Path) -> list[tuple[dict[str, Any], str, float]]:
    first = deploy(fleet)
    second = deploy(fleet)
    print(f"full deploy on 2 fresh hosts: {first[2]:.1f} s; converged re-run: {second[2]:.1f} s")
    return [first, second]


def test_first_converge_brings_every_host_up_without_errors(bed: Testbed, fleet: Path, converges: Any) -> None:
    results, _, _ = converges[0]
    operations = results["results"]["operations"]
    assert [op["name"] for op in operations if op["error"]] == []
    names = {h.name for h in bed.hosts}
    changed = {host for op in operations for host in op["success"]}
    assert changed == names
    recipe = resolve({**load_defaults(), "variant": "dual"})
    for host in bed.hosts:
        # keyed by default: the pod's own key, made on the control machine (rigup.desired.pod_keys)
        ask = urllib.request.Request(f"http://{host.ip}:{recipe.host_port}/v1/models",
                                     headers={"Authorization": f"Bearer {pod_key_of(fleet, host.name, 'dual')}"})
        with urllib.request.urlopen(ask, timeout=10) as reply:
            served = [m["id"] for m in json.load(reply)["data"]]
        assert recipe.served_model_name in served, host.name
        active = host.ssh(f"systemctl is-active {recipe.paths.unit_name}", check=False).stdout.strip()
        assert active == "active", host.name


def test_second_converge_changes_nothing(converges: Any) -> None:
    results, _, _ = converges[1]
    changed = [(op["name"], op["success"]) for op in results["results"]["operations"] if op["success"]]
    assert changed == []
    assert all(not op["error"] for op in results["results"]["operations"])


def test_hf_token_stays_out_of_output_and_world_readable_files(bed: Testbed, converges: Any) -> None:
    for _, log, _ in converges:
        assert TOKEN not in log
    for host in bed.hosts:
        # The pattern goes in on stdin: on our own command line sudo would log it to the journal we search.
        found = subprocess.run(
            [*host.ssh_argv(), "sudo grep -rlF -f /dev/stdin /opt/rigup /etc/systemd/system /var/log /tmp || true"],
            input=TOKEN + "\n", text=True, capture_output=True, timeout=60,
        ).stdout.split()
        # The token must reach the rig (the pod's 0600 secret file) but nowhere readable by others.
        assert any(path.endswith("/secrets/HF_TOKEN") for path in found), found
        for path in found:
            mode = host.ssh(f"sudo stat -c %a {path}", check=False).stdout.strip()
            assert mode == "600", f"{host.name}: {path} holds the token with mode {mode}"


def test_long_work_shows_progress_and_each_converge_ends_with_an_account(bed: Testbed, converges: Any) -> None:
    """At pyinfra's default verbosity: rigfetch's progress lines and the reboot appear per host as they
    happen, and the run ends with one row per host saying what it did."""
    _, log, _ = converges[0]
    lines = log.splitlines()
    for host in bed.hosts:
        assert any(host.name in line and "rigfetch: progress: downloaded" in line for line in lines), host.name
        assert any(host.name in line and "rebooted in" in line for line in lines), host.name
    first = log[log.index("--> What this converge did, per host:"):].splitlines()[1:]
    assert first[0].split() == ["HOST", "RESULT", "REMOTE", "COMMANDS", "WHAT", "THIS", "CONVERGE", "DID"]
    for host in bed.hosts:
        (row,) = [line for line in first if line.split()[:1] == [host.name]]
        assert row.split()[1] == "ok", row
        for part in ("installed and loaded", "rebooted in", "downloaded", "image pulled in",
                     "rigup-dual.service started", "health gate passed in"):
            assert part in row, (part, row)
    _, log, _ = converges[1]
    second = log[log.index("--> What this converge did, per host:"):].splitlines()[1:]
    for host in bed.hosts:
        (row,) = [line for line in second if line.split()[:1] == [host.name]]
        # the second converge: nothing to do, and (the facts the first asked read in one batch) few
        # round trips: those the first did not ask (checksums of files it had just uploaded) singly
        result, commands, *what = row.split()[1:]
        assert (result, what) == ("ok", ["no", "change"]) and int(commands) <= 15, row


def test_a_rig_that_does_not_trust_the_hubs_certificate_fails_in_preflight_in_one_line(bed: Testbed, fleet: Path,
                                                                                       converges: Any) -> None:
    """The bed speaks TLS as the world does. rig-02 loses the bed's CA from its trust store (a box behind a
    TLS-intercepting proxy whose CA nobody installed): the converge fails that host in preflight with one line
    naming it, a URL it would reach and that the certificate is not trusted, without a traceback, and changes
    nothing there (a drifted file the converge would put back stays drifted)."""
    host = bed.hosts[1]
    ctl = RigLayout(str(load_defaults()["install_root"])).servingctl
    host.ssh(f"sudo rm {CA_STORE}/{CA_FILE_NAME} && sudo update-ca-certificates --fresh >/dev/null")
    try:
        host.ssh(f"echo '# drifted' | sudo tee -a {ctl} >/dev/null")
        before = host.ssh(f"sudo sha256sum {ctl}").stdout
        started = time.monotonic()
        code, results, log = run_json([PYINFRA, "-y", "--json", "--limit", host.name, "inventory.py", "deploy.py"], fleet, 600)
        print(f"converge refused by preflight: {time.monotonic() - started:.1f} s")
        assert code != 0, log[-4000:]
        said = [line for line in log.splitlines() if "not trusted" in line]
        assert len(said) == 1, said
        print(said[0])
        hub = f"https://{bed.ledger.info['hub_ip']}:"
        assert host.name in said[0] and hub in said[0] and "https-trust" in said[0], said[0]
        assert "Traceback" not in log, log[-4000:]
        assert [op["name"] for op in results["results"]["operations"] if op["success"]] == []
        assert host.ssh(f"sudo sha256sum {ctl}").stdout == before
    finally:
        subprocess.run([*host.ssh_argv(), f"sudo tee {CA_STORE}/{CA_FILE_NAME} >/dev/null && sudo update-ca-certificates >/dev/null"],
                       input=bed.ca_cert.read_text() if bed.ca_cert else "", text=True, check=True, timeout=60,
                       capture_output=True)
