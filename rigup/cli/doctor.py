"""`rigup doctor`: the preflight checks of tasks/preflight.py, run read-only against the
fleet's hosts through pyinfra's API, printed as a table or JSON. Nothing on the hosts changes.

Exit status: 0 when every host passes, 1 when a check fails or a host cannot be reached, 2 for a
bad fleet file.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state

from rigup.checks.preflight import Check, HostFacts, failures
from rigup.desired.fleet import FleetError, fleet_path, load_fleet
from rigup.desired.fleet_ca import CertificateAge, FleetCAError, ca_report
from rigup.desired.knobs import parse_data_value


@dataclass
class HostReport:
    name: str
    reachable: bool
    checks: list[Check] = field(default_factory=list)
    facts: HostFacts | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Reachable, every fact read, at least one check run and none failed: what could not be
        checked counts as a failure."""
        return self.reachable and self.error is None and bool(self.checks) and not failures(self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.name,
            "ok": self.ok,
            "reachable": self.reachable,
            "error": self.error,
            "checks": [c.to_json() for c in self.checks],
            "facts": self.facts.to_json() if self.facts is not None else None,
        }


def collect(
    hosts: Sequence[tuple[str, dict[str, Any]]], sudo: bool = True, lock_dir: Path | None = None
) -> list[HostReport]:
    """Connect to `hosts` ((name, host data) pairs, data already merged with the knob defaults)
    with pyinfra's API and run every check on each one. The recipe is built as the deploy builds it
    (rigup.desired.plan.host_plan with the host's GPU topology); a relative lock_file is read from
    `lock_dir` (default: the fleet file's directory)."""
    # here, not at the top: it brings rigup.runstate (rich) and the pyinfra patches, about 50 ms that every
    # rigup command would pay, since each imports this module to build its parser; only doctor runs it
    from rigup.operations.preflight import host_preflight

    inventory = Inventory(([(name, dict(data)) for name, data in hosts], {}))
    state = State(inventory=inventory, config=Config(SUDO=sudo))
    reports: list[HostReport] = []
    with ctx_state.use(state):
        try:
            connect_all(state)
        except PyinfraError:  # "No hosts remaining!": every host failed to connect
            pass
        # Facts read outside the prepare stage warn when a tool is missing; doctor is read-only.
        state.set_stage(StateStage.Prepare)
        for host in inventory:
            if host not in state.activated_hosts or not host.connected:
                reports.append(HostReport(host.name, False, error="could not connect (see the log above)"))
                continue
            with ctx_host.use(host):
                try:
                    checks, facts = host_preflight(host, lock_dir)
                except Exception as exc:  # a fact command failed on this host: report, go on
                    reports.append(HostReport(host.name, True, error=f"{type(exc).__name__}: {exc}"))
                    continue
            failed_by_fact = host in state.failed_hosts
            report = HostReport(host.name, True, checks, facts)
            if failed_by_fact:
                report.error = "a fact could not be read (see the log above)"
            reports.append(report)
        for host in inventory:
            if host.connected:
                host.disconnect()
    return reports


STATUS = {True: "ok", False: "FAIL"}


def format_table(reports: Iterable[HostReport], verbose: bool = False) -> str:
    rows: list[tuple[str, str, str, str]] = []
    for report in reports:
        if not report.reachable or (report.error and not report.checks):
            rows.append((report.name, "connect" if not report.reachable else "facts", "FAIL", report.error or ""))
            continue
        for check in report.checks:
            if check.ok and check.severity == "info" and not verbose:
                continue
            status = "ok" if check.ok else ("FAIL" if check.failed else "warn")
            text = check.message + (f" -> fix: {check.fix}" if check.fix and not check.ok else "")
            if check.key and not check.ok:
                text += f" [key: {check.key}]"
            rows.append((report.name, check.name, status, text))
        if report.error:
            rows.append((report.name, "facts", "FAIL", report.error))
        passed = sum(1 for c in report.checks if c.ok)
        rows.append((report.name, "summary", "ok" if report.ok else "FAIL", f"{passed}/{len(report.checks)} checks passed"))
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("HOST", "CHECK", "STATUS"))]
    lines = [f"{'HOST':<{widths[0]}}  {'CHECK':<{widths[1]}}  {'STATUS':<{widths[2]}}  DETAIL"]
    for host, name, status, text in rows:
        lines.append(f"{host:<{widths[0]}}  {name:<{widths[1]}}  {status:<{widths[2]}}  {text}")
    return "\n".join(lines)


def format_certificates(ages: list[CertificateAge], renew_days: float) -> str:
    """The fleet CA's lines: days to expiry of the CA and of each certificate it issued (renewed by a
    converge once within fleet_cert_renew_days: `renew at next converge`)."""
    lines = []
    for age in ages:
        if age.days_left is None:
            lines.append(f"fleet CA  {age.what}: none yet at {age.path} (made at the first converge)")
            continue
        note = " (expired)" if age.days_left <= 0 else " (renew at next converge)" if age.days_left <= renew_days and age.what != "CA" else ""
        lines.append(f"fleet CA  {age.what}: {age.days_left:.0f} days to expiry{note}  {age.path}")
    return "\n".join(lines)


def _fleet_hosts(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """(name, knobs) of each host doctor checks; --data is set on every host and checked with the fleet
    file's own rules (variant_overrides against each host's variant) before anything connects."""
    overrides: dict[str, Any] = {}
    for item in args.data:
        key, sep, value = item.partition("=")
        if not sep:
            raise FleetError(f"--data expects KEY=VALUE, got {item!r}")
        overrides[key] = parse_data_value(value)
    fleet = load_fleet(args.fleet, data=overrides)
    hosts = []
    for host in fleet.hosts:
        if args.limit and host.name not in args.limit and host.group not in args.limit:
            continue
        hosts.append((host.name, fleet.resolved_data(host.name)))
    return hosts


def run(
    args: argparse.Namespace,
    out: TextIO = sys.stdout,
    collector: Callable[..., list[HostReport]] = collect,
) -> int:
    """`collector(hosts, lock_dir=DIR)` runs the checks (tests pass their own)."""
    try:
        hosts = _fleet_hosts(args)
    except FleetError as exc:
        print(f"rigup doctor: {exc}", file=sys.stderr)
        return 2
    if not hosts:
        print("rigup doctor: no hosts match", file=sys.stderr)
        return 2
    fleet_file = Path(args.fleet).expanduser().resolve() if args.fleet else fleet_path()
    reports = collector(hosts, lock_dir=fleet_file.parent)
    fleet_data = hosts[0][1]  # the fleet CA's knobs are the fleet's
    try:
        ages = ca_report(fleet_data, fleet_file.parent)
    except FleetCAError as exc:  # an unreadable certificate: said, the host checks still count
        ages, ca_error = [], str(exc)
    else:
        ca_error = None
    if args.json:
        json.dump({"ok": all(r.ok for r in reports), "hosts": [r.to_json() for r in reports],
                   "fleet_ca": {"error": ca_error, "certificates": [
                       {"what": a.what, "path": str(a.path), "days_left": a.days_left} for a in ages]}}, out, indent=2)
        out.write("\n")
    else:
        out.write(format_table(reports, verbose=args.verbose) + "\n")
        out.write((f"fleet CA  {ca_error}" if ca_error else format_certificates(ages, fleet_data["fleet_cert_renew_days"])) + "\n")
    return 0 if all(r.ok for r in reports) else 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `doctor [--fleet FILE] [--limit HOST|GROUP ...] [--data KEY=VALUE ...] [--json] [-v]`."""
    parser = subparsers.add_parser(
        "doctor",
        help="run the preflight checks against the fleet's hosts (read-only)",
        description=(
            "Connect to every host of the fleet file with pyinfra and run the preflight checks the "
            "deploy runs first: OS, GPUs and their layout for the variant's tensor-parallel size, compute "
            "capability, VRAM fit against the measured envelopes, driver branch and loaded driver vs the "
            "image's CUDA, interconnect, Secure Boot, disk, snap Docker, lock; then the days to expiry of the "
            "fleet CA and of each certificate it issued. Changes nothing."
        ),
    )
    parser.add_argument("--fleet", metavar="FILE", help="fleet file (default: $RIGUP_RIGS, else rigs.yaml)")
    parser.add_argument("--limit", action="append", default=[], metavar="HOST|GROUP", help="only these hosts or groups")
    parser.add_argument(
        "--data", action="append", default=[], metavar="KEY=VALUE", help="override a knob for every host (like pyinfra --data)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (checks and the facts they read)")
    parser.add_argument("-v", "--verbose", action="store_true", help="also list the checks that passed")
    parser.set_defaults(func=run)
    return parser
