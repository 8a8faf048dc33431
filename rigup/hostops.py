"""Custom operations for the host layer: preflight gate (and its re-run once a new driver is
loaded), NVIDIA driver state machine, apt holds,
apt source conflicts, Docker's daemon.json and nvidia runtime, /dev/char links, GPU power state,
GPU smoke test.

Each one reads facts (rigup/facts.py), compares them with its arguments, then yields only the
commands that close the gap or calls host.noop() with the current state.

A host-level failure (a failed preflight check, a driver that did not come up after the reboot) is
reported by a FunctionCommand returning False: pyinfra then fails that host and carries on with
the others. Raising OperationError from an operation would stop the whole run instead.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping
from io import StringIO
from typing import Any

import gevent
from pyinfra import host, logger, state
from pyinfra.api import FileUploadCommand, FunctionCommand, OperationError, QuoteString, StringCommand, operation
from pyinfra.connectors.util import clear_askpass_cache, remove_any_sudo_askpass_file
from pyinfra.facts.systemd import SystemdStatus

from rigup.driverstate import (
    FLAVOURS,
    DRIVER_SOURCES,
    DriverWant,
    branch_packages,
    plan_driver,
    wanted_packages,
)
from rigup.facts import (
    AptPolicies,
    AptSourceEntries,
    DockerDaemonJson,
    DockerEngineInfo,
    NvidiaDevChar,
    NvidiaGpus,
    NvidiaKernelModule,
    NvidiaPackages,
)
from rigup.fitfacts import GpuTopology
from rigup.parsers import AptSource
from rigup.preflight import Check, failures, gather, host_recipe, run_checks

# Files rigup owns for the third-party apt repositories (one place, used by several task files).
KEYRING_DIR = "/etc/apt/keyrings"
DOCKER_KEYRING = f"{KEYRING_DIR}/rigup-docker.asc"
DOCKER_LIST = "/etc/apt/sources.list.d/rigup-docker.list"
CTK_KEYRING = f"{KEYRING_DIR}/rigup-nvidia-container-toolkit.asc"
CTK_LIST = "/etc/apt/sources.list.d/rigup-nvidia-container-toolkit.list"
CUDA_KEYRING = f"{KEYRING_DIR}/rigup-cuda.asc"
CUDA_LIST = "/etc/apt/sources.list.d/rigup-cuda.list"


def ctk_repo_uri(base_url: str) -> str:
    """NVIDIA's flat toolkit repository: apt expands $(ARCH) (amd64, arm64)."""
    return f"{base_url.rstrip('/')}/$(ARCH)"


APT_ENV = "DEBIAN_FRONTEND=noninteractive"
APT_GET = (
    "apt-get",
    "-y",
    "-o",
    "Dpkg::Options::=--force-confdef",
    "-o",
    "Dpkg::Options::=--force-confold",
)


def _fail_host(state: Any, host: Any, title: str, lines: list[str]) -> bool:
    """FunctionCommand body: log why in red and fail this host (returning False)."""
    # pyinfra passes state and host only to functions whose parameters have exactly these names.
    host.log_styled(title, fg="red", bold=True, log_func=logger.error)
    for line in lines:
        host.log_styled(f"  {line}", fg="red", log_func=logger.error)
    return False


# --------------------------------------------------------------------------------------------
# Preflight


def preflight_report(target: Any) -> list[Check]:
    """Every preflight check for `target` (a pyinfra Host), from facts read now: the recipe is the
    one the later phases build (rigup.lock.locked_recipe with the host's GPU topology)."""
    data = target.data.dict()
    topology = target.get_fact(GpuTopology)
    built = host_recipe(data, target.name, topology)
    facts = gather(lambda cls, **kw: target.get_fact(cls, **kw), data, built.recipe, topology)
    return run_checks(facts, built.recipe, data, built.error, built.lock_problem)


@operation()
def preflight_checks():
    """
    Fail this host before anything changes when a preflight check fails; no-op when all pass.

    Reads the facts rigup.preflight needs (OS, GPUs, driver packages and module, Secure Boot, disk,
    Docker, GPU memory in use, driver CUDA version, GPU topology) and the host's recipe. Failed checks
    of severity "error" fail the host (not the run) with one line per check naming the host, the key
    and the fix; warnings are logged.

    **Example:**

    .. code:: python

        hostops.preflight_checks(name="Run preflight checks")
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

        hostops.preflight_after_driver(name="Re-run preflight with the new driver loaded", _if=driver.did_change)
    """
    yield FunctionCommand(_preflight_now, (), {})


# --------------------------------------------------------------------------------------------
# NVIDIA driver


def _boot_id(host: Any) -> str | None:
    try:
        ok, output = host.run_shell_command(StringCommand("cat", "/proc/sys/kernel/random/boot_id"))
    except Exception:  # connection dropping while the host goes down
        return None
    return output.stdout_lines[0].strip() if ok and output.stdout_lines else None


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
        deadline = time.monotonic() + reboot_timeout
        while True:
            host.connect(show_errors=False)
            if host.connected:
                now = _boot_id(host)
                if now is not None and now != before[0]:
                    host.log_styled("rebooted", fg="cyan", log_func=logger.info)
                    clear_askpass_cache(host)
                    return True
            if time.monotonic() > deadline:
                return _fail_host(state, host, f"did not come back within {reboot_timeout}s after the reboot", [])
            gevent.sleep(interval)

    yield FunctionCommand(wait, (), {})


def _verify_driver(state: Any, host: Any, want: DriverWant) -> bool:
    plan = plan_driver(want, host.get_fact(NvidiaPackages), host.get_fact(NvidiaKernelModule))
    if plan.action != "none":
        return _fail_host(state, host, "NVIDIA driver check after the reboot failed", [plan.summary])
    smi = host.get_fact(NvidiaGpus)
    if smi is None or smi.status != "ok":
        why = "nvidia-smi is missing" if smi is None else f"nvidia-smi: {smi.message}"
        return _fail_host(state, host, "NVIDIA driver loaded but nvidia-smi fails", [why])
    host.log_styled(
        f"driver {plan.loaded.version} ({plan.loaded.flavour}) loaded; nvidia-smi sees {len(smi.gpus)} GPU(s)",  # type: ignore[union-attr]
        fg="green",
        log_func=logger.info,
    )
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

        hostops.nvidia_driver(
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

        hostops.nvidia_driver_hold(name="Hold the NVIDIA driver packages", branch=580)
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


# --------------------------------------------------------------------------------------------
# apt sources


def normalize_uri(uri: str, arch: str) -> str:
    """Compare apt URIs the way a human means them: no scheme, no trailing slash, $(ARCH) expanded."""
    text = uri.strip().replace("$(ARCH)", arch)
    text = re.sub(r"^[a-z0-9+]+://", "", text, flags=re.I)
    host_part, _, path = text.partition("/")
    return f"{host_part.lower()}/{path.rstrip('/')}"


def conflicting_entries(entries: tuple[AptSource, ...], uri: str, keep: str, arch: str) -> list[AptSource]:
    """Enabled entries outside `keep` that point at `uri`: apt fails with "Conflicting values set
    for option Signed-By" when their keyring differs from ours, and warns about duplicates when not."""
    target = normalize_uri(uri, arch)
    return [
        e
        for e in entries
        if e.file != keep and e.enabled and any(normalize_uri(u, arch) == target for u in e.uris)
    ]


@operation()
def apt_source_exclusive(uri: str, keep: str, arch: str = "amd64"):
    """
    Make ``keep`` the only enabled apt source for ``uri``: other entries for the same repository
    (hand-made lines without signed-by, or with another keyring) are disabled in place, never
    deleted: one-line entries are commented out, deb822 stanzas get ``Enabled: no``.

    + uri: repository URI (``$(ARCH)`` allowed)
    + keep: the source file rigup manages for this repository
    + arch: dpkg architecture, to expand ``$(ARCH)``

    **Example:**

    .. code:: python

        hostops.apt_source_exclusive(
            name="Disable other Docker apt sources",
            uri="https://download.docker.com/linux/ubuntu",
            keep="/etc/apt/sources.list.d/rigup-docker.list",
        )
    """
    conflicts = conflicting_entries(host.get_fact(AptSourceEntries), uri, keep, arch)
    if not conflicts:
        host.noop(f"no other apt source entry points at {uri}")
        return
    by_file: dict[str, list[AptSource]] = {}
    for entry in conflicts:
        by_file.setdefault(entry.file, []).append(entry)
    for path, entries in sorted(by_file.items()):
        exprs: list[Any] = []
        for e in entries:
            if e.format == "one-line":
                exprs += ["-e", QuoteString(f"{e.line}s|^|# disabled by rigup (duplicate of {keep}): |")]
            elif e.enabled_line is not None:
                exprs += ["-e", QuoteString(f"{e.enabled_line}s|.*|Enabled: no|")]
            else:
                exprs += ["-e", QuoteString(f"{e.line}i Enabled: no")]
        # sed addresses refer to input lines, so several edits in one pass stay aligned.
        yield StringCommand("sed", "-i", *exprs, QuoteString(path))


# --------------------------------------------------------------------------------------------
# Docker + NVIDIA container toolkit


DAEMON_JSON = "/etc/docker/daemon.json"


def merged_daemon_config(current: Mapping[str, Any] | None, insecure_registries: list[str]) -> dict[str, Any] | None:
    """`current` with the wanted entries added (the user's keys and list entries kept); None when
    nothing is missing."""
    config = dict(current or {})
    have = list(config.get("insecure-registries") or [])
    missing = [r for r in insecure_registries if r not in have]
    if not missing:
        return None
    config["insecure-registries"] = have + missing
    return config


@operation()
def docker_daemon_config(insecure_registries: list[str] | None = None):
    """
    Add settings to /etc/docker/daemon.json without touching the keys already there (the user's,
    the nvidia runtime ``nvidia-ctk`` adds). Restarting Docker is the caller's handler.

    + insecure_registries: ``host:port`` registries Docker may use over plain HTTP (a LAN mirror)

    **Example:**

    .. code:: python

        hostops.docker_daemon_config(name="Let Docker pull from the LAN mirror",
                                     insecure_registries=["10.0.0.5:5000"])
    """
    wanted = list(insecure_registries or [])
    merged = merged_daemon_config(host.get_fact(DockerDaemonJson), wanted)
    if merged is None:
        host.noop(f"{DAEMON_JSON} has every wanted setting")
        return
    text = json.dumps(merged, indent=4, sort_keys=True) + "\n"
    yield StringCommand("mkdir", "-p", "/etc/docker")
    yield FileUploadCommand(StringIO(text), DAEMON_JSON)
    yield StringCommand("chmod", "644", DAEMON_JSON)


@operation()
def docker_nvidia_runtime():
    """
    Register the ``nvidia`` runtime with Docker through ``nvidia-ctk runtime configure``, which
    merges it into /etc/docker/daemon.json and keeps every other key. Runs only when
    ``docker info`` does not list the runtime; restarting Docker is the caller's handler.

    **Example:**

    .. code:: python

        runtime = hostops.docker_nvidia_runtime(name="Register the nvidia runtime with Docker")
        systemd.service(name="Restart Docker after runtime change", service="docker.service",
                        restarted=True, _if=runtime.did_change)
    """
    info = host.get_fact(DockerEngineInfo)
    if info is not None and info.has_nvidia_runtime:
        host.noop("docker already lists the nvidia runtime")
        return
    yield StringCommand("nvidia-ctk", "runtime", "configure", "--runtime=docker")


@operation()
def nvidia_dev_char_links():
    """
    Create the ``/dev/char/MAJOR:MINOR`` links for NVIDIA's device nodes. Without them, a
    ``systemctl daemon-reload`` makes runc drop GPU access from running containers
    (nvidia-container-toolkit#48); the udev rule from files/ keeps them after reboots.

    **Example:**

    .. code:: python

        hostops.nvidia_dev_char_links(name="Create /dev/char links for NVIDIA devices")
    """
    dev = host.get_fact(NvidiaDevChar)
    if not dev.devices:
        host.noop("no NVIDIA character devices (driver not loaded); the udev rule creates the links at load")
        return
    if not dev.missing:
        host.noop(f"/dev/char links exist for {len(dev.devices)} NVIDIA devices")
        return
    yield StringCommand("nvidia-ctk", "system", "create-dev-char-symlinks", "--create-all")


def _power_drift(smi: Any, power_cap_watts: int | None, persistence: bool) -> list[str]:
    drift: list[str] = []
    for g in smi.gpus:
        if power_cap_watts is not None and (g.power_limit_w is None or abs(g.power_limit_w - power_cap_watts) > 0.5):
            drift.append(f"GPU {g.index} power limit {g.power_limit_w} W != {power_cap_watts} W")
        if persistence and g.persistence is not True:
            drift.append(f"GPU {g.index} persistence mode off")
    return drift


def _verify_power(state: Any, host: Any, power_cap_watts: int | None, persistence: bool) -> bool:
    smi = host.get_fact(NvidiaGpus)
    if smi is None or smi.status != "ok":
        return _fail_host(state, host, "nvidia-smi does not answer after applying GPU settings", [])
    drift = _power_drift(smi, power_cap_watts, persistence)
    if drift:
        return _fail_host(state, host, "GPU settings did not apply", drift)
    return True


@operation()
def gpu_power_state(unit: str, power_cap_watts: int | None = None, persistence: bool = True):
    """
    Make every GPU's power limit and persistence mode what ``unit`` (a oneshot that runs
    ``nvidia-smi -pm 1`` / ``-pl W`` at boot) sets; restart the unit only when nvidia-smi shows drift,
    then check again.

    + unit: the oneshot systemd unit that applies the settings
    + power_cap_watts: wanted per-GPU power limit (None: not managed)
    + persistence: whether persistence mode must be on

    **Example:**

    .. code:: python

        hostops.gpu_power_state(name="Apply GPU power cap and persistence",
                                unit="rigup-gpu-power.service", power_cap_watts=230)
    """
    smi = host.get_fact(NvidiaGpus)
    if smi is None or smi.status != "ok":
        host.noop(f"nvidia-smi does not answer (driver not loaded); {unit} applies the settings at boot")
        return
    drift = _power_drift(smi, power_cap_watts, persistence)
    if not drift:
        host.noop(f"{len(smi.gpus)} GPU(s) at the wanted power limit and persistence mode")
        return
    yield StringCommand("systemctl", "restart", QuoteString(unit))
    yield FunctionCommand(_verify_power, (power_cap_watts, persistence), {})


@operation(is_idempotent=False, idempotent_notice="Runs a container every time; gate it with _if.")
def gpu_smoke_test(image: str):
    """
    Run ``nvidia-smi -L`` in ``image`` with ``--gpus all`` and fail unless the container sees as
    many GPUs as the host does.

    + image: fully qualified CUDA base image (registry/repository:tag)

    **Example:**

    .. code:: python

        hostops.gpu_smoke_test(name="Check containers see every GPU",
                               image="docker.io/nvidia/cuda:12.6.0-base-ubuntu22.04",
                               _if=toolkit.did_change)
    """
    ref = QuoteString(image)
    script = StringCommand(
        "host_gpus=$(nvidia-smi -L | grep -c '^GPU ' || true);",
        "out=$(docker run --rm --gpus all",
        ref,
        "nvidia-smi -L 2>&1) || { echo \"rigup: GPU smoke container failed: $out\" >&2; exit 1; };",
        "seen=$(printf '%s\\n' \"$out\" | grep -c '^GPU ' || true);",
        'if [ "$seen" -ne "$host_gpus" ] || [ "$seen" -eq 0 ]; then',
        'echo "rigup: GPU smoke test: the container sees $seen GPU(s), the host has $host_gpus" >&2; exit 1; fi;',
        'echo "GPU smoke test: $seen GPU(s) visible in the container"',
    )
    yield StringCommand("sh", "-c", QuoteString(script))


def fleet_value(name: str, default: int, inventory: Any) -> int:
    """The smallest value of an integer knob over the inventory: execution arguments such as
    _parallel must be the same on every host, and the strictest setting wins."""
    values = []
    for h in inventory:
        value = h.data.get(name, default)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            values.append(value)
    return min(values) if values else default


def image_ref(registry: str, image: str) -> str:
    """Prefix `image` with `registry` unless it already names one (first part has "." or ":")."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"{registry.rstrip('/')}/{image}"
