"""Parsers for dpkg-query, and the naming rules of NVIDIA's driver packages (branch, flavour, source)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from rigup.parsers.common import JsonDataclass, ParseError, split_lines
from rigup.parsers.system import Flavour


@dataclass(frozen=True)
class DebPackage(JsonDataclass):
    name: str
    version: str
    want: str  # dpkg selection: install, hold, deinstall, purge, unknown
    status: str  # dpkg status letter meaning: installed, not-installed, config-files, half-...

    @property
    def installed(self) -> bool:
        return self.status == "installed"

    @property
    def held(self) -> bool:
        return self.want == "hold"


_WANT = {"u": "unknown", "i": "install", "h": "hold", "r": "deinstall", "p": "purge"}
_STATUS = {
    "n": "not-installed",
    "i": "installed",
    "c": "config-files",
    "u": "unpacked",
    "f": "half-configured",
    "h": "half-installed",
    "w": "triggers-awaited",
    "t": "triggers-pending",
}


# The format the facts pass to `dpkg-query -W -f=`.
DPKG_QUERY_FORMAT = r"${binary:Package}\t${Version}\t${db:Status-Abbrev}\n"


def parse_dpkg_query(output: str | Iterable[str]) -> tuple[DebPackage, ...]:
    """Parse `dpkg-query -W -f='${binary:Package}\\t${Version}\\t${db:Status-Abbrev}\\n'`."""
    out: list[DebPackage] = []
    for line in split_lines(output):
        if not line.strip() or line.startswith("dpkg-query:"):
            continue  # "dpkg-query: no packages found matching X" on merged stderr
        parts = line.split("\t")
        if len(parts) != 3 or len(parts[2].strip()) < 2:
            raise ParseError(f"not a dpkg-query line: {line!r}")
        name = parts[0].split(":")[0]  # drop ":amd64"
        abbrev = parts[2].strip().lower()
        out.append(
            DebPackage(
                name=name,
                version=parts[1],
                want=_WANT.get(abbrev[0], "unknown"),
                status=_STATUS.get(abbrev[1], "unknown"),
            )
        )
    return tuple(out)


DriverSource = Literal["ubuntu", "cuda"]


@dataclass(frozen=True)
class DriverPackage(JsonDataclass):
    """A driver metapackage that is installed: it says which branch and flavour the box runs."""

    name: str  # nvidia-driver-580-open, nvidia-open-580, cuda-drivers-580, ...
    branch: int
    flavour: Flavour
    source: DriverSource  # which apt path installs this name (ubuntu archive or NVIDIA's CUDA repo)
    version: str  # upstream driver version, "580.95.05" (epoch and Debian revision dropped)
    held: bool


_META_PATTERNS: tuple[tuple[re.Pattern[str], DriverSource, Flavour | None], ...] = (
    (re.compile(r"^nvidia-driver-(?P<b>\d{3})(?:-server)?-open$"), "ubuntu", "open"),
    (re.compile(r"^nvidia-driver-(?P<b>\d{3})(?:-server)?$"), "ubuntu", "proprietary"),
    (re.compile(r"^nvidia-open-(?P<b>\d{3})$"), "cuda", "open"),
    (re.compile(r"^cuda-drivers-(?P<b>\d{3})$"), "cuda", "proprietary"),
    # 590+ CUDA-repo names carry no branch; it comes from the version.
    (re.compile(r"^nvidia-open$"), "cuda", "open"),
    (re.compile(r"^cuda-drivers$"), "cuda", "proprietary"),
)


def upstream_version(deb_version: str) -> str:
    """"580.95.05-0ubuntu1" -> "580.95.05"; "1:580.95.05-1" -> "580.95.05"."""
    version = deb_version.split(":", 1)[-1]
    return version.rsplit("-", 1)[0] if "-" in version else version


def driver_packages(packages: Iterable[DebPackage]) -> tuple[DriverPackage, ...]:
    """The installed driver metapackages among `packages`, newest branch first."""
    out: list[DriverPackage] = []
    for pkg in packages:
        if not pkg.installed:
            continue
        for pattern, source, flavour in _META_PATTERNS:
            match = pattern.match(pkg.name)
            if match is None:
                continue
            version = upstream_version(pkg.version)
            branch_text = match.groupdict().get("b") or version.split(".")[0]
            if not branch_text.isdigit():
                continue
            out.append(
                DriverPackage(
                    name=pkg.name,
                    branch=int(branch_text),
                    flavour=flavour or "proprietary",
                    source=source,
                    version=version,
                    held=pkg.held,
                )
            )
            break
    return tuple(sorted(out, key=lambda d: (-d.branch, d.name)))


# Package names that belong to one driver branch (userspace, kernel objects, prebuilt modules).
_BRANCH_PACKAGE = re.compile(
    r"^(?:nvidia-|libnvidia-|xserver-xorg-video-nvidia-|linux-modules-nvidia-|linux-objects-nvidia-|"
    r"linux-signatures-nvidia-|cuda-drivers-|nvidia-open-)"
    r".*?(?<![0-9])(?P<b>\d{3})(?![0-9])"
)


def package_branch(name: str) -> int | None:
    """Driver branch a package name belongs to ("libnvidia-compute-580" -> 580), or None."""
    match = _BRANCH_PACKAGE.match(name)
    return int(match.group("b")) if match else None

