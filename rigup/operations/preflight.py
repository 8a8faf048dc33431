"""The preflight gate: judge a host by the checks of rigup/checks/preflight.py while the deploy is
planned and fail it on any failure before anything is planned for it; again, as an operation, after
a new driver is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, operation

from rigup.checks.preflight import (
    Check,
    HostFacts,
    check_capabilities,
    check_cluster_network,
    failures,
    gateway_host_checks,
    host_recipes,
    privileges_missing,
    run_host_checks,
)
from rigup.desired.knobs import knob
from rigup.desired.roles import serves_variant
from rigup.desired.trust import https_urls, origins
from rigup.facts.gpu import GpuTopology
from rigup.facts.network import HttpsTrust
from rigup.facts.system import FreeDisk, HostCapabilities, OsReleaseInfo
from rigup.operations.cluster import cluster_host_data, member_network, peer_addresses
from rigup.operations.preflight_facts import gather
from rigup.pyinfra_patches import fail_host_while_planning
from rigup.runstate import record_preflight


def fail_host_with_reasons(state: Any, host: Any, title: str, lines: list[str]) -> bool:
    """FunctionCommand body: log why in red and fail this host (returning False)."""
    # pyinfra passes state and host only to functions whose parameters have exactly these names.
    host.log_styled(title, fg="red", bold=True, log_func=logger.error)
    for line in lines:
        host.log_styled(f"  {line}", fg="red", log_func=logger.error)
    return False


def host_preflight(target: Any, base_dir: Path | None = None) -> tuple[list[Check], HostFacts | None]:
    """Every preflight check for `target` (a pyinfra Host) and the facts they read, read now.

    What the host can run is read first, without sudo: where the login user cannot act as root, the
    other facts (which run through sudo) are not read and those checks alone come back. The recipe is
    the one the later phases build (rigup.desired.plan.host_plan with the host's GPU topology); a
    relative lock_file is read from `base_dir` (default: the fleet file's directory)."""
    data = target.data.dict()
    if not serves_variant(data):  # a gateway-only host: no GPU, driver, Docker or variant to check
        caps = target.get_fact(HostCapabilities, _sudo=False)
        if privileges_missing(check_capabilities(caps, data)):
            return gateway_host_checks(caps, None, {}, data), None
        root = str(knob(data, "install_root"))
        origins_ = origins(https_urls(data, gateway=True))
        tls = target.get_fact(HttpsTrust, origins=origins_) if origins_ else None
        return gateway_host_checks(caps, target.get_fact(OsReleaseInfo), target.get_fact(FreeDisk, paths=[root]), data, tls), None
    first = check_capabilities(target.get_fact(HostCapabilities, _sudo=False), data)
    if privileges_missing(first):
        return first, None
    topology = target.get_fact(GpuTopology)
    network = member_network(target)
    data = cluster_host_data(target)  # a member's compose names the interface and addresses it read
    built = host_recipes(data, target.name, topology, base_dir)
    facts = gather(lambda cls, **kw: target.get_fact(cls, **kw), data, [b.recipe for b in built], topology)
    peers = [] if network is None else [
        n for n in (member_network(target.inventory.get_host(name)) for name in peer_addresses(target)) if n is not None]
    return first + run_host_checks(facts, built, data) + check_cluster_network(network, peers), facts


def preflight_report(target: Any) -> list[Check]:
    """host_preflight's checks."""
    return host_preflight(target)[0]


@operation()
def preflight_checks(passed: bool, summary: str, title: str, failed_lines: list[str]):
    """
    Report this host's preflight verdict: a no-op when every check passed; otherwise a command that
    fails the host (preflight_gate has already failed it, so it shows as an error and never runs).

    + passed: whether no check of severity "error" failed
    + summary: the no-op line ("N of M checks passed, ...")
    + title: the failure's headline ("preflight failed (N checks)")
    + failed_lines: one line per failed check, naming the host, the key and the fix
    """
    if passed:
        host.noop(summary)
        return
    yield FunctionCommand(fail_host_with_reasons, (title, failed_lines), {})


@dataclass(frozen=True)
class PreflightVerdict:
    """A host's preflight checks, judged: what fails it, what only warns."""

    checks: list[Check]

    @property
    def failed(self) -> list[Check]:
        return failures(self.checks)

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if not c.ok and not c.failed]

    @property
    def passed(self) -> bool:
        return not self.failed

    def title(self, when: str = "") -> str:
        return f"preflight failed{when} ({len(self.failed)} checks)"

    def failed_lines(self, host_name: str) -> list[str]:
        """One line per failed check, naming the host, the key and the fix."""
        return [c.describe(host_name) for c in self.failed]

    def log_warnings(self, host: Any) -> None:
        for check in self.warnings:
            host.log_styled(f"preflight warning: {check.describe(host.name)}", fg="yellow", log_func=logger.warning)

    def summary(self) -> str:
        passed = len(self.checks) - len(self.warnings)
        return f"preflight: {passed} of {len(self.checks)} checks passed, {len(self.warnings)} warned, none failed"


def preflight_gate(name: str) -> bool:
    """
    Judge this host now, while pyinfra plans the deploy (with -y and --dry too), from the facts
    rigup.checks.preflight needs (OS, GPUs, driver packages and module, Secure Boot, disk, Docker, GPU
    memory in use, driver CUDA version, GPU topology) and the host's recipe, and add the operation
    `name` (preflight_checks) that reports it.

    Warnings are logged. A failed check of severity "error" fails the host (not the run) now, with one
    line per check naming the host, the key and the fix: nothing after preflight is planned or run for
    it (deploy.py reads the verdict, rigup.runstate.runs_rig_tasks), and the run, --dry included,
    exits 1. Returns whether the host passed.

    **Example:**

    .. code:: python

        preflight.preflight_gate(name="Run preflight checks")
    """
    verdict = PreflightVerdict(preflight_report(host))
    verdict.log_warnings(host)
    lines = verdict.failed_lines(host.name)
    preflight_checks(name=name, passed=verdict.passed, summary=verdict.summary(), title=verdict.title(), failed_lines=lines)
    record_preflight(host, verdict.passed)
    if not verdict.passed:
        fail_host_with_reasons(state, host, verdict.title(), lines)
        fail_host_while_planning(state, host)
    return verdict.passed


def _preflight_now(state: Any, host: Any) -> bool:
    verdict = PreflightVerdict(preflight_report(host))
    verdict.log_warnings(host)
    if not verdict.passed:
        return fail_host_with_reasons(state, host, verdict.title(" with the driver loaded"), verdict.failed_lines(host.name))
    host.log_styled(f"preflight with the driver loaded: {len(verdict.checks)} checks passed", fg="green", log_func=logger.info)
    return True


@operation()
def preflight_after_driver():
    """
    Run every preflight check again from facts read now, and fail this host when one fails.

    Before the driver is loaded preflight knows the GPUs from lspci only: VRAM of cards whose PCI id
    is shared by boards of several memory sizes, compute capability of unknown cards, power limits
    and the driver's CUDA version wait for nvidia-smi. Run it ``_if`` the driver operation changed
    the host (it rebooted onto a new driver), before Docker, sources and the model are set up.

    **Example:**

    .. code:: python

        preflight.preflight_after_driver(name="Re-run preflight with the new driver loaded", _if=driver.did_change)
    """
    yield FunctionCommand(_preflight_now, (), {})


def fleet_value(name: str, inventory: Any) -> int:
    """The smallest value of a positive integer knob over the inventory (its default when no host
    has a valid one): execution arguments such as _parallel must be the same on every host, and the
    strictest setting wins."""
    values = []
    for h in inventory:
        value = knob(h.data, name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            values.append(value)
    return min(values) if values else int(knob({}, name))

