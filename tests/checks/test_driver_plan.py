"""The driver state machine: wanted vs installed packages vs loaded module."""

from __future__ import annotations

import pytest

from rigup.checks.driver_plan import (
    DriverWant,
    branch_cuda,
    branch_packages,
    needs_unsigned_modules,
    plan_driver,
    wanted_packages,
)
from rigup.parsers.dpkg import DebPackage, parse_dpkg_query
from rigup.parsers.system import LoadedModule, parse_nvidia_version_file
from rigup.runstate import HostDriverState, driver_changed, record, serving_blocked
from tests.support.hostlayer import fx

OPEN_580 = DriverWant(580, "open", "ubuntu")


def pkgs(name: str) -> tuple[DebPackage, ...]:
    return parse_dpkg_query(fx(f"dpkg/{name}"))


def loaded(name: str) -> LoadedModule | None:
    return parse_nvidia_version_file(fx(f"proc-nvidia-version/{name}"))


def test_converged_is_a_noop():
    plan = plan_driver(OPEN_580, pkgs("580-open-held.txt"), loaded("open-580.txt"))
    assert plan.action == "none"
    assert plan.summary == "nvidia-driver-580-open 580.95.05 installed and loaded"


def test_installed_but_not_loaded_needs_a_reboot():
    plan = plan_driver(OPEN_580, pkgs("580-open-held.txt"), None)
    assert plan.action == "reboot" and "no module loaded" in plan.summary
    old = plan_driver(OPEN_580, pkgs("580-open-held.txt"), loaded("proprietary-550.txt"))
    assert old.action == "reboot" and "loaded 550.120 (proprietary)" in old.summary


def test_550_to_580_swaps_branches_in_one_transaction():
    plan = plan_driver(OPEN_580, pkgs("550-proprietary-held.txt"), loaded("proprietary-550.txt"))
    assert plan.action == "install"
    assert plan.remove == (
        "libnvidia-compute-550",
        "nvidia-dkms-550",
        "nvidia-driver-550",
        "nvidia-kernel-common-550",
        "nvidia-utils-550",
    )
    # held packages would make apt refuse the removal
    assert plan.unhold == ("libnvidia-compute-550", "nvidia-dkms-550", "nvidia-driver-550", "nvidia-kernel-common-550")
    assert "want nvidia-driver-580-open" in plan.summary


def test_fresh_box_installs():
    plan = plan_driver(OPEN_580, pkgs("fresh.txt"), None)
    assert plan.action == "install" and plan.remove == () and plan.unhold == ()


def test_newer_branch_satisfies_a_minimum():
    newer = [DebPackage("nvidia-driver-590-open", "590.44.01-0ubuntu1", "hold", "installed")]
    module = LoadedModule("590.44.01", "open", None)
    assert plan_driver(OPEN_580, newer, module).action == "none"


def test_flavour_or_source_change_reinstalls():
    installed = pkgs("580-open-held.txt")
    module = loaded("open-580.txt")
    assert plan_driver(DriverWant(580, "proprietary", "ubuntu"), installed, module).action == "install"
    assert plan_driver(DriverWant(580, "open", "cuda"), installed, module).action == "install"
    cuda = pkgs("cuda-580-open.txt")
    assert plan_driver(DriverWant(580, "open", "cuda"), cuda, module).action == "none"


def test_wanted_packages():
    assert wanted_packages(OPEN_580) == ("nvidia-driver-580-open",)
    assert wanted_packages(OPEN_580, ["linux-modules-nvidia-580-open-generic"]) == (
        "nvidia-driver-580-open",
        "linux-modules-nvidia-580-open-generic",
    )
    assert wanted_packages(DriverWant(580, "proprietary", "ubuntu")) == ("nvidia-driver-580",)
    assert wanted_packages(DriverWant(580, "open", "cuda")) == ("nvidia-open-580",)
    assert wanted_packages(DriverWant(580, "proprietary", "cuda")) == ("cuda-drivers-580",)


def test_unsigned_modules():
    assert needs_unsigned_modules(DriverWant(580, "open", "cuda"), prebuilt_available=True)
    assert needs_unsigned_modules(OPEN_580, prebuilt_available=False)
    assert not needs_unsigned_modules(OPEN_580, prebuilt_available=True)


def test_branch_packages_for_the_hold():
    names = branch_packages(pkgs("580-open-held.txt"), 580)
    assert names == (
        "libnvidia-cfg1-580",
        "libnvidia-compute-580",
        "nvidia-compute-utils-580",
        "nvidia-driver-580-open",
        "nvidia-firmware-580-580.95.05",
        "nvidia-kernel-common-580",
        "nvidia-utils-580",
    )  # not the toolkit, not the kernel-tracking linux-modules-nvidia packages


@pytest.mark.parametrize(
    "data,error",
    [
        ({"nvidia_driver_branch": "latest"}, "nvidia_driver_branch"),
        ({"nvidia_driver_flavour": "closed"}, "nvidia_driver_flavour"),
        ({"nvidia_driver_source": "ppa"}, "nvidia_driver_source"),
    ],
)
def test_want_from_bad_data(data, error):
    with pytest.raises(ValueError, match=error):
        DriverWant.from_data(data)


def test_branch_cuda():
    assert branch_cuda(580) == (13, 0)
    assert branch_cuda(581) == (13, 0)
    assert branch_cuda(550) == (12, 4)
    assert branch_cuda(470) is None


def test_never_policy_blocks_serving_until_converged():
    changed = lambda: False  # noqa: E731
    install = plan_driver(OPEN_580, pkgs("fresh.txt"), None)
    assert "REBOOT REQUIRED" in (HostDriverState(install, "never", changed).serving_blocked or "")
    assert HostDriverState(install, "auto", changed).serving_blocked is None
    done = plan_driver(OPEN_580, pkgs("580-open-held.txt"), loaded("open-580.txt"))
    assert HostDriverState(done, "never", changed).serving_blocked is None


def test_record_is_per_host():
    class H:  # stands in for pyinfra's Host (hashable, weak-referenceable)
        pass

    a, b = H(), H()
    plan = plan_driver(OPEN_580, pkgs("fresh.txt"), None)
    record(a, HostDriverState(plan, "never", lambda: True))
    assert serving_blocked(a) is not None and serving_blocked(b) is None
    assert driver_changed(a) is True and driver_changed(b) is False
