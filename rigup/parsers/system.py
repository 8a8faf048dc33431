"""Parsers for system files and small tools: /etc/os-release, /proc/driver/nvidia/version, mokutil,
df, /var/run/reboot-required and the /dev/char listing."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from rigup.parsers.common import JsonDataclass, ParseError, split_lines

Flavour = Literal["open", "proprietary"]


@dataclass(frozen=True)
class LoadedModule(JsonDataclass):
    version: str  # "580.95.05"
    flavour: Flavour
    gcc: str | None

    @property
    def branch(self) -> int:
        return int(self.version.split(".")[0])


_NVRM = re.compile(
    r"^NVRM version:\s+NVIDIA UNIX\s+(?:(?P<open>Open Kernel Module for \S+)|\S+ Kernel Module)\s+"
    r"(?P<version>\d+\.\d+(?:\.\d+)?)\b"
)


def parse_nvidia_version_file(output: str | Iterable[str]) -> LoadedModule | None:
    """Parse /proc/driver/nvidia/version; None when the file was empty (module not loaded)."""
    lines = [line for line in split_lines(output) if line.strip()]
    if not lines:
        return None
    match = _NVRM.match(lines[0].strip())
    if match is None:
        raise ParseError(f"not an NVRM version line: {lines[0]!r}")
    gcc = None
    for line in lines[1:]:
        if line.startswith("GCC version:"):
            gcc = line.split(":", 1)[1].strip()
    return LoadedModule(
        version=match.group("version"),
        flavour="open" if match.group("open") else "proprietary",
        gcc=gcc,
    )


SecureBootState = Literal["enabled", "disabled", "unsupported"]


def parse_sb_state(output: str | Iterable[str]) -> SecureBootState:
    """Parse `mokutil --sb-state` (stderr merged); ParseError when it says none of the known states."""
    text = "\n".join(split_lines(output)).lower()
    if "secureboot enabled" in text:
        return "enabled"
    if "secureboot disabled" in text:
        return "disabled"
    if "doesn't support secure boot" in text or "efi variables are not supported" in text or "not supported" in text:
        return "unsupported"
    raise ParseError(f"mokutil --sb-state: no known Secure Boot state in {text[:200]!r}")


@dataclass(frozen=True)
class DiskFree(JsonDataclass):
    path: str  # the path asked about
    existing: str  # the closest existing ancestor df was run on
    filesystem: str
    mount: str
    size_bytes: int
    avail_bytes: int

    @property
    def avail_gb(self) -> float:
        return self.avail_bytes / 1e9


def parse_df_sections(output: str | Iterable[str]) -> dict[str, DiskFree]:
    """Parse sections of `==> PATH EXISTING` followed by `df -Pk EXISTING` output."""
    out: dict[str, DiskFree] = {}
    path: str | None = None
    existing: str | None = None
    for line in split_lines(output):
        if line.startswith("==> "):
            parts = line[4:].split(" ", 1)
            if len(parts) != 2:
                raise ParseError(f"bad section header: {line!r}")
            path, existing = parts
            continue
        if not line.strip() or line.startswith("Filesystem"):
            continue
        if path is None or existing is None:
            raise ParseError(f"df output outside a section: {line!r}")
        cols = line.split()
        if len(cols) < 6:
            raise ParseError(f"not a df -P line: {line!r}")
        try:
            size_kib, avail_kib = int(cols[1]), int(cols[3])
        except ValueError as exc:
            raise ParseError(f"not a df -Pk line: {line!r}") from exc
        out[path] = DiskFree(
            path=path,
            existing=existing,
            filesystem=cols[0],
            mount=" ".join(cols[5:]),
            size_bytes=size_kib * 1024,
            avail_bytes=avail_kib * 1024,
        )
        path = existing = None
    return out


@dataclass(frozen=True)
class DevCharState(JsonDataclass):
    devices: dict[str, str]  # "/dev/nvidia0" -> "195:0"
    links: dict[str, str]  # "195:0" -> link target

    @property
    def missing(self) -> tuple[str, ...]:
        """Devices with no /dev/char/MAJOR:MINOR link pointing at them."""
        return tuple(
            sorted(dev for dev, num in self.devices.items() if self.links.get(num) != dev)
        )


def parse_dev_char(output: str | Iterable[str]) -> DevCharState:
    """Parse lines `dev HEXMAJOR HEXMINOR /dev/nvidiaX` and `link MAJOR:MINOR TARGET`."""
    devices: dict[str, str] = {}
    links: dict[str, str] = {}
    for line in split_lines(output):
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "dev" and len(parts) == 4:
            devices[parts[3]] = f"{int(parts[1], 16)}:{int(parts[2], 16)}"
        elif parts[0] == "link" and len(parts) == 3:
            links[parts[1]] = parts[2]
        else:
            raise ParseError(f"unexpected line: {line!r}")
    return DevCharState(devices=devices, links=links)


@dataclass(frozen=True)
class OsInfo(JsonDataclass):
    id: str  # "ubuntu"
    version_id: str  # "24.04"
    codename: str | None  # "noble"
    pretty_name: str | None

    @property
    def key(self) -> str:
        """The form preflight_os_allowed lists: "ubuntu 24.04"."""
        return f"{self.id} {self.version_id}"

    @property
    def cuda_repo_distro(self) -> str:
        """NVIDIA's CUDA repository directory name: "ubuntu2404", "debian12"."""
        return f"{self.id}{self.version_id.replace('.', '')}"


def parse_os_release(output: str | Iterable[str]) -> OsInfo:
    values: dict[str, str] = {}
    for line in split_lines(output):
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip().strip('"').strip("'")
    if "ID" not in values or "VERSION_ID" not in values:
        raise ParseError("os-release has no ID or VERSION_ID")
    codename = values.get("VERSION_CODENAME") or values.get("UBUNTU_CODENAME") or None
    return OsInfo(values["ID"].lower(), values["VERSION_ID"], codename, values.get("PRETTY_NAME"))


@dataclass(frozen=True)
class PendingReboot(JsonDataclass):
    required: bool
    packages: tuple[str, ...]


def parse_reboot_required(output: str | Iterable[str]) -> PendingReboot:
    """Parse `reboot-required` (the flag line) and `pkg <name>` lines from reboot-required.pkgs."""
    required = False
    packages: list[str] = []
    for line in split_lines(output):
        if line.strip() == "reboot-required":
            required = True
        elif line.startswith("pkg "):
            name = line[4:].strip()
            if name and name not in packages:
                packages.append(name)
        elif line.strip():
            raise ParseError(f"reboot-required: unexpected line {line!r}")
    return PendingReboot(required=required, packages=tuple(packages))


@dataclass(frozen=True)
class Capabilities(JsonDataclass):
    """What the host can run, read without sudo (rigup.facts.system.HostCapabilities)."""

    pid1: str  # the name of process 1 ("systemd" on a booted host)
    systemd_running: bool  # /run/systemd/system exists: systemd is the running init
    uid: int  # of the user pyinfra logs in as
    sudo: Literal["passwordless", "password", "absent"]  # sudo -n true, for a non-root user
    tools: tuple[str, ...]  # of systemctl, apt-get, dpkg, docker: those on PATH

    @property
    def root(self) -> bool:
        return self.uid == 0


CAPABILITY_TOOLS = ("systemctl", "apt-get", "dpkg", "docker")


def parse_capabilities(output: str | Iterable[str]) -> Capabilities:
    """Parse the key=value lines HostCapabilities prints (pid1, systemd, uid, sudo, one per tool)."""
    values: dict[str, str] = {}
    for line in split_lines(output):
        if not line.strip():
            continue
        key, sep, value = line.strip().partition("=")
        if not sep:
            raise ParseError(f"capabilities: not key=value: {line!r}")
        values[key] = value
    missing = [k for k in ("pid1", "systemd", "uid", "sudo", *CAPABILITY_TOOLS) if k not in values]
    if missing or not values["uid"].isdigit() or values["sudo"] not in ("passwordless", "password", "absent"):
        raise ParseError(f"capabilities: missing or bad {missing or ['uid/sudo']} in {values!r}")
    return Capabilities(
        pid1=values["pid1"],
        systemd_running=values["systemd"] == "yes",
        uid=int(values["uid"]),
        sudo=values["sudo"],  # type: ignore[arg-type]
        tools=tuple(t for t in CAPABILITY_TOOLS if values[t] == "yes"),
    )
