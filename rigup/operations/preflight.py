"""The preflight gate as operations: run the checks of rigup/checks/preflight.py and fail the host on
any failure (again after a new driver is loaded), before anything changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, operation

from rigup.checks.preflight import (
    Check,
    HostFacts,
    check_capabilities,
    failures,
    gateway_host_checks,
    gather,
    host_recipes,
    privileges_missing,
    run_host_checks,
)
from rigup.desired.knobs import knob
from rigup.facts.gpu import GpuTopology
from rigup.facts.system import FreeDisk, HostCapabilities, OsReleaseInfo


def _fail_host(state: Any, host: Any, title: str, lines: list[str]) -> bool:
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
    if not knob(data, "serves_variant"):  # a gateway-only host: no GPU, driver, Docker or variant to check
        caps = target.get_fact(HostCapabilities, _sudo=False)
        if privileges_missing(check_capabilities(caps, data)):
            return gateway_host_checks(caps, None, {}, data), None
        root = str(knob(data, "install_root"))
        return gateway_host_checks(caps, target.get_fact(OsReleaseInfo), target.get_fact(FreeDisk, paths=[root]), data), None
    first = check_capabilities(target.get_fact(HostCapabilities, _sudo=False), data)
    if privileges_missing(first):
        return first, None
    topology = target.get_fact(GpuTopology)
    built = host_recipes(data, target.name, topology, base_dir)
    facts = gather(lambda cls, **kw: target.get_fact(cls, **kw), data, [b.recipe for b in built], topology)
    return first + run_host_checks(facts, built, data), facts


def preflight_report(target: Any) -> list[Check]:
    """host_preflight's checks."""
    return host_preflight(target)[0]


@operation()
def preflight_checks():
    """
    Fail this host before anything changes when a preflight check fails; no-op when all pass.

    Reads the facts rigup.checks.preflight needs (OS, GPUs, driver packages and module, Secure Boot, disk,
    Docker, GPU memory in use, driver CUDA version, GPU topology) and the host's recipe. Failed checks
    of severity "error" fail the host (not the run) with one line per check naming the host, the key
    and the fix; warnings are logged.

    **Example:**

    .. code:: python

        preflight.preflight_checks(name="Run preflight checks")
    """
    checks = preflight_report(host)
    failed = failures(checks)
    warnings = [c for c in checks if not c.ok and not c.failed]
    if state.is_executing:
        for check in warnings:
            host.log_styled(f"preflight warning: {check.describe(host.name)}", fg="yellow", log_func=logger.warning)
    if not failed:
        host.noop(f"preflight: {len(checks) - len(warnings)} of {len(checks)} checks passed, {len(warnings)} warned, none failed")
        return
    lines = [c.describe(host.name) for c in failed]
    if not state.is_executing:
        # Shown in the change table of `pyinfra ... --dry` before anything runs.
        for line in lines:
            logger.warning(f"[{host.name}] preflight will fail: {line}")
    yield FunctionCommand(_fail_host, (f"preflight failed ({len(failed)} checks)", lines), {})


def _preflight_now(state: Any, host: Any) -> bool:
    checks = preflight_report(host)
    failed = failures(checks)
    for check in checks:
        if not check.ok and not check.failed:
            host.log_styled(f"preflight warning: {check.describe(host.name)}", fg="yellow", log_func=logger.warning)
    if failed:
        return _fail_host(
            state, host, f"preflight failed with the driver loaded ({len(failed)} checks)", [c.describe(host.name) for c in failed]
        )
    host.log_styled(f"preflight with the driver loaded: {len(checks)} checks passed", fg="green", log_func=logger.info)
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

