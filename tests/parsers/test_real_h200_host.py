"""rigup's facts, preflight and driver plan on captures from a real host (issue 4): Ubuntu 24.04.3,
2x NVIDIA H200 joined by NV18, driver 580.159.04 open, loaded but installed by no apt package (the
host provides it; a runfile install looks the same to dpkg), no lspci, mokutil, docker or systemd.

Captured there with the exact commands of rigup.facts (tests/fixtures/*/2xH200*, *host-provided*,
dpkg/no-driver-packages.txt)."""

from __future__ import annotations

from rigup.checks.driver_plan import DriverWant, plan_driver
from rigup.checks.preflight import failures, run_checks
from rigup.desired.recipe import resolve
from rigup.facts.driver import NvidiaKernelModule, NvidiaPackages
from rigup.operations.driver import nvidia_driver, nvidia_driver_hold
from rigup.parsers.dpkg import DebPackage, driver_packages, parse_dpkg_query
from rigup.parsers.nvidia_smi import SmiQuery, parse_gpu_query
from rigup.parsers.system import LoadedModule, parse_nvidia_version_file, parse_os_release
from tests.support.hostlayer import disk, fresh_2x3090, fx, host_data
from tests.support.opharness import ScriptedHost, run_op

OPEN_580 = DriverWant(580, "open", "ubuntu")


def smi() -> SmiQuery:
    return parse_gpu_query(fx("nvidia-smi/2xH200-580.159.04.csv"))


def loaded() -> LoadedModule | None:
    return parse_nvidia_version_file(fx("proc-nvidia-version/open-580-host-provided.txt"))


def packages() -> tuple[DebPackage, ...]:
    return parse_dpkg_query(fx("dpkg/no-driver-packages.txt"))


def test_real_h200_gpu_query() -> None:
    q = smi()
    assert q.status == "ok"
    assert [(g.index, g.name, g.memory_mib, g.compute_capability, g.bus_id) for g in q.gpus] == [
        (0, "NVIDIA H200", 143771, (9, 0), "0000:00:06.0"),
        (1, "NVIDIA H200", 143771, (9, 0), "0000:00:07.0"),
    ]
    g = q.gpus[0]
    assert (g.driver_version, g.power_limit_w, g.power_min_w, g.power_max_w, g.persistence) == (
        "580.159.04", 700.0, 200.0, 700.0, True
    )


def test_real_host_provided_module_and_empty_dpkg() -> None:
    # "(nixbld@)" and no build date after it: not the dvs-builder line of Ubuntu's packages.
    assert loaded() == LoadedModule("580.159.04", "open", "gcc version 15.3.0 (GCC)")
    # dpkg-query lists a never-installed name with an empty version ("un"): not a driver.
    assert packages() == (DebPackage("nvidia-libopencl1-dev", "", "unknown", "not-installed"),)
    assert driver_packages(packages()) == ()


def test_loaded_driver_without_packages_is_satisfied_not_reinstalled() -> None:
    plan = plan_driver(OPEN_580, packages(), loaded())
    assert plan.action == "none" and plan.external and plan.installed is None
    assert plan.remove == () and plan.unhold == ()
    assert plan.summary.startswith("driver 580.159.04 (open) loaded, not installed by apt")


def test_external_driver_that_misses_the_want_still_installs() -> None:
    assert plan_driver(DriverWant(590, "open", "ubuntu"), packages(), loaded()).action == "install"
    assert plan_driver(DriverWant(580, "proprietary", "ubuntu"), packages(), loaded()).action == "install"
    # Driver packages on the box (metapackage removed by hand): the module is apt's, re-install it.
    leftover = (DebPackage("libnvidia-compute-580", "580.95.05-0ubuntu1", "install", "installed"),)
    plan = plan_driver(OPEN_580, leftover, loaded())
    assert plan.action == "install" and not plan.external


def test_packaged_converged_host_is_not_external() -> None:
    installed = parse_dpkg_query(fx("dpkg/580-open-held.txt"))
    plan = plan_driver(OPEN_580, installed, parse_nvidia_version_file(fx("proc-nvidia-version/open-580.txt")))
    assert plan.action == "none" and not plan.external


def test_preflight_on_the_real_h200_host_passes_with_the_driver_satisfied() -> None:
    facts = fresh_2x3090(
        os=parse_os_release(fx("os-release/ubuntu-24.04.txt")),
        smi=smi(),
        pci=None,
        loaded=loaded(),
        packages=packages(),
        secure_boot="unsupported",
        prebuilt=None,
        disk=disk(137),
    )
    data = host_data(variant="dual", gpu_count=2)
    checks = run_checks(facts, resolve(data), data)
    assert failures(checks) == []
    by_name = {c.name: c for c in checks}
    assert by_name["driver"].ok and "not installed by apt" in by_name["driver"].message
    assert by_name["gpus"].message == "2 GPU(s) via nvidia-smi: NVIDIA H200"
    assert by_name["gpu-count"].ok and by_name["power-cap"].ok


def test_driver_ops_leave_an_external_driver_alone() -> None:
    host = ScriptedHost({NvidiaPackages: packages(), NvidiaKernelModule: loaded()})
    assert run_op(nvidia_driver, host, branch=580, flavour="open", source="ubuntu") == []
    assert run_op(nvidia_driver_hold, host, branch=580) == []
    assert len(host.noops) == 2 and all("not installed by apt" in n for n in host.noops)
