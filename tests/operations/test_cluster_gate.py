"""A cluster's gate (rigup.operations.cluster_gate) decides across members: each member's commands run
against a fake connection that answers as rigup-servingctl does, so what each member runs, and whether
its host fails, follow from the other members' results alone."""

from __future__ import annotations

import gevent
from pyinfra.connectors.util import CommandOutput, OutputLine

from rigup.operations import cluster_gate

CTL = "/opt/rigup/bin/rigup-servingctl"
RELEASE = "/opt/rigup/variants/big/release.json"
MEMBERS = ["rig-a", "rig-b"]


class State:
    def __init__(self) -> None:
        self.failed_hosts: set = set()
        self.print_input = False


class Host:
    """Answers servingctl's commands from `answers` (subcommand -> (ok, lines)) and records them."""

    def __init__(self, name: str, state: State, answers: dict[str, tuple[bool, list[str]]]) -> None:
        self.name = name
        self.state = state
        self.answers = answers
        self.ran: list[str] = []
        self.logged: list[str] = []

    def run_shell_command(self, command, **kwargs):
        text = command.get_raw_value()
        self.ran.append(text)
        sub = "rollback" if " rollback " in text else ("hold" if "--hold" in text else "gate")
        ok, lines = self.answers[sub]
        return ok, CommandOutput([OutputLine("stdout", line) for line in lines])

    def log_styled(self, message, **kwargs):
        self.logged.append(message)


def _command(op, **kwargs):
    """The one command an operation yields (its generator, without pyinfra's operation wrapper)."""
    (command,) = list(op._inner(CTL, RELEASE, 60, **kwargs))
    return command


def held(**kwargs):
    return _command(cluster_gate.cluster_member_gate, cluster="big", head="rig-a", members=MEMBERS, **kwargs)


def verdict():
    return _command(cluster_gate.cluster_gate_verdict, keep=2, cluster="big", members=MEMBERS)


FAILED_LINES = ["rigup: health gate FAILED for rigup-big.service (variant v): rigup-big.service restarted 3 times "
                "while starting (crash loop); the log's last error: RuntimeError: Gloo connectFullMesh failed",
                "RIGUP-GATE-RESULT: failed"]
ROLLED_BACK = ["rigup: FAILED and ROLLED BACK: ...", "RIGUP-GATE-RESULT: failed-and-rolled-back"]


def _gating(state: State, **gates: bool) -> None:
    for name, value in gates.items():
        cluster_gate.member_gates_when(Host(name, state, {}), "big", lambda value=value: value)


def _both(state: State, head: Host, worker: Host, command_of) -> dict[str, tuple]:
    """Run one operation on both members at once, as pyinfra does."""
    jobs = {h.name: gevent.spawn(command_of().execute, state, h, {}) for h in (head, worker)}
    gevent.joinall(list(jobs.values()), raise_error=True)
    return {name: job.value for name, job in jobs.items()}


def test_a_failed_head_rolls_every_member_back_naming_the_head_and_its_error():
    state = State()
    _gating(state, **{"rig-a": True, "rig-b": True})
    head = Host("rig-a", state, {"hold": (False, FAILED_LINES), "rollback": (False, ROLLED_BACK)})
    worker = Host("rig-b", state, {"rollback": (False, ROLLED_BACK)})
    first = _both(state, head, worker, held)
    assert first["rig-a"][0] is True and first["rig-b"][0] is True  # the first half never fails a host
    assert worker.ran == []  # the worker took the head's result instead of asking the head again
    second = _both(state, head, worker, verdict)
    assert second["rig-a"][0] is False and second["rig-b"][0] is False
    for member in (head, worker):
        (rollback,) = member.ran[-1:]
        assert " rollback --release " + RELEASE in rollback
        assert "cluster big rolls back as one: rig-a: rigup-big.service restarted 3 times" in rollback
        assert "Gloo connectFullMesh failed" in rollback
        assert any("this member rolled back to its last good generation" in line for line in member.logged)
    assert any("rig-b: the head (rig-a) failed its gate" in line for line in worker.logged)


def test_a_cluster_that_passes_records_each_member_with_the_ordinary_gate():
    state = State()
    _gating(state, **{"rig-a": True, "rig-b": True})
    ok = (True, ["rigup: ... recorded as generation 2", "RIGUP-GATE-RESULT: passed"])
    head = Host("rig-a", state, {"hold": (True, ["RIGUP-GATE-RESULT: held"]), "gate": ok})
    worker = Host("rig-b", state, {"gate": ok})
    _both(state, head, worker, held)
    second = _both(state, head, worker, verdict)
    assert second["rig-a"][0] is True and second["rig-b"][0] is True
    assert [c.split(" ")[2] for c in head.ran] == ["gate", "gate"] and "--hold" in head.ran[0]
    assert "--hold" not in head.ran[1] and "--no-rollback" not in head.ran[1]
    assert len(worker.ran) == 1 and " gate " in worker.ran[0] and "--hold" not in worker.ran[0]


def test_a_worker_whose_head_did_not_restart_asks_the_head_itself():
    state = State()
    _gating(state, **{"rig-a": False, "rig-b": True})
    worker = Host("rig-b", state, {"hold": (False, FAILED_LINES), "rollback": (False, ROLLED_BACK)})
    assert held().execute(state, worker, {})[0] is True
    assert "--hold" in worker.ran[0]
    assert verdict().execute(state, worker, {})[0] is False
    assert "rig-b: rigup-big.service restarted 3 times" in worker.ran[-1]


def test_a_member_that_failed_earlier_in_the_run_rolls_the_others_back():
    state = State()
    _gating(state, **{"rig-a": True, "rig-b": True})
    head = Host("rig-a", state, {})
    worker = Host("rig-b", state, {"hold": (True, ["RIGUP-GATE-RESULT: held"]), "rollback": (False, ROLLED_BACK)})
    state.failed_hosts.add(head)  # say its image pull failed: it never restarted and never gates
    assert held().execute(state, worker, {})[0] is True  # does not wait for it
    assert "--hold" in worker.ran[0]
    assert verdict().execute(state, worker, {})[0] is False
    assert "rig-a: failed earlier in this run" in worker.ran[-1]


def test_the_reason_is_servingctls_failure_line():
    assert cluster_gate.failure_reason(["x", FAILED_LINES[0]]).startswith("rigup-big.service restarted 3 times")
    assert cluster_gate.failure_reason([]) == "the gate failed (no reason printed)"
