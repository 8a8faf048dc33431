"""`rigup rollout`: converge a fleet canary first, then in batches, stopping on failures.

    rigup rollout [--inventory inventory.py] [--deploy deploy.py] [--canary GROUP]
                            [--batch N] [--max-failures N] [--plan] [--json] [-- PYINFRA ARGS...]

Why a driver around pyinfra rather than a pyinfra flag: pyinfra 3.10 has `--serial` (the whole op list
host by host: batch size 1, no canary, no stop rule), `--parallel N` (caps concurrency per operation,
not per rollout step) and `--fail-percent` (a percentage of the *whole* run, counted at connect time
too, so one powered-off rig would abort everything). None of them gives "gate one group, then N hosts
at a time, stop after K failures, carry on past hosts that are down". So each step is one ordinary
`pyinfra -y INVENTORY DEPLOY --limit host...` run; the deploy itself (with its health gate) decides
whether a host passed.

Each step runs in a child process (`python -m rigup.cli.rollout --worker REPORT -- ARGS`) that calls
pyinfra's own CLI entry point and, when it returns, reads pyinfra's final state: which hosts connected,
which failed, the failing operation and its output. `--json` output and the exit status alone cannot
tell "down" from "failed", and pyinfra prints no JSON at all when the last host of a run fails
("No hosts remaining!"), which with a batch of one is every failure.

Rules:
- The canary group (rollout_canary_group) goes first, as one step. A canary host that fails stops the
  rollout whatever rollout_max_failures says; if no canary host could be reached it stops too (nothing
  was proven). No such group: the rollout starts with the batches (and says so).
- Then the other hosts in inventory order, rollout_batch at a time.
- A host that cannot be reached is reported as down and does not count as a failure: nothing was
  changed on it, and the rest of the fleet converges.
- A host that was reached and failed counts; when more than rollout_max_failures hosts have failed,
  the hosts not yet started are left alone.

Exit status: 0 every host converged; 1 the rollout finished but some host is down or failed;
2 the rollout stopped early; 3 the rollout could not start (bad inventory, pyinfra crashed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rigup import DEPLOY_ROOT, WORK_DIR
from rigup.desired.fleet import fleet_path
from rigup.desired.roles import cluster_membership, gateway_group, mirror_host

GATE_MARKER = "RIGUP-GATE-RESULT:"  # rigup.rig.servingctl.RESULT_MARKER (kept literal: no import cycle)
OUTPUT_TAIL = 12  # lines of a failing operation's output kept in the report

EXIT_OK = 0
EXIT_SOME_FAILED = 1
EXIT_STOPPED = 2
EXIT_ERROR = 3


@dataclass(frozen=True)
class Settings:
    canary_group: str | None
    batch: int
    max_failures: int
    gateway_group: str | None = None  # its hosts go last: their routes then read every rig's new state


@dataclass(frozen=True)
class Step:
    name: str  # "canary" or "batch 3"
    hosts: tuple[str, ...]
    canary: bool = False


@dataclass
class HostResult:
    host: str
    step: str
    status: str  # ok | failed | down | skipped (not started: the rollout stopped)
    changes: int = 0  # operations that changed something (0 on a converged re-run)
    failed_operation: str | None = None
    gate: str | None = None  # passed | failed | failed-and-rolled-back | rollback-failed
    output_tail: list[str] = field(default_factory=list)


@dataclass
class StepReport:
    """What one pyinfra run left behind, as the worker saw it."""

    exit_code: int
    hosts: dict[str, HostResult]
    error: str | None = None  # the run did not get as far as connecting (inventory, deploy errors)
    seconds: float = 0.0


class RolloutError(RuntimeError):
    """The rollout cannot be planned (unknown canary group, inconsistent settings...)."""


# --------------------------------------------------------------------------------------------
# planning


def load_inventory(inventory: str, cwd: Path) -> Any:
    """The pyinfra inventory (group_data applied), loaded the way the CLI loads it."""
    # here, not at the top: importing pyinfra_cli monkeypatches the process for gevent (patch_all), and
    # this module's --worker process must import pyinfra only after that, so its top imports no pyinfra
    from pyinfra.api import State
    from pyinfra.context import ctx_state
    from pyinfra_cli.inventory import make_inventory

    previous = os.getcwd()
    os.chdir(cwd)
    sys.path.insert(0, str(cwd))
    try:
        with ctx_state.use(State()):  # pyinfra's file loader records the file it executes on a state
            return make_inventory(inventory, cwd=str(cwd))
    finally:
        sys.path.remove(str(cwd))
        os.chdir(previous)


def fleet_settings(inventory: Any) -> Settings:
    """rollout_* knobs; they steer the whole rollout, so every host must agree on them."""
    values: dict[str, set[Any]] = {"rollout_canary_group": set(), "rollout_batch": set(), "rollout_max_failures": set(),
                                   "gateway_group": set()}
    for host in inventory:
        for key in values:
            values[key].add(gateway_group(host.data) if key == "gateway_group" else host.data.get(key))
    for key, seen in values.items():
        if len(seen) > 1:
            raise RolloutError(f"{key} differs between hosts ({sorted(map(str, seen))}); set it fleet-wide")
    one = {key: next(iter(seen)) if seen else None for key, seen in values.items()}
    return Settings(
        canary_group=one["rollout_canary_group"],
        batch=one["rollout_batch"] if one["rollout_batch"] is not None else 1,
        max_failures=one["rollout_max_failures"] if one["rollout_max_failures"] is not None else 0,
        gateway_group=one["gateway_group"],
    )


def plan(hosts: Sequence[str], groups: dict[str, Sequence[str]], settings: Settings,
         together: Sequence[Sequence[str]] = (), first: Sequence[str] = ()) -> list[Step]:
    """Steps in order: the canary group's hosts, then the others `batch` at a time, the gateway group's
    last (a gateway writes its routes from what every rig serves when it converges). Each of `together`
    (a cluster's members) moves as one, in the step of its first member: a cluster's gate passes or
    rolls back on every member at once (rigup.operations.cluster_gate). The hosts of `first` (the fleet's
    image mirrors) join the first step: the rigs of every step pull through them."""
    if settings.batch < 1:
        raise RolloutError(f"rollout_batch must be at least 1, got {settings.batch}")
    if settings.max_failures < 0:
        raise RolloutError(f"rollout_max_failures must be 0 or more, got {settings.max_failures}")
    steps: list[Step] = []
    canary: list[str] = []
    if settings.canary_group is not None and settings.canary_group in groups:
        canary = [h for h in hosts if h in set(groups[settings.canary_group])]
    if canary:
        steps.append(Step("canary", tuple(canary), canary=True))
    gateways = set(groups.get(settings.gateway_group, ())) if settings.gateway_group else set()
    early = [h for h in first if h in hosts and h not in canary]
    rest = [h for h in hosts if h not in canary and h not in early]
    rest = [h for h in rest if h not in gateways] + [h for h in rest if h in gateways]
    for number, start in enumerate(range(0, len(rest), settings.batch), 1):
        steps.append(Step(f"batch {number}", tuple(rest[start : start + settings.batch])))
    if early:
        lead = steps[0] if steps else Step("batch 1", ())
        steps[:1] = [Step(lead.name, (*lead.hosts, *early), canary=lead.canary)]
    return _keep_together(steps, together)


def _keep_together(steps: list[Step], together: Sequence[Sequence[str]]) -> list[Step]:
    placed: set[str] = set()
    out: list[Step] = []
    for step in steps:
        members: list[str] = []
        for name in step.hosts:
            for name_or_peer in next((list(g) for g in together if name in g), [name]):
                if name_or_peer not in placed:
                    placed.add(name_or_peer)
                    members.append(name_or_peer)
        if members:
            out.append(Step(step.name, tuple(members), canary=step.canary))
    return [Step(s.name if s.canary else f"batch {i}", s.hosts, canary=s.canary)
            for i, s in enumerate(out, 0 if out and out[0].canary else 1)]


# --------------------------------------------------------------------------------------------
# running one step


def pyinfra_argv(inventory: str, deploy: str, hosts: Sequence[str], extra: Sequence[str]) -> list[str]:
    argv = ["-y", inventory, deploy]
    for name in hosts:
        argv += ["--limit", name]
    return argv + list(extra)


def run_step(
    step: Step,
    argv: Sequence[str],
    cwd: Path,
    log_path: Path,
    echo: Callable[[str], None],
) -> StepReport:
    """Run pyinfra for one step in a worker process; its output goes to `log_path` and `echo`."""
    with tempfile.TemporaryDirectory(prefix="rigup-rollout-") as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "rigup.cli.rollout", "--worker", str(report_path), "--", *argv]
        # The worker runs in the deploy's directory (rigup/_deploy when installed): it must read the
        # fleet and lock the parent read, from the user's directory.
        env = dict(os.environ, PYINFRA_PROGRESS="off", PYTHONPATH=_pythonpath(cwd), RIGUP_HOME=str(WORK_DIR))
        env.setdefault("RIGUP_RIGS", str(fleet_path()))
        started = time.monotonic()
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(f"$ pyinfra {' '.join(argv)}\n")
            log.flush()
            proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                echo(line.rstrip("\n"))
            code = proc.wait()
        seconds = time.monotonic() - started
        if not report_path.exists():
            return StepReport(exit_code=code, hosts={}, error=f"the pyinfra worker exited {code} without a report", seconds=seconds)
        report = parse_worker_report(json.loads(report_path.read_text()), step)
        report.seconds = seconds
        return report


def _pythonpath(cwd: Path) -> str:
    parts = [str(DEPLOY_ROOT), str(cwd)]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


def parse_worker_report(data: dict[str, Any], step: Step) -> StepReport:
    hosts: dict[str, HostResult] = {}
    if data.get("error"):
        return StepReport(exit_code=int(data.get("exit_code", 1)), hosts={}, error=str(data["error"]))
    activated = set(data.get("activated", []))
    failed = set(data.get("failed", []))
    details: dict[str, dict[str, Any]] = data.get("hosts", {})
    for name in step.hosts:
        info = details.get(name, {})
        if name not in activated:
            status = "down"
        elif name in failed:
            status = "failed"
        else:
            status = "ok"
        tail = list(info.get("output_tail") or [])
        gate = next((line.split(GATE_MARKER, 1)[1].strip() for line in reversed(tail) if GATE_MARKER in line), None)
        hosts[name] = HostResult(
            host=name,
            step=step.name,
            status=status,
            changes=int(info.get("changes", 0)),
            failed_operation=info.get("failed_operation"),
            gate=gate,
            output_tail=tail if status == "failed" else [],
        )
    return StepReport(exit_code=int(data.get("exit_code", 0)), hosts=hosts)


# --------------------------------------------------------------------------------------------
# the rollout


@dataclass
class RolloutResult:
    settings: Settings
    steps: list[Step]
    hosts: list[HostResult]
    stopped: str | None  # why the rollout stopped early; None when it ran to the end
    error: str | None
    step_seconds: dict[str, float]

    @property
    def exit_code(self) -> int:
        if self.error:
            return EXIT_ERROR
        if self.stopped:
            return EXIT_STOPPED
        if any(h.status != "ok" for h in self.hosts):
            return EXIT_SOME_FAILED
        return EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "steps": [{"name": s.name, "hosts": list(s.hosts), "seconds": round(self.step_seconds.get(s.name, 0.0), 2)} for s in self.steps],
            "hosts": [asdict(h) for h in self.hosts],
            "stopped": self.stopped,
            "error": self.error,
            "exit_code": self.exit_code,
        }


StepRunner = Callable[[Step], StepReport]


def execute(steps: Sequence[Step], settings: Settings, runner: StepRunner) -> RolloutResult:
    """Run the steps in order with `runner`, applying the stop rules."""
    results: list[HostResult] = []
    seconds: dict[str, float] = {}
    failures = 0
    stopped: str | None = None
    error: str | None = None
    for index, step in enumerate(steps):
        report = runner(step)
        seconds[step.name] = report.seconds
        if report.error:
            error = f"{step.name}: {report.error}"
            results += [HostResult(h, step.name, "skipped") for s in steps[index:] for h in s.hosts]
            break
        step_results = [report.hosts.get(h) or HostResult(h, step.name, "failed", failed_operation="(no result)") for h in step.hosts]
        results += step_results
        failed = [r.host for r in step_results if r.status == "failed"]
        failures += len(failed)
        later = [HostResult(h, s.name, "skipped") for s in steps[index + 1 :] for h in s.hosts]
        if step.canary and failed:
            stopped = f"canary host(s) failed: {', '.join(failed)}"
        elif step.canary and all(r.status == "down" for r in step_results):
            stopped = "no canary host could be reached; nothing was proven"
        elif failures > settings.max_failures:
            stopped = f"{failures} host(s) failed, more than rollout_max_failures={settings.max_failures}"
        if stopped:
            if later:
                results += later
            else:
                stopped = None  # nothing left to hold back: the rollout simply finished with failures
            break
    return RolloutResult(settings, list(steps), results, stopped, error, seconds)


def format_summary(result: RolloutResult) -> str:
    lines = [
        f"rollout: canary group {result.settings.canary_group!r}, batch {result.settings.batch}, "
        f"max failures {result.settings.max_failures}"
    ]
    width = max((len(h.host) for h in result.hosts), default=4)
    for h in result.hosts:
        detail = ""
        if h.status == "ok":
            detail = "converged, no changes" if h.changes == 0 else f"{h.changes} operation(s) changed"
        elif h.status == "failed":
            detail = f"in {h.failed_operation or '?'}"
            if h.gate:
                detail += f" (health gate: {h.gate})"
        elif h.status == "down":
            detail = "unreachable; left alone"
        elif h.status == "skipped":
            detail = "not started (rollout stopped)"
        lines.append(f"  {h.host:<{width}}  {h.step:<9}  {h.status.upper():<7}  {detail}")
        for line in h.output_tail[-4:]:
            lines.append(f"  {'':<{width}}    | {line}")
    for name, secs in result.step_seconds.items():
        lines.append(f"  {name}: {secs:.1f} s")
    if result.error:
        lines.append(f"rollout: ERROR {result.error}")
    elif result.stopped:
        lines.append(f"rollout: STOPPED: {result.stopped}")
    else:
        bad = [h.host for h in result.hosts if h.status != "ok"]
        lines.append("rollout: every host converged" if not bad else f"rollout: finished; not converged: {', '.join(bad)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# worker: one pyinfra run in this process, then a report of pyinfra's final state


def worker(report_path: Path, argv: Sequence[str]) -> int:
    # here, not at the top: importing pyinfra_cli monkeypatches the process for gevent; pyinfra after it
    import pyinfra_cli.main
    from pyinfra.context import ctx_state
    from pyinfra.context import state as pyinfra_state

    sys.argv = ["pyinfra", *argv]
    code = 0
    try:
        pyinfra_cli.main.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    report: dict[str, Any] = {"exit_code": code}
    if not ctx_state.isset() or not getattr(pyinfra_state, "initialised", False):
        report["error"] = f"pyinfra exited {code} before connecting (see the output above)"
    else:
        report.update(_describe_state(pyinfra_state))
        if not report["limit"]:
            report["error"] = "no hosts matched the limit"
    tmp = report_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(report_path)
    return code


def _describe_state(state: Any) -> dict[str, Any]:
    limit = [h for h in state.inventory if state.is_host_in_limit(h)]
    hosts: dict[str, Any] = {}
    op_order = state.get_op_order() if state.op_meta else []
    for host in limit:
        changes = 0
        failed_op: str | None = None
        tail: list[str] = []
        for op_hash in op_order:
            data = state.ops.get(host, {}).get(op_hash)
            if data is None:
                continue
            meta = data.operation_meta
            if not meta.is_complete():
                continue
            if meta.did_error():
                failed_op = ", ".join(sorted(state.op_meta[op_hash].names))
                output = meta._combined_output
                tail = [line.line for line in output][-OUTPUT_TAIL:] if output is not None else []
                break
            if meta.did_change():
                changes += 1
        hosts[host.name] = {"changes": changes, "failed_operation": failed_op, "output_tail": tail}
    return {
        "limit": [h.name for h in limit],
        "activated": sorted(h.name for h in state.activated_hosts),
        "failed": sorted(h.name for h in state.failed_hosts),
        "hosts": hosts,
    }


# --------------------------------------------------------------------------------------------
# CLI


def run_rollout(args: argparse.Namespace, echo: Callable[[str], None]) -> RolloutResult:
    cwd = Path(args.chdir).resolve()
    inventory = load_inventory(args.inventory, cwd)
    settings = fleet_settings(inventory)
    settings = Settings(
        canary_group=args.canary if args.canary is not None else settings.canary_group,
        batch=args.batch if args.batch is not None else settings.batch,
        max_failures=args.max_failures if args.max_failures is not None else settings.max_failures,
    )
    hosts = [h.name for h in inventory]
    groups = {name: [h.name for h in members] for name, members in inventory.groups.items()}
    if settings.canary_group is not None and settings.canary_group not in groups:
        echo(f"rollout: no group {settings.canary_group!r} in the inventory: no canary step")
    clusters = {tuple(member["hosts"]) for h in inventory if (member := cluster_membership(h.data))}
    mirrors = sorted({mirror for h in inventory if (mirror := mirror_host(h.data)) is not None})
    steps = plan(hosts, groups, settings, sorted(clusters), mirrors)
    if args.plan:
        return RolloutResult(settings, steps, [HostResult(h, s.name, "skipped") for s in steps for h in s.hosts], None, None, {})
    log_dir = Path(args.log_dir) if args.log_dir else WORK_DIR / ".rigup" / "rollout" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    echo(f"rollout: logs in {log_dir}")

    def runner(step: Step) -> StepReport:
        echo(f"rollout: {step.name}: {', '.join(step.hosts)}")
        log_path = log_dir / (step.name.replace(" ", "-") + ".log")
        return run_step(step, pyinfra_argv(args.inventory, args.deploy, step.hosts, args.pyinfra_args), cwd, log_path, echo)

    return execute(steps, settings, runner)


def _cmd_rollout(args: argparse.Namespace) -> int:
    quiet = args.json
    if args.pyinfra_args and args.pyinfra_args[0] == "--":
        args.pyinfra_args = args.pyinfra_args[1:]

    def echo(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    try:
        result = run_rollout(args, echo)
    except RolloutError as exc:
        print(f"rigup rollout: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        if args.plan:
            for step in result.steps:
                print(f"{step.name}: {', '.join(step.hosts)}")
        else:
            print(format_summary(result))
    return EXIT_OK if args.plan else result.exit_code


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `rollout [--inventory F] [--deploy F] [--canary G] [--batch N] [--max-failures N] ...`."""
    parser = subparsers.add_parser(
        "rollout",
        help="converge the fleet: canary group first, then batches; stop when too many hosts fail",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--inventory", default="inventory.py", help="pyinfra inventory (default inventory.py)")
    parser.add_argument("--deploy", default="deploy.py", help="pyinfra deploy file (default deploy.py)")
    parser.add_argument("--chdir", default=str(DEPLOY_ROOT), help="directory pyinfra runs in (group_data/ lives there)")
    parser.add_argument("--canary", help="canary group (default: rollout_canary_group)")
    parser.add_argument("--batch", type=int, help="hosts per step after the canary (default: rollout_batch)")
    parser.add_argument("--max-failures", type=int, help="failed hosts tolerated (default: rollout_max_failures)")
    parser.add_argument("--plan", action="store_true", help="print the steps and exit")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout (no live output)")
    parser.add_argument("--log-dir", help="where each step's pyinfra output is kept (default .rigup/rollout/<time>)")
    parser.add_argument("pyinfra_args", nargs=argparse.REMAINDER, help="after --: extra pyinfra arguments")
    parser.set_defaults(func=_cmd_rollout)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        if len(argv) < 3 or argv[2] != "--":
            print("usage: python -m rigup.cli.rollout --worker REPORT -- PYINFRA_ARGS...", file=sys.stderr)
            return EXIT_ERROR
        return worker(Path(argv[1]), argv[3:])
    parser = argparse.ArgumentParser(prog="rigup")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["rollout", *argv])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
