"""rigup status: drift and health judged from scripted remote facts (a fake SSH runner), with the
file-hash command run for real in a local shell."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rigup.cli import status as S
from rigup.client.ssh import CommandResult, RemoteError
from rigup.client.targets import Target
from rigup.desired.knobs import load_defaults
from rigup.desired.recipe import resolve
from rigup.desired.release import build_release, parse_provenance, release_sha256
from rigup.desired.render import render_variant, secret_file
from rigup.parsers.nvidia_smi import parse_gpu_query
from tests.desired.test_release import FakeLock

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BOOTED = (FIXTURES / "capabilities/booted-sudo-user.txt").read_text()
NO_SYSTEMD = (FIXTURES / "capabilities/container-root-no-systemd.txt").read_text()  # the lent H200 host
SECRET = "sk-status-secret-0123456789"
SMI_2X3090 = (FIXTURES / "nvidia-smi" / "2x3090-580-capped.csv").read_text()


def rig(tmp_path: Path, variant: str = "dual", **data: Any) -> tuple[Target, dict[str, Any]]:
    """A host whose install_root is under tmp_path; returns the target and its desired release."""
    values = {**load_defaults(), "variant": variant, "install_root": str(tmp_path / "opt"),
              "model_dir": str(tmp_path / "opt" / "models"), "gpu_count": 2, **data}
    recipe = resolve(values, FakeLock())
    target = Target("rig-01", f"http://10.0.0.1:{recipe.host_port}", None, values, recipe)
    rendered = render_variant(recipe)
    release = build_release(recipe, {path: f.content for path, f in rendered.items()}, api_key_present=True,
                            secret_files={"VLLM_API_KEY": secret_file(recipe, "VLLM_API_KEY")}, lock=FakeLock())
    return target, release


def desired(target: Target, release: dict[str, Any] | None, **changes: Any) -> S.Desired:
    values = dict(
        host=target.name, variant=target.variant, unit=target.recipe.paths.unit_name, served_model=target.served_model,
        release=release, release_sha256=release_sha256(release) if release else None, gpu_count=2,
        tensor_parallel_size=target.recipe.tensor_parallel_size, driver_branch=580,
    )
    values.update(changes)
    return S.Desired(**values)


def provenance(release: dict[str, Any], gate: str = "passed", **extra: Any) -> str:
    """What rigup-servingctl's write_provenance records after the gate."""
    record = {
        "schema": 1, "variant": release["variant"], "unit": release["unit"], "generation": 3,
        "release_sha256": release_sha256(release), "release": release,
        "host": {"kernel": "6.8.0-45-generic", "nvidia_driver": "580.95.05", "docker": "28.0.1"},
        "gate": {"result": gate, "at": "2026-11-30T04:00:00+00:00", "ready_seconds": 212.0},
        "written_at": "2026-11-30T04:00:01+00:00", **extra,
    }
    return json.dumps(record, indent=2, sort_keys=True) + "\n"


def facts(release: dict[str, Any], **changes: Any) -> S.Facts:
    text = provenance(release)
    recorded = parse_provenance(text)
    values: dict[str, Any] = dict(
        reachable=True, provenance_text=text,
        units={release["unit"]: {"enabled": True, "active": True, "state": "active"}},
        smi=parse_gpu_query(SMI_2X3090), memory=[(22100, 24576), (21900, 24576)],
        file_hashes=dict(recorded.files),
    )
    values.update(changes)
    return S.Facts(**values)


HEALTHY = S.Health(True, "serves qwen3.6-27b-autoround (12 ms)")


def states(items: list[S.Item]) -> dict[str, str]:
    return {i.item.strip(): i.state for i in items}


def test_converged_healthy_rig_is_all_ok(tmp_path: Path) -> None:
    target, release = rig(tmp_path)
    items = S.compare(desired(target, release), facts(release), HEALTHY)
    assert {i.state for i in items} <= {S.OK, S.INFO}
    assert states(items)["release"] == S.OK and states(items)["vram MiB"] == S.INFO
    status = S.HostStatus("rig-01", "dual", target.api_url, items)
    assert (status.verdict, S.exit_code([status])) == ("OK", 0)


def test_new_pins_in_the_lock_are_drift_with_the_differences_named(tmp_path: Path) -> None:
    target, deployed = rig(tmp_path)
    newer = dict(deployed, image=dict(deployed["image"], digest="sha256:" + "9" * 64))
    items = S.compare(desired(target, newer), facts(deployed), HEALTHY)
    found = states(items)
    assert found["release"] == S.DRIFT and found["image.digest"] == S.DRIFT
    assert found["gate"] == S.OK and found["files"] == S.OK  # the rig itself is as recorded
    status = S.HostStatus("rig-01", "dual", None, items)
    assert (status.verdict, S.exit_code([status])) == ("DRIFT", S.EXIT_DRIFT)


def test_variant_change_in_the_fleet_is_drift(tmp_path: Path) -> None:
    target, wanted = rig(tmp_path, variant="dual-turbo")
    _, running = rig(tmp_path, variant="dual")
    run_facts = facts(running, units={
        "rigup-dual.service": {"enabled": True, "active": True, "state": "active"},
    })
    items = S.compare(desired(target, wanted), run_facts, HEALTHY)
    found = states(items)
    assert found["variant"] == S.DRIFT and found["release"] == S.DRIFT and found["unit"] == S.DRIFT
    assert found["service"] == S.UNHEALTHY  # rigup-dual-turbo is not installed
    assert found["other variants"] == S.DRIFT


def test_hand_edited_or_missing_files_on_the_rig_are_drift(tmp_path: Path) -> None:
    target, release = rig(tmp_path)
    recorded = parse_provenance(provenance(release))
    now = dict(recorded.files, **{"compose.yaml": "0" * 64, "unit": None})
    items = S.compare(desired(target, release), facts(release, file_hashes=now), HEALTHY)
    found = states(items)
    assert found["file compose.yaml"] == S.DRIFT and found["file unit"] == S.DRIFT
    assert next(i for i in items if i.item == "file unit").actual == "missing"
    assert found["release"] == S.OK  # the fleet wants what was deployed; the rig changed under it


def test_service_gate_health_and_gpus_make_a_rig_unhealthy(tmp_path: Path) -> None:
    target, release = rig(tmp_path)
    broken = facts(release, units={release["unit"]: {"enabled": True, "active": False, "state": "failed"}},
                   smi=parse_gpu_query(SMI_2X3090.splitlines()[0]))
    items = S.compare(desired(target, release), broken, S.Health(False, "GET /v1/models: no response (connection refused)"))
    found = states(items)
    assert found["service"] == S.UNHEALTHY and found["health"] == S.UNHEALTHY and found["gpus"] == S.UNHEALTHY
    status = S.HostStatus("rig-01", "dual", None, items)
    assert status.verdict == "UNHEALTHY" and S.exit_code([status]) == S.EXIT_UNHEALTHY

    failed_gate = facts(release, provenance_text=provenance(release, gate="failed"))
    assert states(S.compare(desired(target, release), failed_gate, HEALTHY))["gate"] == S.UNHEALTHY


def test_driver_below_the_wanted_branch_is_drift_and_a_mismatch_unhealthy(tmp_path: Path) -> None:
    target, release = rig(tmp_path)
    old = (FIXTURES / "nvidia-smi" / "1x3090-550.csv").read_text()
    items = S.compare(desired(target, release, gpu_count=1), facts(release, smi=parse_gpu_query(old)), HEALTHY)
    assert states(items)["driver"] == S.DRIFT
    assert states(items)["gpus"] == S.UNHEALTHY  # one GPU for a TP=2 variant
    assert next(i for i in items if i.item == "driver since gate").state == S.INFO
    mismatch = parse_gpu_query((FIXTURES / "nvidia-smi" / "mismatch.txt").read_text())
    items = S.compare(desired(target, release), facts(release, smi=mismatch, memory=None), HEALTHY)
    assert states(items)["driver"] == S.UNHEALTHY


def test_gpu_count_differing_from_the_knob_is_drift(tmp_path: Path) -> None:
    target, release = rig(tmp_path, variant="single", gpu_count=1)
    items = S.compare(desired(target, release, gpu_count=1), facts(release), HEALTHY)
    assert states(items)["gpus"] == S.DRIFT  # two cards where the fleet file says one


def test_never_deployed_unreachable_and_unbuildable(tmp_path: Path) -> None:
    target, release = rig(tmp_path)
    fresh = S.Facts(reachable=True, smi=parse_gpu_query(SMI_2X3090))
    items = S.compare(desired(target, release), fresh, S.Health(False, "no response (connection refused)"))
    assert states(items)["provenance"] == S.DRIFT and states(items)["service"] == S.UNHEALTHY
    gone = S.compare(desired(target, release), S.Facts(reachable=False, error="ssh ops@10.0.0.1:22: timed out"), HEALTHY)
    assert states(gone)["ssh"] == S.UNHEALTHY
    no_lock = desired(target, None, problem="rigs.lock.yaml: missing entries for rig-01")
    items = S.compare(no_lock, facts(release), HEALTHY)
    assert states(items)["desired"] == S.DRIFT and "release" not in states(items)


def test_a_rolled_back_release_is_reported(tmp_path: Path) -> None:
    target, deployed = rig(tmp_path)
    wanted = dict(deployed, engine=dict(deployed["engine"], max_model_len=131072))
    rollback = {"at": "2026-11-30T05:00:00+00:00", "failed_release_sha256": release_sha256(wanted),
                "reason": "KV cache needed is larger than available", "outcome": "rolled back"}
    text = provenance(deployed, last_rollback=rollback)
    items = S.compare(desired(target, wanted), facts(deployed, provenance_text=text), HEALTHY)
    found = states(items)
    assert found["rollback"] == S.DRIFT and found["engine.max_model_len"] == S.DRIFT


def test_release_differences_are_keyed_by_name() -> None:
    want = {"sources": [{"name": "genesis", "commit": "a" * 40}], "models": [{"repo_id": "org/m", "revision": "b"}]}
    have = {"sources": [{"name": "genesis", "commit": "c" * 40}], "models": [{"repo_id": "org/m", "revision": "b"}]}
    assert S.release_differences(want, have) == [("sources.genesis.commit", "a" * 40, "c" * 40)]


class LocalRunner:
    """Runs the command in a local shell (sudo dropped), like SshSession would on the rig."""

    def __init__(self, canned: dict[str, str]) -> None:
        self.canned = canned
        self.commands: list[tuple[str, bool]] = []

    def run(self, command: str, *, sudo: bool = False, timeout: float = 30.0, stdin: bytes | None = None) -> CommandResult:
        self.commands.append((command, sudo))
        for needle, output in self.canned.items():
            if needle in command:
                return CommandResult(0, output, "")
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout)
        return CommandResult(done.returncode, done.stdout, done.stderr)


def test_gather_facts_hashes_files_without_their_secrets(tmp_path: Path) -> None:
    target, release = rig(tmp_path)
    recipe = target.recipe
    rendered = render_variant(recipe)
    unit_copy = tmp_path / "etc" / "rigup-dual.service"
    release = dict(release, unit_file=str(unit_copy))  # where this test can write the unit
    for path, f in rendered.items():
        dest = unit_copy if "/" + path == recipe.paths.unit_file else Path("/" + path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f.content)
    key = Path(secret_file(recipe, "VLLM_API_KEY"))  # the pod's key file: status hashes no secret file
    key.parent.mkdir(mode=0o700)
    key.write_text(SECRET + "\n")
    state = Path(recipe.paths.state_dir)
    state.mkdir(parents=True)
    (state / "provenance.json").write_text(provenance(release))
    runner = LocalRunner({
        "pid1=": BOOTED,
        "rigup-*.service": f"{release['unit']} enabled active\nrigup-dual-turbo.service disabled inactive\n",
        "--query-gpu=index,name": SMI_2X3090,
        "--query-gpu=index,memory.used": "0, 22100, 24576\n1, 21900, 24576\n",
    })
    gathered = S.gather_facts(runner, recipe.paths.install_root)
    recorded = parse_provenance(gathered.provenance_text or "")
    assert gathered.file_hashes == recorded.files
    assert gathered.memory == [(22100, 24576), (21900, 24576)] and len(gathered.smi.gpus) == 2
    assert gathered.units["rigup-dual-turbo.service"]["state"] == "inactive"
    hash_command, sudo = runner.commands[-1]
    assert sudo and SECRET not in hash_command
    items = S.compare(desired(target, release), gathered, HEALTHY)
    assert {i.state for i in items} <= {S.OK, S.INFO}

    compose = Path(recipe.paths.compose_file)
    compose.write_text(compose.read_text() + "# edited by hand\n")
    (tmp_path / "opt" / "variants" / "dual" / ".env").write_text("OTHER=1\n")
    gathered = S.gather_facts(runner, recipe.paths.install_root)
    changed = {k for k, v in gathered.file_hashes.items() if v != recorded.files[k]}
    assert changed == {"compose.yaml", ".env"}


def test_gather_facts_without_provenance_or_nvidia_smi() -> None:
    runner = LocalRunner({"provenance.json": "__RIGUP_ABSENT__\n", "rigup-*.service": "", "nvidia-smi": "__ABSENT__\n"})
    gathered = S.gather_facts(runner, "/opt/rigup")
    assert gathered.provenance_text is None and gathered.units == {}
    assert gathered.file_hashes == {}


def test_a_host_without_systemd_running_says_it_cannot_run_services(tmp_path: Path) -> None:
    """The lent H200 host's capabilities (process 1 is not systemd): the unit is not merely "not
    installed", the host cannot run one, in preflight's words and with its fix."""
    target, release = rig(tmp_path)
    runner = LocalRunner({"pid1=": NO_SYSTEMD, "provenance.json": "__RIGUP_ABSENT__\n", "rigup-*.service": "",
                          "nvidia-smi": "__ABSENT__\n"})
    gathered = S.gather_facts(runner, "/opt/rigup")
    assert gathered.capabilities is not None and not gathered.capabilities.systemd_running
    items = {i.item: i for i in S.compare(desired(target, release), gathered, HEALTHY)}
    systemd = items["systemd"]
    assert systemd.state == S.UNHEALTHY
    assert systemd.actual.startswith("process 1 is 'process_api', /run/systemd/system is absent: rigup's units")
    assert systemd.note == "fix: deploy to a host booted with systemd (a container without systemd cannot be a rig)"

    runner = LocalRunner({"pid1=": BOOTED, "provenance.json": "__RIGUP_ABSENT__\n", "rigup-*.service": "",
                          "nvidia-smi": "__ABSENT__\n"})
    assert "systemd" not in {i.item for i in S.compare(desired(target, release), S.gather_facts(runner, "/opt/rigup"), HEALTHY)}


def test_gather_facts_reads_a_failed_units_journal_as_root() -> None:
    runner = LocalRunner({
        "provenance.json": "__RIGUP_ABSENT__\n", "nvidia-smi": "__ABSENT__\n",
        "rigup-*.service": "rigup-dual.service enabled failed Result=exit-code NRestarts=5 \n"
                           "rigup-single.service disabled inactive Result=success NRestarts=0 \n",
        "journalctl -u rigup-dual.service": "rigup-dual  | RuntimeError: CUDA error\nrigup-dual.service: Start request repeated too quickly.\n",
    })
    gathered = S.gather_facts(runner, "/opt/rigup")
    assert gathered.units["rigup-dual.service"]["restarts"] == 5
    assert gathered.unit_logs == {"rigup-dual.service": ["rigup-dual  | RuntimeError: CUDA error",
                                                         "rigup-dual.service: Start request repeated too quickly."]}
    (journal,) = [(c, sudo) for c, sudo in runner.commands if c.startswith("journalctl")]
    assert journal[1]  # root's to read


def test_host_status_marks_an_unreachable_rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, release = rig(tmp_path)

    def refuse(runner: Any, install_root: str, record: str | None = None, peers: Any = None) -> S.Facts:
        raise RemoteError("ssh ops@10.0.0.1:22: connection refused")

    monkeypatch.setattr(S, "desired_state", lambda t, topology=None, network=None: desired(t, release))
    monkeypatch.setattr(S, "gather_facts", refuse)
    monkeypatch.setattr(S, "check_health", lambda t: S.Health(False, "GET /v1/models: no response (connection refused)"))
    status = S.host_status(target, quiet=True)
    assert status.verdict == "UNHEALTHY"
    assert states(status.items) == {"ssh": S.UNHEALTHY, "health": S.UNHEALTHY}
    table = S.render_table([status])
    assert "rig-01" in table and "UNHEALTHY" in table and "connection refused" in table


def test_cli_prints_json_and_exits_with_drift_and_health_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rigup.cli import main

    fleet = tmp_path / "rigs.yaml"
    fleet.write_text("groups:\n  canary:\n    hosts:\n      rig-01: {ssh_hostname: 10.0.0.1}\n"
                     "  rigs:\n    hosts:\n      rig-02: {ssh_hostname: 10.0.0.2}\n")
    monkeypatch.setenv("RIGUP_RIGS", str(fleet))
    verdicts = {"rig-01": S.Item("release", "a", "b", S.DRIFT), "rig-02": S.Item("health", "x", "y", S.UNHEALTHY)}
    seen: list[str] = []

    def fake(target: Target, quiet: bool = False, peers: Any = None) -> S.HostStatus:
        assert peers == {}  # in no cluster
        seen.append(target.name)
        assert target.api_url == f"http://10.0.0.{target.name[-1]}:{target.recipe.host_port}"
        return S.HostStatus(target.name, target.variant, target.api_url, [verdicts[target.name]])

    monkeypatch.setattr(S, "host_status", fake)
    assert main(["status", "--json"]) == S.EXIT_DRIFT | S.EXIT_UNHEALTHY
    report = json.loads(capsys.readouterr().out)
    assert [(h["host"], h["verdict"]) for h in report["hosts"]] == [("rig-01", "DRIFT"), ("rig-02", "UNHEALTHY")]
    assert main(["status", "--limit", "canary"]) == S.EXIT_DRIFT
    assert "1 host(s): 1 drifted, 0 unhealthy" in capsys.readouterr().out
    assert seen == ["rig-01", "rig-02", "rig-01"]


def test_the_hosts_other_pods_are_not_other_variants(tmp_path: Path) -> None:
    target, release = rig(tmp_path)
    units = {u: {"enabled": True, "active": True, "state": "active"}
             for u in ("rigup-dual.service", "rigup-right.service", "rigup-single.service")}
    facts = S.Facts(reachable=True, units=units)
    items = S._unit_items(desired(target, release, host_units=("rigup-dual.service", "rigup-right.service")), facts)
    assert [(i.item, i.actual, i.state) for i in items] == [
        ("service", "active, enabled", S.OK), ("other variants", "rigup-single.service", S.DRIFT)]


def test_a_crash_looping_unit_says_so_with_the_servers_last_lines(tmp_path: Path) -> None:
    target, release = rig(tmp_path)
    unit = release["unit"]
    log = [
        "rigup-dual  | ERROR 12-03 08:12:02 [core.py] EngineCore failed to start.",
        "rigup-dual  | RuntimeError: CUDA error: an illegal memory access was encountered",
        f"{unit}: Main process exited, code=exited, status=1/FAILURE",
        f"{unit}: Scheduled restart job, restart counter is at 5.",
        f"{unit}: Start request repeated too quickly.",
        f"Failed to start {unit} - rigup vLLM server dual (port 8010).",
    ]
    looping = facts(release, units={unit: {"enabled": True, "active": False, "state": "failed", "restarts": 5,
                                           "result": "exit-code"}})
    looping.unit_logs = {unit: log}
    (service,) = [i for i in S.compare(desired(target, release), looping, HEALTHY) if i.item == "service"]
    assert service.state == S.UNHEALTHY and service.actual == "failed, enabled, 5 restart(s)"
    assert "crash loop: systemd stopped restarting it at its start limit" in service.note
    assert service.note.endswith("last lines: ERROR 12-03 08:12:02 [core.py] EngineCore failed to start. | "
                                 "RuntimeError: CUDA error: an illegal memory access was encountered")
    restarted = facts(release, units={unit: {"enabled": True, "active": True, "state": "active", "restarts": 1}})
    (service,) = [i for i in S.compare(desired(target, release), restarted, HEALTHY) if i.item == "service"]
    assert service.state == S.OK and service.actual == "active, enabled, 1 restart(s)"
    assert service.note == "systemd restarted it after its server exited"


def test_status_on_this_machine_says_whether_it_can_run_rigups_units(tmp_path: Path) -> None:
    """The real CLI on @local (pyinfra's local connector, no SSH), where nothing was deployed: a machine without systemd as process 1 (a
    container, WSL, the lent H200 host) is told it cannot run rigup's units at all, with the fix."""
    fleet = tmp_path / "rigs.yaml"
    fleet.write_text('data:\n  variant: single\n'
                     'groups:\n  rigs:\n    hosts:\n      "@local": {}\n')
    proc = subprocess.run([sys.executable, "-m", "rigup", "status"], cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "RIGUP_RIGS": str(fleet)}, capture_output=True, text=True, timeout=120)
    assert "[@local] gathering state here (pyinfra's local connector)" in proc.stderr
    assert "DRIFT" in proc.stdout  # nothing was deployed here
    booted = Path("/proc/1/comm").read_text().strip() == "systemd" and Path("/run/systemd/system").is_dir()
    if booted:
        assert "need systemd" not in proc.stdout, proc.stdout
    else:
        assert proc.returncode == S.EXIT_DRIFT | S.EXIT_UNHEALTHY, proc.stdout + proc.stderr
        assert "rigup's units (serving, GPU power), Docker and driver reboots need systemd" in proc.stdout
        assert "fix: deploy to a host booted with systemd" in proc.stdout


def test_a_host_whose_recipe_fails_is_still_told_it_cannot_run_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = rig(tmp_path)
    broken = dataclasses.replace(target, recipe=None, api_url=None, error="recipe: variant 'dual': upstream unreachable")

    class NoSystemd(LocalRunner):
        def close(self) -> None:
            pass

    monkeypatch.setattr(S, "LazySsh", lambda settings: NoSystemd({"pid1=": NO_SYSTEMD}))
    status = S.host_status(broken, quiet=True)
    assert [(i.item, i.state) for i in status.items] == [("recipe", S.DRIFT), ("systemd", S.UNHEALTHY)]
    monkeypatch.setattr(S, "LazySsh", lambda settings: NoSystemd({"pid1=": BOOTED}))
    assert [i.item for i in S.host_status(broken, quiet=True).items] == ["recipe"]


def test_a_quarantined_pod_is_marked_with_the_sentinels_evidence_and_released_it_is_ok(tmp_path: Path) -> None:
    from rigup.rig import servingctl

    target, release = rig(tmp_path)
    state = Path(target.recipe.paths.state_dir)
    state.mkdir(parents=True)
    (state / "provenance.json").write_text(provenance(release))
    release_file = tmp_path / "release.json"
    release_file.write_text(json.dumps(release))
    rig_release = servingctl.Release.load(str(release_file))
    wrong = {"passed": False, "why": "expected 391", "answer": "'17 * 23 = 390'", "answer_sha256": "0" * 64,
             "seconds": 0.2, "tokens": 40, "finish_reason": "stop"}
    record: dict[str, Any] = {}
    for _ in range(2):  # as rigup-servingctl sentinel writes it: two wrong rounds with fail_after 2
        record = servingctl.sentinel_round(rig_release, record, {"arithmetic": wrong}, 2, 3, "2026-12-06T07:00:00+00:00")
    (state / "sentinel.json").write_text(json.dumps(record))
    runner = LocalRunner({"pid1=": BOOTED, "rigup-*.service": f"{release['unit']} enabled active\n", "nvidia-smi": "__ABSENT__\n"})
    gathered = S.gather_facts(runner, target.recipe.paths.install_root)
    items = [i for i in S.compare(desired(target, release), gathered, HEALTHY) if i.item == "sentinel"]
    assert [(i.actual, i.state) for i in items] == [
        ("QUARANTINED since 2026-12-06T07:00:00+00:00: probe arithmetic answered '17 * 23 = 390'", S.UNHEALTHY)]
    assert items[0].note == "expected: expected 391; 2 failed probe rounds in a row"
    status = S.HostStatus("rig-01", "dual", target.api_url, S.compare(desired(target, release), gathered, HEALTHY))
    # the release's files were never written here (drift); the pod is quarantined, not merely unhealthy
    assert status.verdict == "DRIFT+QUARANTINED" and S.exit_code([status]) & S.EXIT_UNHEALTHY
    assert S.HostStatus("rig-01", "dual", None, items).verdict == "QUARANTINED"
    assert "rig-01  variant dual" in S.render_table([status]) and "QUARANTINED" in S.render_table([status])
    right = dict(wrong, passed=True, why=None)
    for _ in range(3):
        record = servingctl.sentinel_round(rig_release, record, {"arithmetic": right}, 2, 3, "2026-12-06T07:02:00+00:00")
    (state / "sentinel.json").write_text(json.dumps(record))
    items = [i for i in S.compare(desired(target, release), S.gather_facts(runner, target.recipe.paths.install_root),
                                  HEALTHY) if i.item == "sentinel"]
    assert [(i.actual, i.state) for i in items] == [
        ("3 right round(s) in a row; last right at 2026-12-06T07:02:00+00:00", S.OK)]
