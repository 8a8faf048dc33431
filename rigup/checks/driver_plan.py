"""The NVIDIA driver plan: wanted (branch, flavour, source) vs installed packages vs the loaded module."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from rigup.parsers.dpkg import DebPackage, DriverPackage, DriverSource, driver_packages, package_branch
from rigup.parsers.system import Flavour, LoadedModule

DRIVER_SOURCES: tuple[str, ...] = ("ubuntu", "cuda")


FLAVOURS: tuple[str, ...] = ("open", "proprietary")


# Highest CUDA version each driver branch supports (NVIDIA's CUDA toolkit release notes, table 3).
BRANCH_CUDA: dict[int, tuple[int, int]] = {
    535: (12, 2),
    545: (12, 3),
    550: (12, 4),
    555: (12, 5),
    560: (12, 6),
    565: (12, 7),
    570: (12, 8),
    575: (12, 9),
    580: (13, 0),
    590: (13, 1),
    595: (13, 2),
}


def branch_cuda(branch: int) -> tuple[int, int] | None:
    """CUDA version a driver branch supports: the entry for the highest listed branch <= branch."""
    known = [b for b in BRANCH_CUDA if b <= branch]
    return BRANCH_CUDA[max(known)] if known else None


@dataclass(frozen=True)
class DriverWant:
    branch: int  # minimum branch
    flavour: Flavour
    source: DriverSource

    @classmethod
    def from_data(cls, data: Any) -> DriverWant:
        """Read nvidia_driver_branch / _flavour / _source from host.data (or a mapping)."""
        get = data.get
        branch = get("nvidia_driver_branch", 580)
        flavour = get("nvidia_driver_flavour", "open")
        source = get("nvidia_driver_source", "ubuntu")
        if isinstance(branch, bool) or not isinstance(branch, (int, str)) or not str(branch).isdigit():
            raise ValueError(f"nvidia_driver_branch must be a number like 580, got {branch!r}")
        if flavour not in FLAVOURS:
            raise ValueError(f"nvidia_driver_flavour must be one of {FLAVOURS}, got {flavour!r}")
        if source not in DRIVER_SOURCES:
            raise ValueError(f"nvidia_driver_source must be one of {DRIVER_SOURCES}, got {source!r}")
        return cls(int(branch), flavour, source)

    @property
    def suffix(self) -> str:
        return "-open" if self.flavour == "open" else ""

    @property
    def branch_flavour(self) -> str:
        """"580-open" or "580": the infix of Ubuntu's package names."""
        return f"{self.branch}{self.suffix}"


def wanted_packages(want: DriverWant, prebuilt: Iterable[str] = ()) -> tuple[str, ...]:
    """The apt packages that install the wanted driver.

    + prebuilt: Canonical-signed module packages for the running kernel (ubuntu source only); when
      installed in the same transaction the driver needs no DKMS build
    """
    if want.source == "cuda":
        return (f"nvidia-open-{want.branch}",) if want.flavour == "open" else (f"cuda-drivers-{want.branch}",)
    return (f"nvidia-driver-{want.branch_flavour}", *prebuilt)


def needs_unsigned_modules(want: DriverWant, prebuilt_available: bool) -> bool:
    """True when installing `want` builds modules with DKMS (unsigned unless a MOK is enrolled)."""
    return want.source == "cuda" or not prebuilt_available


Action = Literal["none", "reboot", "install"]


@dataclass(frozen=True)
class DriverPlan:
    action: Action
    installed: DriverPackage | None  # the metapackage that satisfies `want` (or None)
    loaded: LoadedModule | None
    remove: tuple[str, ...]  # installed packages of other branches, removed in the install transaction
    unhold: tuple[str, ...]  # held packages that would block the install
    summary: str  # one line for humans (noop text, doctor, reports)

    @property
    def external(self) -> bool:
        """The loaded driver satisfies the wanted branch but no apt package installed it (runfile
        installer, or a driver the hypervisor/host provides): rigup neither installs over it nor holds it."""
        return self.action == "none" and self.installed is None


def _satisfies(d: DriverPackage, want: DriverWant) -> bool:
    return d.branch >= want.branch and d.flavour == want.flavour and d.source == want.source


def plan_driver(want: DriverWant, packages: Iterable[DebPackage], loaded: LoadedModule | None) -> DriverPlan:
    """Compare wanted branch, installed driver packages and the loaded module.

    none: a satisfying driver is installed and its module is the one loaded; or no driver package
      is installed at all and the loaded module is of a wanted branch and flavour (runfile or
      host-provided driver, see DriverPlan.external): apt-installing over it would break it.
    reboot: it is installed but the loaded module is missing or another version/flavour.
    install: no satisfying driver package is installed.
    """
    pkgs = tuple(packages)
    metas = driver_packages(pkgs)
    good = [d for d in metas if _satisfies(d, want)]
    loaded_text = "no module loaded" if loaded is None else f"loaded {loaded.version} ({loaded.flavour})"
    packaged = any(p.installed and package_branch(p.name) is not None for p in pkgs)
    if (
        not metas
        and not packaged
        and loaded is not None
        and loaded.branch >= want.branch
        and loaded.flavour == want.flavour
    ):
        return DriverPlan(
            "none",
            None,
            loaded,
            (),
            (),
            f"driver {loaded.version} ({loaded.flavour}) loaded, not installed by apt (runfile or host-provided): "
            f"satisfies branch >= {want.branch}; left as is (not reinstalled, not held)",
        )
    if good:
        best = good[0]
        if loaded is not None and loaded.version == best.version and loaded.flavour == best.flavour:
            return DriverPlan("none", best, loaded, (), (), f"{best.name} {best.version} installed and loaded")
        return DriverPlan(
            "reboot",
            best,
            loaded,
            (),
            (),
            f"{best.name} {best.version} installed but {loaded_text}: reboot required",
        )
    remove = tuple(
        sorted(p.name for p in pkgs if p.installed and (b := package_branch(p.name)) is not None and b != want.branch)
    )
    unhold = tuple(
        sorted(
            p.name
            for p in pkgs
            if p.held and p.installed and (b := package_branch(p.name)) is not None
        )
    )
    have = ", ".join(f"{d.name} {d.version}" for d in metas) or "no driver package"
    wanted = wanted_packages(want)[0]
    return DriverPlan(
        "install",
        None,
        loaded,
        remove,
        unhold,
        f"{have} installed, {loaded_text}; want {wanted} (branch >= {want.branch}, {want.flavour}, from {want.source})",
    )


def branch_packages(packages: Iterable[DebPackage], branch: int) -> tuple[str, ...]:
    """Installed userspace/DKMS packages of `branch`: what the hold covers.

    Canonical's prebuilt module packages (linux-modules-nvidia-*, linux-objects-*, linux-signatures-*)
    are left unheld: their versions follow the kernel, and holding them would let a kernel update
    boot without any NVIDIA module."""
    return tuple(
        sorted(
            p.name
            for p in packages
            if p.installed and not p.name.startswith("linux-") and package_branch(p.name) == branch
        )
    )

