"""`rigup rollout`: planning, the stop rules, and one real run of pyinfra per step on @fake hosts plus a
host whose SSH port refuses connections (down)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rigup import REPO_ROOT
from rigup.cli.rollout import (
    EXIT_OK,
    EXIT_SOME_FAILED,
    EXIT_STOPPED,
    HostResult,
    RolloutError,
    Settings,
    Step,
    StepReport,
    execute,
    parse_worker_report,
    plan,
)

HOSTS = ["c1", "c2", "r1", "r2", "r3", "r4", "r5"]
GROUPS = {"canary": ["c1", "c2"], "rigs": ["r1", "r2", "r3", "r4", "r5"]}


def test_plan_canary_then_batches():
    steps = plan(HOSTS, GROUPS, Settings("canary", 2, 0))
    assert [(s.name, s.hosts, s.canary) for s in steps] == [
        ("canary", ("c1", "c2"), True),
        ("batch 1", ("r1", "r2"), False),
        ("batch 2", ("r3", "r4"), False),
        ("batch 3", ("r5",), False),
    ]


def test_the_image_mirror_host_converges_in_the_first_step():
    # r4 caches the fleet's images: it moves into the canary step, before any rig pulls through it
    steps = plan(HOSTS, GROUPS, Settings("canary", 2, 0), first=["r4"])
    assert [(s.name, s.hosts) for s in steps] == [
        ("canary", ("c1", "c2", "r4")), ("batch 1", ("r1", "r2")), ("batch 2", ("r3", "r5"))]
    # without a canary step they join batch 1; a host only of mirrors makes that step
    steps = plan(HOSTS, GROUPS, Settings("nope", 3, 0), first=["r5", "c1"])
    assert [s.hosts for s in steps] == [("c2", "r1", "r2", "r5", "c1"), ("r3", "r4")]
    assert [s.hosts for s in plan(["m"], {"all": ["m"]}, Settings(None, 2, 0), first=["m"])] == [("m",)]


def test_plan_without_the_canary_group():
    steps = plan(HOSTS, GROUPS, Settings("nope", 3, 0))
    assert [s.hosts for s in steps] == [("c1", "c2", "r1"), ("r2", "r3", "r4"), ("r5",)]
    assert not any(s.canary for s in steps)


def test_a_clusters_members_move_in_one_step():
    # r2 and r5 serve one model together: r5 goes with r2, and the batch it was in keeps the rest
    steps = plan(HOSTS, GROUPS, Settings("canary", 2, 0), [("r2", "r5")])
    assert [(s.name, s.hosts) for s in steps] == [
        ("canary", ("c1", "c2")), ("batch 1", ("r1", "r2", "r5")), ("batch 2", ("r3", "r4"))]
    # a canary member takes its whole cluster into the canary step; a batch left empty is dropped
    steps = plan(HOSTS, GROUPS, Settings("canary", 1, 0), [("c2", "r1"), ("r2", "r3")])
    assert [(s.name, s.hosts, s.canary) for s in steps] == [
        ("canary", ("c1", "c2", "r1"), True), ("batch 1", ("r2", "r3"), False), ("batch 2", ("r4",), False),
        ("batch 3", ("r5",), False)]


def test_plan_rejects_bad_settings():
    with pytest.raises(RolloutError):
        plan(HOSTS, GROUPS, Settings("canary", 0, 0))
    with pytest.raises(RolloutError):
        plan(HOSTS, GROUPS, Settings("canary", 1, -1))


def fake_runner(outcomes: dict[str, str]):
    """A step runner whose hosts end as `outcomes` says (default ok); records the steps it ran."""
    ran: list[str] = []

    def runner(step: Step) -> StepReport:
        ran.append(step.name)
        return StepReport(0, {h: HostResult(h, step.name, outcomes.get(h, "ok")) for h in step.hosts})

    return runner, ran


def test_everything_converges():
    steps = plan(HOSTS, GROUPS, Settings("canary", 2, 0))
    runner, ran = fake_runner({})
    result = execute(steps, Settings("canary", 2, 0), runner)
    assert ran == ["canary", "batch 1", "batch 2", "batch 3"]
    assert result.exit_code == EXIT_OK and result.stopped is None


def test_a_down_host_does_not_stop_the_rollout():
    settings = Settings("canary", 2, 0)
    runner, ran = fake_runner({"r2": "down"})
    result = execute(plan(HOSTS, GROUPS, settings), settings, runner)
    assert ran == ["canary", "batch 1", "batch 2", "batch 3"]
    assert result.stopped is None
    assert result.exit_code == EXIT_SOME_FAILED
    assert {h.host: h.status for h in result.hosts}["r2"] == "down"


def test_a_failed_canary_stops_whatever_max_failures_says():
    settings = Settings("canary", 2, 5)
    runner, ran = fake_runner({"c2": "failed"})
    result = execute(plan(HOSTS, GROUPS, settings), settings, runner)
    assert ran == ["canary"]
    assert result.exit_code == EXIT_STOPPED
    assert "canary host(s) failed: c2" in result.stopped
    assert [h.status for h in result.hosts if h.step != "canary"] == ["skipped"] * 5


def test_an_unreachable_canary_proves_nothing():
    settings = Settings("canary", 2, 0)
    runner, ran = fake_runner({"c1": "down", "c2": "down"})
    result = execute(plan(HOSTS, GROUPS, settings), settings, runner)
    assert ran == ["canary"] and "nothing was proven" in result.stopped


def test_stop_after_more_than_max_failures():
    settings = Settings("canary", 2, 1)
    runner, ran = fake_runner({"r1": "failed", "r4": "failed"})
    result = execute(plan(HOSTS, GROUPS, settings), settings, runner)
    assert ran == ["canary", "batch 1", "batch 2"]  # 1 failure tolerated, the 2nd stops it
    assert result.exit_code == EXIT_STOPPED
    assert {h.host: h.status for h in result.hosts}["r5"] == "skipped"


def test_failures_in_the_last_step_finish_rather_than_stop():
    settings = Settings("canary", 5, 0)
    runner, _ = fake_runner({"r5": "failed"})
    result = execute(plan(HOSTS, GROUPS, settings), settings, runner)
    assert result.stopped is None and result.exit_code == EXIT_SOME_FAILED


def test_a_step_that_could_not_run_is_an_error():
    settings = Settings("canary", 2, 0)

    def runner(step: Step) -> StepReport:
        return StepReport(1, {}, error="pyinfra exited 1 before connecting")

    result = execute(plan(HOSTS, GROUPS, settings), settings, runner)
    assert result.exit_code == 3 and "before connecting" in result.error
    assert all(h.status == "skipped" for h in result.hosts)


def test_worker_report_classification():
    step = Step("batch 1", ("a", "b", "c"))
    report = parse_worker_report(
        {
            "exit_code": 1,
            "limit": ["a", "b", "c"],
            "activated": ["a", "b"],
            "failed": ["b", "c"],
            "hosts": {
                "a": {"changes": 0, "failed_operation": None, "output_tail": []},
                "b": {"changes": 3, "failed_operation": "tasks/serving.py | Health-gate",
                      "output_tail": ["rigup: FAILED and ROLLED BACK", "RIGUP-GATE-RESULT: failed-and-rolled-back"]},
            },
        },
        step,
    )
    assert {h: r.status for h, r in report.hosts.items()} == {"a": "ok", "b": "failed", "c": "down"}
    assert report.hosts["b"].gate == "failed-and-rolled-back"
    assert report.hosts["a"].changes == 0


# --------------------------------------------------------------------------------------------
# a real rollout: pyinfra runs per step; a scripted failure and a host that refuses SSH


@pytest.fixture
def fleet_dir(tmp_path: Path) -> Path:
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data/all.py").write_text(
        'rollout_canary_group = "canary"\nrollout_batch = 2\nrollout_max_failures = 0\n'
    )
    (tmp_path / "inventory.py").write_text(
        textwrap.dedent(
            """
            _fast = {"fake_delay": 0, "fake_delay_jitter": 0}
            _fail = {"echo step": {"success": False, "stdout": ["rigup: FAILED", "RIGUP-GATE-RESULT: failed"]}}
            canary = [("@fake/c1", dict(_fast))]
            rigs = [
                ("@fake/r1", dict(_fast)),
                ("down-01", {"ssh_hostname": "127.0.0.1", "ssh_port": 1}),
                ("@fake/r2", dict(_fast, fake_responses=_fail)),
                ("@fake/r3", dict(_fast)),
            ]
            """
        )
    )
    (tmp_path / "deploy.py").write_text(
        'from pyinfra.operations import server\nserver.shell(name="Say step", commands=["echo step"])\n'
    )
    return tmp_path


def test_rollout_end_to_end_on_fake_hosts(fleet_dir: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "rigup.cli.rollout", "--chdir", str(fleet_dir), "--log-dir", str(fleet_dir / "logs"), "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    result = json.loads(proc.stdout)
    statuses = {h["host"]: (h["step"], h["status"]) for h in result["hosts"]}
    assert statuses == {
        "@fake/c1": ("canary", "ok"),
        "@fake/r1": ("batch 1", "ok"),
        "down-01": ("batch 1", "down"),  # reported; r1 in the same step still converged
        "@fake/r2": ("batch 2", "failed"),
        "@fake/r3": ("batch 2", "ok"),
    }
    failed = next(h for h in result["hosts"] if h["host"] == "@fake/r2")
    assert failed["failed_operation"] == "Say step" and failed["gate"] == "failed"
    assert result["stopped"] is None  # the failure was in the last step
    assert proc.returncode == EXIT_SOME_FAILED == result["exit_code"]
    assert (fleet_dir / "logs/canary.log").read_text().count("[@fake/c1] Success") == 1


def test_rollout_stops_before_later_batches(fleet_dir: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "rigup.cli.rollout", "--chdir", str(fleet_dir), "--log-dir", str(fleet_dir / "logs"),
         "--batch", "1", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    result = json.loads(proc.stdout)
    statuses = {h["host"]: h["status"] for h in result["hosts"]}
    # batch 3 is r2 alone: pyinfra prints no JSON when its only host fails; the worker still knows.
    assert statuses == {"@fake/c1": "ok", "@fake/r1": "ok", "down-01": "down", "@fake/r2": "failed", "@fake/r3": "skipped"}
    assert proc.returncode == EXIT_STOPPED
    assert "more than rollout_max_failures=0" in result["stopped"]


def test_rollout_plan_only(fleet_dir: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "rigup.cli.rollout", "--chdir", str(fleet_dir), "--plan"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["canary: @fake/c1", "batch 1: @fake/r1, down-01", "batch 2: @fake/r2, @fake/r3"]


def test_plan_puts_the_gateway_group_last():
    hosts = ["gw", "c1", "r1", "r2"]
    groups = {"gateway": ["gw"], "canary": ["c1"], "rigs": ["r1", "r2"]}
    steps = plan(hosts, groups, Settings("canary", 2, 0, gateway_group="gateway"))
    assert [s.hosts for s in steps] == [("c1",), ("r1", "r2"), ("gw",)]
    assert [s.hosts for s in plan(hosts, groups, Settings("canary", 2, 0))] == [("c1",), ("gw", "r1"), ("r2",)]
