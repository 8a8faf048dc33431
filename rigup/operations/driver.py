"""NVIDIA driver operations: install the wanted branch (the plan is rigup/checks/driver_plan.py),
hold it, and reboot into it (waiting for a new boot id)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import gevent
from pyinfra import host, logger
from pyinfra.api import FunctionCommand, OperationError, QuoteString, StringCommand, operation
from pyinfra.connectors.util import clear_askpass_cache, remove_any_sudo_askpass_file
from pyinfra.facts.systemd import SystemdStatus

from rigup.checks.driver_plan import DRIVER_SOURCES, FLAVOURS, DriverWant, branch_packages, plan_driver, wanted_packages
from rigup.facts.apt import AptPolicies
from rigup.facts.driver import NvidiaKernelModule, NvidiaPackages
from rigup.facts.gpu import NvidiaGpus
from rigup.operations.apt import APT_ENV, APT_GET
from rigup.operations.preflight import fail_host_with_reasons
from rigup.runstate import account


def _boot_id(host: Any) -> str | None:
    try:
        ok, output = host.run_shell_command(StringCommand("cat", "/proc/sys/kernel/random/boot_id"))
    except Exception:  # connection dropping while the host goes down
        return None
    return output.stdout_lines[0].strip() if ok and output.stdout_lines else None


REBOOT_PROGRESS_S = 10  # seconds between "waiting for the reboot" lines


def reboot_and_wait(reboot_timeout: int, delay: int = 5, interval: int = 2) -> Iterator[Any]:
    """Commands that reboot the host and wait until it is back with a new boot id.

    pyinfra's server.reboot compares /proc/uptime, which a container (the test bed's nspawn hosts)
    shares with its host kernel; the boot id changes on every boot of a machine or container.
    """
    before: list[str | None] = []

    def capture(state: Any, host: Any) -> bool:
        remove_any_sudo_askpass_file(host)
        before.append(_boot_id(host))
        return before[0] is not None

    yield FunctionCommand(capture, (), {})
    # Detached so the SSH channel closes before the connection goes away (as server.reboot does).
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")

    def wait(state: Any, host: Any) -> bool:
        gevent.sleep(delay)
        clear_askpass_cache(host)
        host.disconnect()
        started = time.monotonic()
        deadline = started + reboot_timeout
        told = started
        while True:
            host.connect(show_errors=False)
            if host.connected:
                now = _boot_id(host)
                if now is not None and now != before[0]:
                    took = time.monotonic() - started + delay
                    host.log_styled(f"rebooted in {took:.0f} s", fg="cyan", log_func=logger.info)
                    account(host, f"rebooted in {took:.0f} s")
                    clear_askpass_cache(host)
                    return True
            if time.monotonic() > deadline:
                return fail_host_with_reasons(state, host, f"did not come back within {reboot_timeout}s after the reboot", [])
            if time.monotonic() - told >= REBOOT_PROGRESS_S:  # at default verbosity: the wait is not silent
                told = time.monotonic()
                host.log_styled(
                    f"waiting for the reboot: {told - started + delay:.0f} s of at most {reboot_timeout} s",
                    log_func=logger.info,
                )
            gevent.sleep(interval)

    yield FunctionCommand(wait, (), {})


def _verify_driver(state: Any, host: Any, want: DriverWant) -> bool:
    plan = plan_driver(want, host.get_fact(NvidiaPackages), host.get_fact(NvidiaKernelModule))
    if plan.action != "none":
        return fail_host_with_reasons(state, host, "NVIDIA driver check after the reboot failed", [plan.summary])
    smi = host.get_fact(NvidiaGpus)
    if smi is None or smi.status != "ok":
        why = "nvidia-smi is missing" if smi is None else f"nvidia-smi: {smi.message}"
        return fail_host_with_reasons(state, host, "NVIDIA driver loaded but nvidia-smi fails", [why])
    host.log_styled(
        f"driver {plan.loaded.version} ({plan.loaded.flavour}) loaded; nvidia-smi sees {len(smi.gpus)} GPU(s)",  # type: ignore[union-attr]
        fg="green",
        log_func=logger.info,
    )
    account(host, f"driver {plan.loaded.version} ({plan.loaded.flavour}) installed and loaded")  # type: ignore[union-attr]
    return True


def _report_reboot_required(state: Any, host: Any, summary: str) -> bool:
    host.log_styled(
        f"REBOOT REQUIRED ({summary}); driver_reboot=never: reboot this host, then re-run the deploy. "
        "GPU containers are not started on it in this run.",
        fg="yellow",
        bold=True,
        log_func=logger.warning,
    )
    return True


@operation()
def nvidia_driver(
    branch: int,
    flavour: str = "open",
    source: str = "ubuntu",
    packages: list[str] | None = None,
    stop_units: list[str] | None = None,
    reboot: bool = True,
    reboot_timeout: int = 900,
):
    """
    Make the NVIDIA driver of branch >= ``branch`` installed and loaded.

    + branch: lowest acceptable driver branch (an installed higher branch of the same flavour and
      source is kept)
    + flavour: ``open`` or ``proprietary`` kernel modules
    + source: ``ubuntu`` (Ubuntu archive packages) or ``cuda`` (NVIDIA's CUDA repository)
    + packages: apt packages to install (default: the branch metapackage for source/flavour)
    + stop_units: systemd units stopped before the driver changes (the serving unit)
    + reboot: reboot when the loaded module is not the installed one, wait, then verify;
      False only reports "reboot required"
    + reboot_timeout: seconds to wait for the host to come back

    States: installed and loaded -> no-op; installed, other or no module loaded -> reboot;
    not installed (or wrong branch/flavour/source) -> stop units, unhold, install in one apt
    transaction that also removes other branches' packages, reboot. After a reboot the loaded
    module and nvidia-smi are checked and the host fails if they do not match.

    **Example:**

    .. code:: python

        driver.nvidia_driver(
            name="Install and load the NVIDIA driver",
            branch=580,
            flavour="open",
            stop_units=["rigup-dual.service"],
            _parallel=1,  # reboot one host at a time
        )
    """
    if flavour not in FLAVOURS:
        raise OperationError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")
    if source not in DRIVER_SOURCES:
        raise OperationError(f"source must be one of {DRIVER_SOURCES}, got {source!r}")
    want = DriverWant(int(branch), flavour, source)  # type: ignore[arg-type]
    plan = plan_driver(want, host.get_fact(NvidiaPackages), host.get_fact(NvidiaKernelModule))
    if plan.action == "none":
        host.noop(plan.summary)
        return

    if plan.action == "install" or reboot:
        units = list(stop_units or [])
        if units:
            status = host.get_fact(SystemdStatus, services=units)
            for unit in units:
                if status.get(unit):
                    yield StringCommand("systemctl", "stop", QuoteString(unit))

    if plan.action == "install":
        if plan.unhold:
            yield StringCommand("apt-mark", "unhold", *(QuoteString(p) for p in plan.unhold))
        install = list(packages or wanted_packages(want))
        policy = host.get_fact(AptPolicies, packages=install)
        if any(policy.get(p) is None or policy[p].candidate is None for p in install):
            # A package list without the driver (fresh image, stale cache): refresh once.
            yield StringCommand(APT_ENV, "apt-get", "update")
        yield StringCommand(
            APT_ENV,
            *APT_GET,
            "install",
            *(QuoteString(p) for p in install),
            # Other branches go in the same transaction: apt swaps them atomically.
            *(QuoteString(f"{p}-") for p in plan.remove),
        )

    if reboot:
        yield from reboot_and_wait(reboot_timeout)
        yield FunctionCommand(_verify_driver, (want,), {})
    else:
        yield FunctionCommand(_report_reboot_required, (plan.summary,), {})


@operation()
def nvidia_driver_hold(branch: int, flavour: str = "open", source: str = "ubuntu"):
    """
    Hold (``apt-mark hold``) every installed package of the driver branch in use, so that apt
    upgrades never replace userspace under a loaded module.

    + branch: lowest acceptable driver branch (as for nvidia_driver)
    + flavour: ``open`` or ``proprietary``
    + source: ``ubuntu`` or ``cuda``

    The branch held is the installed one that satisfies the arguments; before the driver is
    installed (prepare time of a first run) the packages nvidia_driver will install are listed.

    **Example:**

    .. code:: python

        driver.nvidia_driver_hold(name="Hold the NVIDIA driver packages", branch=580)
    """
    want = DriverWant(int(branch), flavour, source)  # type: ignore[arg-type]
    packages = host.get_fact(NvidiaPackages)
    plan = plan_driver(want, packages, host.get_fact(NvidiaKernelModule))
    if plan.external:  # no apt package to hold: the driver came from a runfile or the host
        host.noop(plan.summary)
        return
    if plan.installed is None:
        names = list(wanted_packages(want))
        held: set[str] = set()
    else:
        names = list(branch_packages(packages, plan.installed.branch))
        held = {p.name for p in packages if p.held}
    todo = [n for n in names if n not in held]
    if not todo:
        host.noop(f"{len(names)} packages of driver branch {plan.installed.branch if plan.installed else branch} are held")
        return
    yield StringCommand("apt-mark", "hold", *(QuoteString(n) for n in todo))

