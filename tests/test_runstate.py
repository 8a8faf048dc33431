"""The converge's account (rigup.runstate): lines per host and run, and the closing table printed once
after the last operation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rigup import runstate


@dataclass(eq=False)
class FakeHost:
    name: str
    state: Any = None


@dataclass(eq=False)
class FakeState:
    hosts: list[FakeHost]
    order: list[str]
    failed: set[str] = field(default_factory=set)
    callback_handlers: list[Any] = field(default_factory=list)

    @property
    def inventory(self) -> list[FakeHost]:
        return self.hosts

    @property
    def activated_hosts(self) -> set[Any]:
        return {h for h in self.hosts if h.name not in self.failed}

    @property
    def failed_hosts(self) -> set[Any]:
        return {h for h in self.hosts if h.name in self.failed}

    def get_op_order(self) -> list[str]:
        return self.order

    def add_callback_handler(self, handler: Any) -> None:
        self.callback_handlers.append(handler)


def test_accounts_are_kept_per_run_and_host() -> None:
    run_a, run_b = FakeState([], []), FakeState([], [])
    a1, b1 = FakeHost("rig-01", run_a), FakeHost("rig-01", run_b)
    runstate.account(a1, "rebooted in 21 s")
    runstate.account(a1, "health gate passed in 8 s")
    runstate.account(b1, "image pulled in 3 s")
    assert runstate.accounts(run_a) == {"rig-01": ["rebooted in 21 s", "health gate passed in 8 s"]}
    assert runstate.accounts(run_b) == {"rig-01": ["image pulled in 3 s"]}


def test_the_table_has_a_row_per_host_and_says_no_change() -> None:
    table = runstate.summary_table({"rig-01": ["rebooted in 21 s", "image pulled in 3 s"]}, ["rig-01", "rig-02", "rig-10"], {"rig-10"})
    assert table.splitlines() == [
        "HOST    RESULT  WHAT THIS CONVERGE DID",
        "rig-01  ok      rebooted in 21 s; image pulled in 3 s",
        "rig-02  ok      no change",
        "rig-10  FAILED  no change",
    ]


def test_the_summary_prints_once_after_the_last_operation(monkeypatch: Any) -> None:
    printed: list[str] = []
    monkeypatch.setattr(runstate.logger, "info", printed.append)
    state = FakeState([FakeHost("rig-01"), FakeHost("rig-02")], ["op1", "op2"], failed={"rig-02"})
    for host in state.hosts:
        host.state = state
    runstate.account(state.hosts[0], "model files: 1.0 GB downloaded")
    runstate.print_summary_at_the_end(state)
    runstate.print_summary_at_the_end(state)  # every host's task file asks: registered once
    (handler,) = state.callback_handlers
    handler.operation_end(state, "op1")
    assert printed == []  # not the last operation
    handler.operation_end(state, "op2")
    handler.operation_end(state, "op2")
    assert printed == [
        "--> What this converge did, per host:",
        "    HOST    RESULT  WHAT THIS CONVERGE DID",
        "    rig-01  ok      model files: 1.0 GB downloaded",
        "    rig-02  FAILED  no change",
    ]


def test_a_run_that_stops_early_prints_at_the_disconnect_but_not_for_a_reboot(monkeypatch: Any) -> None:
    printed: list[str] = []
    monkeypatch.setattr(runstate.logger, "info", printed.append)
    state = FakeState([FakeHost("rig-01")], ["op1", "op2"], failed={"rig-01"})
    state.hosts[0].state = state
    runstate.print_summary_at_the_end(state)
    (handler,) = state.callback_handlers
    host = state.hosts[0]
    handler.host_disconnect(state, host)
    assert printed == []  # nothing executed yet (a --dry run, or a fact command)
    handler.operation_host_start(state, host, "op1")
    handler.host_disconnect(state, host)  # the reboot inside op1 disconnects it
    assert printed == []
    handler.operation_host_error(state, host, "op1")  # op1 fails it: pyinfra stops, then disconnects
    handler.host_disconnect(state, host)
    handler.host_disconnect(state, host)
    assert printed == ["--> What this converge did, per host:", "    HOST    RESULT  WHAT THIS CONVERGE DID",
                       "    rig-01  FAILED  no change"]


def test_the_table_shows_remote_commands_where_counted() -> None:
    table = runstate.summary_table({}, ["rig-01", "rig-02"], set(), round_trips={"rig-01": 2, "rig-02": 31})
    assert table.splitlines() == [
        "HOST    RESULT  REMOTE COMMANDS  WHAT THIS CONVERGE DID",
        "rig-01  ok      2                no change",
        "rig-02  ok      31               no change",
    ]


def test_phase_times_run_from_each_phases_first_operation_to_the_next() -> None:
    assert runstate.phase_of("tasks/model.py | Fetch locked model files") == "model"
    assert runstate.phase_of("an operation outside a task file") == "other"
    started = {"serving": 20.0, "preflight": 10.0, "model": 12.5}
    assert runstate.phase_times(started, 31.25) == "preflight 2.5 s, model 7.5 s, serving 11.2 s"


def test_the_remote_commands_column_reads_back_from_a_log() -> None:
    table = runstate.summary_table({"rig-02": ["driver installed"]}, ["rig-01", "rig-02"], {"rig-02"},
                                   round_trips={"rig-01": 2, "rig-02": 14})
    log = "--> Results:\n" + runstate.SUMMARY_TITLE + "\n" + "\n".join(f"    {line}" for line in table.splitlines())
    assert runstate.remote_commands_in(log + "\n--> Disconnecting from hosts...") == {"rig-01": 2, "rig-02": 14}
    without = runstate.summary_table({}, ["rig-01"], set())
    assert runstate.remote_commands_in(runstate.SUMMARY_TITLE + "\n" + without) is None
    assert runstate.remote_commands_in("no summary at all") is None


@dataclass(eq=False)
class FakeData:
    values: dict[str, Any]

    def dict(self) -> dict[str, Any]:
        return dict(self.values)


@dataclass(eq=False)
class PlannedHost:
    name: str
    data: FakeData
    groups: tuple[str, ...]
    state: Any = None


def test_the_fleet_plan_is_built_once_per_run_and_the_gates_read_its_roles() -> None:
    from rigup.desired.knobs import load_defaults

    rig = PlannedHost("rig-01", FakeData({**load_defaults(), "variant": "dual"}), ("rigs",))
    gw = PlannedHost("gw", FakeData({**load_defaults(), "serves_variant": False}), ("gateway",))
    run = FakeState([rig, gw], [])  # type: ignore[list-item]
    for host in (rig, gw):
        host.state = run
        runstate.record_preflight(host, True)
    plan = runstate.fleet_plan(run)
    assert runstate.fleet_plan(run) is plan  # every host and task of the run reads the same one
    assert [h.name for h in plan.hosts] == ["rig-01", "gw"]
    assert runstate.runs_rig_tasks(rig) and not runstate.runs_rig_tasks(gw)
    assert runstate.runs_gateway_task(gw) and runstate.runs_monitor_task(gw) and not runstate.runs_gateway_task(rig)
    assert not runstate.runs_image_mirror_task(rig)
    other = FakeState([rig, gw], [])  # type: ignore[list-item]
    assert runstate.fleet_plan(other) is not plan  # a new run plans again
    runstate.record_preflight(rig, False)
    assert not runstate.runs_rig_tasks(rig)  # a host preflight failed gets nothing more


def test_cluster_gates_are_kept_per_run() -> None:
    one, two = FakeState([], []), FakeState([], [])
    runstate.cluster_gates(one).results.setdefault("c", {})["rig-01"] = None
    assert runstate.cluster_gates(one).results == {"c": {"rig-01": None}}
    assert runstate.cluster_gates(two).results == {}
