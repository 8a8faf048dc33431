"""Decisions one task file makes that a later task file reads in the same run: the one place for them.

pyinfra runs each task file for every host in turn, so a later file cannot see an earlier file's
local variables. What crosses files is recorded here, per host (keyed weakly on pyinfra's Host) or per
run (keyed weakly on pyinfra's State):

  fleet_plan(state)              every task file: the run's FleetPlan (rigup.desired.fleet_plan), each
                                 host's roles and plans, built once per run; .host(name) is a host's part
  record_preflight(host, passed) tasks/preflight.py: the host's verdict, judged while the deploy is planned
  runs_rig_tasks(host)           deploy.py: include the driver..serving tasks (passed, serves a variant)
  runs_image_mirror_task(host)   deploy.py: include tasks/image_mirror.py (passed, the mirror or a relay)
  runs_gateway_task(host)        deploy.py: include tasks/gateway.py (passed, in gateway_group)
  runs_monitor_task(host)        deploy.py: include tasks/prometheus.py, alertmanager.py, grafana.py
                                 (passed, in monitor_group)
  record(host, HostDriverState)  tasks/nvidia_driver.py: the driver plan, the reboot policy and
                                 whether the driver operation changed the host (execute time)
  serving_blocked(host)          tasks/container_toolkit.py, tasks/serving.py: a driver that waits
                                 for a reboot under driver_reboot=never keeps GPU containers off
  driver_changed(host)           tasks/serving.py: gate the variant again after a driver change
  note_change(host, key, *ops)   tasks/docker.py ("docker"), tasks/nvidia_driver.py ("driver")
  changed(host, *keys)           tasks/container_toolkit.py: run the GPU smoke test after either
  pyinfra_dry_run()              tasks/sources.py, model.py, serving.py: --dry without a lock plans on
  pins_missing(host, phase, plan)  the same files: a phase without its pins warns (--dry) or fails the host
  cluster_gates(state)           rigup.operations.cluster_gate: per cluster, when each member gates
                                 (planned) and what its gate said (execute time)
  record_decided_routes(host, routes, routers)  rigup.operations.gateway.entrance_routes: the routes and
  decided_routes(host)           routers it decided from what the rigs serve when it ran (each pass: planned,
                                 then executed); routers_run_current, entrance_last_good and
                                 rigup.operations.quarantine_routes read them
  account(host, line)            operations, at execute time: what they did (driver loaded, GB fetched
                                 from the hub or a peer, image pulled, variant restarted, gate passed);
                                 print_summary_at_the_end(state) (deploy.py) prints every host's lines
                                 when the run ends

Nothing else is shared between task files; everything decided before the run is in the FleetPlan.
"""

from __future__ import annotations

import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from io import StringIO
from typing import Any

from pyinfra import logger
from pyinfra.api.exceptions import DeployError
from pyinfra.api.state import BaseStateCallback
from rich.console import Console
from rich.table import Table

from rigup.checks.driver_plan import DriverPlan
from rigup.desired.entrance import ModelRouter
from rigup.desired.fleet_plan import FleetEntry, FleetPlan, plan_fleet
from rigup.desired.gateway import Route
from rigup.desired.lock import phase_without_lock
from rigup.desired.roles import HostRoles
from rigup.pyinfra_patches.fact_batching import remote_commands


@dataclass(frozen=True)
class HostDriverState:
    """What tasks/nvidia_driver.py decided for a host."""

    plan: DriverPlan
    reboot_policy: str  # auto | never
    changed: Callable[[], bool]  # execute time: did the driver operation do anything on this host

    @property
    def serving_blocked(self) -> str | None:
        """Why serving must not start on this host in this run, or None."""
        if self.plan.action != "none" and self.reboot_policy == "never":
            return (
                f"REBOOT REQUIRED: {self.plan.summary}; driver_reboot=never, so GPU containers are not "
                "started on this host until it is rebooted and the deploy re-run"
            )
        return None


_STATES: weakref.WeakKeyDictionary[Any, HostDriverState] = weakref.WeakKeyDictionary()


def _real(host: Any) -> Any:
    # pyinfra's `host` is a context proxy; key on the Host object behind it.
    getter = getattr(host, "_get_module", None)
    return getter() if callable(getter) else host


_PREFLIGHT_PASSED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def record_preflight(host: Any, passed: bool) -> None:
    _PREFLIGHT_PASSED[_real(host)] = passed


def passed_preflight(host: Any) -> bool:
    """Whether tasks/preflight.py judged this host able to run the deploy (False before it has)."""
    return _PREFLIGHT_PASSED.get(_real(host), False)


def fleet_plan(state: Any) -> FleetPlan:
    """This run's FleetPlan (rigup.desired.fleet_plan): every host of the inventory, planned once per run.
    Built by the first host that asks (pyinfra loads every host's files in greenlets of their own: the
    others wait for it, under threading's lock that gevent has made a greenlet lock)."""
    run = getattr(state, "_get_module", None)
    run = run() if callable(run) else state
    with _PLANNING:
        held = _FLEET_PLANS.get(run)
        if held is None:
            active = set(getattr(run, "activated_hosts", ()) or ())
            held = _FLEET_PLANS[run] = plan_fleet(
                FleetEntry(h.name, h.data.dict(), tuple(h.groups),
                           handle=h, active=h in active)
                for h in run.inventory
            )
    return held


_FLEET_PLANS: weakref.WeakKeyDictionary[Any, FleetPlan] = weakref.WeakKeyDictionary()
_PLANNING = threading.Lock()


def host_roles(host: Any) -> HostRoles:
    real = _real(host)
    return fleet_plan(real.state).roles(real.name)


def runs_rig_tasks(host: Any) -> bool:
    """deploy.py's gate for the driver, Docker, toolkit, sources, model and serving tasks: the host passed
    preflight and serves a variant (a gateway-only host does not)."""
    return passed_preflight(host) and host_roles(host).rig


def runs_image_mirror_task(host: Any) -> bool:
    """deploy.py's gate for tasks/image_mirror.py: the host passed preflight and runs a registry of the
    fleet's images: the mirror (some host names it as its image_mirror_host) or a relay (it names one and
    serves a variant: it pins images)."""
    return passed_preflight(host) and host_roles(host).image_registry


def runs_gateway_task(host: Any) -> bool:
    """deploy.py's gate for tasks/gateway.py: the host passed preflight and is in gateway_group."""
    return passed_preflight(host) and host_roles(host).gateway


def runs_monitor_task(host: Any) -> bool:
    """deploy.py's gate for tasks/prometheus.py, alertmanager.py and grafana.py: the host passed preflight and is in monitor_group."""
    return passed_preflight(host) and host_roles(host).monitor


@dataclass
class ClusterGates:
    """One run's cluster gates (rigup.operations.cluster_gate): cluster -> member -> what its gate said
    (None: passed), and cluster -> member -> whether that member gates in this run (execute time)."""

    results: dict[str, dict[str, str | None]]
    gating: dict[str, dict[str, Callable[[], bool]]]


_CLUSTER_GATES: weakref.WeakKeyDictionary[Any, ClusterGates] = weakref.WeakKeyDictionary()


def cluster_gates(state: Any) -> ClusterGates:
    """This run's cluster gates (pyinfra's State)."""
    held = _CLUSTER_GATES.get(state)
    if held is None:
        held = _CLUSTER_GATES[state] = ClusterGates({}, {})
    return held


@dataclass(frozen=True)
class DecidedRoutes:
    """What rigup.operations.gateway.entrance_routes decided on an entrance host: every rig's routes from what it
    serves when the operation ran, and one router per served model."""

    routes: tuple[Route, ...] = ()
    routers: tuple[ModelRouter, ...] = ()


_DECIDED_ROUTES: weakref.WeakKeyDictionary[Any, DecidedRoutes] = weakref.WeakKeyDictionary()


def record_decided_routes(host: Any, routes: Sequence[Route], routers: Sequence[ModelRouter]) -> None:
    """The routes and routers entrance_routes decided on `host` in this pass (the plan's, then the execution's)."""
    _DECIDED_ROUTES[_real(host)] = DecidedRoutes(tuple(routes), tuple(routers))


def decided_routes(host: Any) -> DecidedRoutes:
    """What entrance_routes decided on `host` in this pass; none before it ran."""
    return _DECIDED_ROUTES.get(_real(host), DecidedRoutes())


def record(host: Any, state: HostDriverState) -> None:
    _STATES[_real(host)] = state


def get(host: Any) -> HostDriverState | None:
    return _STATES.get(_real(host))


def serving_blocked(host: Any) -> str | None:
    """Reason this host must not start GPU containers in this run (driver_reboot=never and the
    driver is not the wanted one, loaded); None when serving may proceed."""
    state = get(host)
    return None if state is None else state.serving_blocked


def driver_changed(host: Any) -> bool:
    """At execute time: the driver operation installed or rebooted on this host in this run."""
    state = get(host)
    return False if state is None else bool(state.changed())


# Operations of one task file whose changes a later task file reacts to (e.g. the GPU smoke test in
# tasks/container_toolkit.py runs when Docker's packages from tasks/docker.py changed).
_CHANGES: weakref.WeakKeyDictionary[Any, dict[str, list[Any]]] = weakref.WeakKeyDictionary()


def note_change(host: Any, key: str, *ops: Any) -> None:
    """Remember operations (OperationMeta) under `key` for this host (prepare time)."""
    _CHANGES.setdefault(_real(host), {}).setdefault(key, []).extend(ops)


def changed(host: Any, *keys: str) -> bool:
    """At execute time: did any operation noted under one of `keys` change this host."""
    noted = _CHANGES.get(_real(host), {})
    return any(op.did_change() for key in keys for op in noted.get(key, ()))


def pyinfra_dry_run() -> bool:
    """Whether the pyinfra CLI running this deploy was given --dry.

    pyinfra 3.10 tells deploy code nothing about --dry: it is a local of pyinfra_cli.cli._main (which
    exits after change detection), not on `config` or `state`, and task files are loaded in greenlets
    (so click's context is not reachable either). The flag is on the command line the CLI parsed, so
    it is read back from sys.argv with the CLI's own option definitions. Outside the pyinfra CLI (API
    use, tests) this is False: a missing lock then fails, which is the safe side."""
    cli_module = sys.modules.get("pyinfra_cli.cli")  # never imported here: importing it patches gevent
    command = getattr(cli_module, "cli", None)
    if command is None:
        return False
    argv = tuple(sys.argv[1:])
    cached = _DRY.get(argv)
    if cached is None:
        try:
            ctx = command.make_context("pyinfra", list(argv), resilient_parsing=True)
            cached = bool(ctx.params.get("dry"))
        except Exception:  # an argv the CLI cannot parse back: read the flag itself
            cached = "--dry" in argv
        _DRY[argv] = cached
    return cached


_DRY: dict[tuple[str, ...], bool] = {}


# --------------------------------------------------------------------------------------------
# The converge's account: what each host did, printed once when the last operation has ended.

_ACCOUNTS: dict[int, tuple[Any, dict[str, list[str]]]] = {}  # id(pyinfra State) -> (that State, host -> lines)


def _run_account(run: Any) -> dict[str, list[str]]:
    held = _ACCOUNTS.get(id(run))
    if held is None or held[0] is not run:  # a new run (an id can be reused once a State is gone)
        held = _ACCOUNTS[id(run)] = (run, {})
    return held[1]


def account(host: Any, line: str) -> None:
    """Note what an operation did on `host` (execute time), for the closing summary."""
    real = _real(host)
    run = getattr(real, "state", None) or real  # the run's State (a bare host in unit tests)
    _run_account(run).setdefault(real.name, []).append(line)


def accounts(state: Any) -> dict[str, list[str]]:
    return {name: list(lines) for name, lines in _run_account(state).items()}


def summary_table(done: dict[str, list[str]], host_names: list[str], failed: set[str], width: int = 10_000,
                  round_trips: dict[str, int] | None = None) -> str:
    """One row per host: its state after the run, what it did ("no change" when nothing) and, where
    counted (rigup.pyinfra_patches.fact_batching), the commands and file transfers this run sent it; laid out by rich
    (plain text: it goes through pyinfra's log)."""
    table = Table(box=None, pad_edge=False)  # one line per host however long: logs are searched by host
    columns = ["HOST", "RESULT", *(["REMOTE COMMANDS"] if round_trips is not None else []), "WHAT THIS CONVERGE DID"]
    for column in columns:
        table.add_column(column, overflow="fold")
    for name in host_names:
        counted = [str(round_trips.get(name, 0))] if round_trips is not None else []
        table.add_row(name, "FAILED" if name in failed else "ok", *counted, "; ".join(done.get(name) or ["no change"]))
    out = StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


SUMMARY_TITLE = "--> What this converge did, per host:"


def remote_commands_in(log: str) -> dict[str, int] | None:
    """Read back the REMOTE COMMANDS column of the summary in a converge's log (bench/converge.py and
    the e2e tests); None when the log has no such summary."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if SUMMARY_TITLE in line), None)
    if start is None or start + 1 >= len(lines) or "REMOTE COMMANDS" not in lines[start + 1]:
        return None
    counts = {}
    for line in lines[start + 2:]:
        m = re.match(r"^\s+(\S+)\s+(?:ok|FAILED)\s+(\d+)(?:\s|$)", line)
        if not m:
            break
        counts[m.group(1)] = int(m.group(2))
    return counts


class ConvergeSummary(BaseStateCallback):
    """Prints summary_table once, after the last operation of the run, or, where the run stopped
    early (every host failed) or ran --serial / --no-wait (no end-of-operation callback), when
    pyinfra disconnects from the hosts at the end. Nothing in --dry: nothing executes."""

    def __init__(self) -> None:
        self.printed = False
        self.executed = False
        self.busy: set[str] = set()  # hosts inside an operation (a reboot disconnects them mid-run)
        self.phase_started: dict[str, float] = {}  # task file -> when its first operation started
        self.last_end = 0.0

    def operation_start(self, state: Any, op_hash: Any) -> None:
        names = state.get_op_meta(op_hash).names
        phase = phase_of(next(iter(names), ""))
        self.phase_started.setdefault(phase, time.monotonic())

    def operation_end(self, state: Any, op_hash: Any) -> None:
        self.last_end = time.monotonic()
        order = state.get_op_order()
        if order and op_hash == order[-1]:
            self._print(state)

    def operation_host_start(self, state: Any, host: Any, op_hash: Any) -> None:
        self.executed = True
        self.busy.add(host.name)

    def operation_host_success(self, state: Any, host: Any, op_hash: Any, retry_count: int = 0) -> None:
        self.busy.discard(host.name)

    def operation_host_error(self, state: Any, host: Any, op_hash: Any, retry_count: int = 0, max_retries: int = 0) -> None:
        self.busy.discard(host.name)

    def host_disconnect(self, state: Any, host: Any) -> None:
        if self.executed and host.name not in self.busy:
            self._print(state)

    def _print(self, state: Any) -> None:
        if self.printed:
            return
        self.printed = True
        names = [h.name for h in state.inventory if h in state.activated_hosts or h in state.failed_hosts]
        failed = {h.name for h in state.failed_hosts}
        trips = ({h.name: remote_commands(h).round_trips for h in state.inventory}
                 if getattr(state, "_rigup_facts_once", False) else None)
        logger.info(SUMMARY_TITLE)
        for line in summary_table(accounts(state), names, failed, round_trips=trips).splitlines():
            logger.info(f"    {line}")
        if self.phase_started:
            logger.info(f"--> Time per phase (all hosts, wall): {phase_times(self.phase_started, self.last_end)}")


def phase_of(operation_name: str) -> str:
    """The task an operation belongs to: "tasks/model.py | Fetch ..." -> "model"."""
    head = operation_name.split(" | ", 1)[0]
    return head.rsplit("/", 1)[-1].removesuffix(".py") if " | " in operation_name else "other"


def phase_times(started: dict[str, float], end: float) -> str:
    """ "preflight 0.4 s, nvidia_driver 2.1 s, ...": each phase from its first operation's start to the
    next phase's (pyinfra runs an operation on every host before the next one starts)."""
    order = sorted(started.items(), key=lambda item: item[1])
    ends = [t for _, t in order[1:]] + [max(end, order[-1][1])]
    return ", ".join(f"{name} {stop - begin:.1f} s" for (name, begin), stop in zip(order, ends))


def print_summary_at_the_end(state: Any) -> None:
    """Register the closing summary once per run (deploy.py calls it for every host)."""
    if not any(isinstance(h, ConvergeSummary) for h in state.callback_handlers):
        state.add_callback_handler(ConvergeSummary())


def pins_missing(host: Any, phase: str, plan: Any) -> bool:
    """Whether `phase` (sources, model, serving) lacks the lock's pins in `plan` (a HostPlan built with
    require_lock=False). A --dry run then logs one line saying what the lock pins and how to make it,
    and the phase plans nothing; a real run stops with the same line (DeployError: pyinfra ends the
    whole run when a task file raises, before any operation of this phase runs)."""
    if plan.lock is not None:
        return False
    dry = pyinfra_dry_run()
    message = phase_without_lock(phase, plan.recipe, plan.lock_problem, dry)
    if not dry:
        raise DeployError(f"{host.name}: {message}")
    logger.warning(f"{host.print_prefix}{message}")
    return True
