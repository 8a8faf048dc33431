"""Facts about a GPU rig: GPUs, the loaded NVIDIA module, driver packages, Secure Boot, disk, Docker,
apt sources. Each fact runs one read-only command and hands its output to a parser in
rigup/parsers.py.

Tools that may be missing (nvidia-smi before the driver, lspci, mokutil, docker) are guarded in the
command itself: the fact then returns None instead of making pyinfra warn at execute time.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand

from rigup.parsers import (
    DPKG_QUERY_FORMAT,
    GPU_QUERY_FIELDS,
    AptPolicy,
    AptSource,
    DebPackage,
    DevCharState,
    DiskFree,
    DockerInfo,
    LoadedModule,
    OsInfo,
    ParseError,
    PciDevice,
    PendingReboot,
    SecureBootState,
    SmiQuery,
    _Jsonable,
    parse_apt_cache_policy,
    parse_apt_source_files,
    parse_dev_char,
    parse_df_sections,
    parse_daemon_json,
    parse_docker_info,
    parse_dpkg_query,
    parse_gpu_query,
    parse_lspci,
    parse_nvidia_version_file,
    parse_os_release,
    parse_reboot_required,
    parse_sb_state,
    NVIDIA_VENDOR_ID,
    DISPLAY_CLASSES,
)

ABSENT = "@rigup-absent"  # printed instead of output when the tool is not installed

T = TypeVar("T")


def _guarded(tool: str, command: str) -> str:
    """Run `command` if `tool` is on PATH, else print ABSENT; never fails."""
    return f"if command -v {tool} >/dev/null 2>&1; then {command}; else echo '{ABSENT}'; fi"


def _parse(output: list[str], parser: Callable[[list[str]], T]) -> T:
    try:
        return parser(output)
    except ParseError as exc:
        raise FactProcessError(str(exc)) from exc


def _absent(output: list[str]) -> bool:
    return [line.strip() for line in output if line.strip()] == [ABSENT]


class NvidiaGpus(FactBase[SmiQuery | None]):
    """
    GPUs as ``nvidia-smi --query-gpu`` reports them, or why it could not.

    .. code:: python

        SmiQuery(status="ok", gpus=(Gpu(index=0, name="NVIDIA GeForce RTX 3090",
                 compute_capability=(8, 6), memory_mib=24576, power_limit_w=230.0, ...), ...))
        SmiQuery(status="mismatch", message="Failed to initialize NVML: Driver/library version mismatch")
        None  # nvidia-smi is not installed
    """

    def command(self) -> str:
        query = ",".join(GPU_QUERY_FIELDS)
        # stderr is merged: the failure text (no driver, mismatch) is the information.
        return _guarded("nvidia-smi", f"nvidia-smi --query-gpu={query} --format=csv,noheader,nounits 2>&1 || true")

    def process(self, output: list[str]) -> SmiQuery | None:
        if _absent(output):
            return None
        return _parse(output, parse_gpu_query)


class PciGpus(FactBase[tuple[PciDevice, ...] | None]):
    """
    NVIDIA display devices from ``lspci -D -nn -k`` (works before any driver is loaded).

    .. code:: python

        (PciDevice(bus_id="0000:01:00.0", class_code="0300", vendor_id="10de", device_id="2204",
                   description="NVIDIA Corporation GA102 [GeForce RTX 3090]", driver_in_use="nouveau"),)
        None  # lspci (pciutils) is not installed
    """

    def command(self) -> str:
        return _guarded("lspci", "lspci -D -nn -k 2>/dev/null || true")

    def process(self, output: list[str]) -> tuple[PciDevice, ...] | None:
        if _absent(output):
            return None
        devices = _parse(output, parse_lspci)
        return tuple(d for d in devices if d.vendor_id == NVIDIA_VENDOR_ID and d.class_code in DISPLAY_CLASSES)


class NvidiaKernelModule(FactBase[LoadedModule | None]):
    """
    The loaded NVIDIA kernel module (``/proc/driver/nvidia/version``); None when none is loaded.

    .. code:: python

        LoadedModule(version="580.95.05", flavour="open", gcc="gcc version 13.3.0 (Ubuntu ...)")
    """

    command = "cat /proc/driver/nvidia/version 2>/dev/null || true"

    def process(self, output: list[str]) -> LoadedModule | None:
        return _parse(output, parse_nvidia_version_file)


# dpkg-query patterns for everything that belongs to an NVIDIA driver install.
DRIVER_PACKAGE_PATTERNS: tuple[str, ...] = (
    "nvidia-*",
    "libnvidia-*",
    "cuda-drivers*",
    "linux-modules-nvidia-*",
    "linux-objects-nvidia-*",
    "linux-signatures-nvidia-*",
    "xserver-xorg-video-nvidia-*",
)


class NvidiaPackages(FactBase[tuple[DebPackage, ...]]):
    """
    Driver-related packages dpkg knows, with version, selection (hold) and status.

    .. code:: python

        (DebPackage(name="nvidia-driver-580-open", version="580.95.05-0ubuntu1", want="hold",
                    status="installed"), ...)
    """

    default = tuple

    def command(self) -> StringCommand:
        return StringCommand(
            "dpkg-query",
            "-W",
            QuoteString(f"-f={DPKG_QUERY_FORMAT}"),
            *(QuoteString(p) for p in DRIVER_PACKAGE_PATTERNS),
            # dpkg-query exits 1 when one pattern matches nothing; that is not an error here.
            "2>/dev/null || true",
        )

    def process(self, output: list[str]) -> tuple[DebPackage, ...]:
        return _parse(output, parse_dpkg_query)


@dataclass(frozen=True)
class PrebuiltModules(_Jsonable):
    """Canonical-signed prebuilt module packages for one branch/flavour and the running kernel."""

    kernel: str  # uname -r
    abi_package: str  # linux-modules-nvidia-580-open-6.8.0-45-generic
    meta_packages: tuple[str, ...]  # linux-modules-nvidia-580-open-<installed kernel meta flavour>
    policy: dict[str, AptPolicy]

    @property
    def available(self) -> bool:
        """A signed module package exists for the running kernel."""
        pol = self.policy.get(self.abi_package)
        return pol is not None and (pol.candidate is not None or pol.installed is not None)

    @property
    def packages(self) -> tuple[str, ...]:
        """What to install with the driver so no DKMS build is needed (empty: none available).

        The kernel-flavour metapackage follows kernel upgrades; without one, the ABI package."""
        if not self.available:
            return ()
        metas = tuple(
            m for m in self.meta_packages if (p := self.policy.get(m)) is not None and p.candidate is not None
        )
        return metas or (self.abi_package,)


class PrebuiltNvidiaModules(FactBase[PrebuiltModules | None]):
    """
    Whether Ubuntu's archive has Canonical-signed prebuilt modules (``linux-modules-nvidia-*``) for
    a driver branch and the running kernel; those load with Secure Boot on, DKMS builds do not.

    + branch_flavour: "580-open" or "580"

    .. code:: python

        PrebuiltModules(kernel="6.8.0-45-generic",
                        abi_package="linux-modules-nvidia-580-open-6.8.0-45-generic",
                        meta_packages=("linux-modules-nvidia-580-open-generic",),
                        policy={"linux-modules-nvidia-580-open-6.8.0-45-generic":
                                AptPolicy(installed=None, candidate="6.8.0-45.45+1"), ...})
    """

    def command(self, branch_flavour: str) -> StringCommand:
        self.branch_flavour = branch_flavour
        prefix = f"linux-modules-nvidia-{branch_flavour}-"
        # Installed linux-image metapackages (generic, generic-hwe-24.04, ...) name the flavours
        # whose module metapackage follows kernel upgrades.
        script = (
            'k=$(uname -r); echo "kernel $k"; '
            "metas=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\\n' 'linux-image-*' 2>/dev/null "
            "| awk '$2 ~ /^.i/ {print $1}' | sed -n 's/^linux-image-//p' | grep -v '^[0-9]' || true); "
            'for m in $metas; do echo "meta $m"; done; '
            f'apt-cache policy "{prefix}$k" $(for m in $metas; do echo "{prefix}$m"; done) 2>/dev/null || true'
        )
        return StringCommand("sh", "-c", QuoteString(script))

    def process(self, output: list[str]) -> PrebuiltModules | None:
        kernel = None
        metas: list[str] = []
        rest: list[str] = []
        for line in output:
            if line.startswith("kernel "):
                kernel = line.split(" ", 1)[1].strip()
            elif line.startswith("meta "):
                metas.append(line.split(" ", 1)[1].strip())
            else:
                rest.append(line)
        if kernel is None:
            raise FactProcessError("no kernel release in output")
        prefix = f"linux-modules-nvidia-{self.branch_flavour}-"
        return PrebuiltModules(
            kernel=kernel,
            abi_package=prefix + kernel,
            meta_packages=tuple(prefix + m for m in metas),
            policy=_parse(rest, parse_apt_cache_policy),
        )


class AptPolicies(FactBase[dict[str, AptPolicy]]):
    """
    ``apt-cache policy`` for some packages: installed and candidate version of each; a package
    apt does not know (no list entry) is absent from the result.

    + packages: package names
    """

    default = dict

    def command(self, packages: list[str]) -> str:
        names = " ".join(shlex.quote(p) for p in packages)
        return f"apt-cache policy {names} 2>/dev/null || true"

    def process(self, output: list[str]) -> dict[str, AptPolicy]:
        return _parse(output, parse_apt_cache_policy)


class SecureBoot(FactBase[SecureBootState | None]):
    """
    Secure Boot state from ``mokutil --sb-state``: "enabled", "disabled" or "unsupported" (BIOS
    boot / no EFI variables); None when it cannot be told (no mokutil on an EFI system).
    """

    command = (
        "if command -v mokutil >/dev/null 2>&1; then mokutil --sb-state 2>&1 || true; "
        "elif [ ! -d /sys/firmware/efi ]; then echo 'This system doesn'\"'\"'t support Secure Boot'; "
        f"else echo '{ABSENT}'; fi"
    )

    def process(self, output: list[str]) -> SecureBootState | None:
        if _absent(output):
            return None
        return parse_sb_state(output)


class FreeDisk(FactBase[dict[str, DiskFree]]):
    """
    Free space on the filesystem that holds (or will hold) each path; a path that does not exist
    yet is measured at its closest existing parent.

    + paths: absolute paths on the rig

    .. code:: python

        {"/opt/rigup": DiskFree(path="/opt/rigup", existing="/opt", mount="/", avail_bytes=..., ...)}
    """

    default = dict

    def command(self, paths: list[str]) -> str:
        parts = []
        for path in paths:
            quoted = shlex.quote(path)
            parts.append(
                f'p={quoted}; while [ ! -e "$p" ]; do p=$(dirname "$p"); done; '
                f'printf \'==> %s %s\\n\' {quoted} "$p"; df -Pk "$p"'
            )
        return "; ".join(parts) if parts else "true"

    def process(self, output: list[str]) -> dict[str, DiskFree]:
        return _parse(output, parse_df_sections)


class PathSizes(FactBase[dict[str, int]]):
    """
    Bytes already on disk under each path (``du -sk``; 0 for a path that does not exist). Preflight
    subtracts them so a converged rig does not need room for its model twice.

    + paths: absolute paths on the rig
    """

    default = dict

    def command(self, paths: list[str]) -> str:
        parts = [
            f"if [ -e {shlex.quote(p)} ]; then du -sk {shlex.quote(p)}; else printf '0\\t%s\\n' {shlex.quote(p)}; fi"
            for p in paths
        ]
        return "; ".join(parts) if parts else "true"

    def process(self, output: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in output:
            size, sep, path = line.partition("\t")
            if not sep or not size.strip().isdigit():
                raise FactProcessError(f"not a du -sk line: {line!r}")
            out[path] = int(size) * 1024
        return out


class DockerImageSize(FactBase[int | None]):
    """
    Size in bytes of a local Docker image (``docker image inspect``); None when it is not pulled.

    + image: image reference as compose uses it
    """

    def command(self, image: str) -> str:
        ref = shlex.quote(image)
        return _guarded("docker", f"docker image inspect --format '{{{{.Size}}}}' {ref} 2>/dev/null || true")

    def process(self, output: list[str]) -> int | None:
        if _absent(output):
            return None
        text = output[0].strip() if output else ""
        return int(text) if text.isdigit() else None


class DockerEngineInfo(FactBase[DockerInfo | None]):
    """
    ``docker info`` as JSON: server version, runtimes (is ``nvidia`` there?), root dir, cgroup
    driver. None when the docker CLI is not installed; server_version None when the daemon is down.
    """

    command = _guarded("docker", "docker info --format '{{json .}}' 2>&1 || true")

    def process(self, output: list[str]) -> DockerInfo | None:
        if _absent(output):
            return None
        return _parse(output, parse_docker_info)


class DockerDaemonJson(FactBase[dict[str, Any] | None]):
    """/etc/docker/daemon.json as a dict; None when absent or empty (invalid JSON fails the host)."""

    command = "cat /etc/docker/daemon.json 2>/dev/null || true"

    def process(self, output: list[str]) -> dict[str, Any] | None:
        return _parse(output, parse_daemon_json)


class DockerSnap(FactBase[bool]):
    """True when Docker is installed as a snap (rigup refuses it: the toolkit cannot configure it)."""

    default = bool
    command = (
        "if command -v snap >/dev/null 2>&1 && snap list docker >/dev/null 2>&1; then echo snap; "
        "elif [ -e /snap/bin/docker ]; then echo snap; else echo none; fi"
    )

    def process(self, output: list[str]) -> bool:
        return any(line.strip() == "snap" for line in output)


class AptSourceEntries(FactBase[tuple[AptSource, ...]]):
    """
    Every apt source entry on the host, one-line (``*.list``, ``sources.list``) and deb822
    (``*.sources``), with its file, line, URIs, suites and options (``signed-by``...).
    """

    default = tuple
    command = (
        "for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; "
        'do if [ -f "$f" ]; then echo "==> $f"; cat "$f"; echo; fi; done'
    )

    def process(self, output: list[str]) -> tuple[AptSource, ...]:
        return _parse(output, parse_apt_source_files)


class OsReleaseInfo(FactBase[OsInfo | None]):
    """``/etc/os-release``: id, version id, codename (``OsInfo(id="ubuntu", version_id="24.04", ...)``)."""

    command = "cat /etc/os-release"

    def process(self, output: list[str]) -> OsInfo | None:
        return _parse(output, parse_os_release)


class RebootPending(FactBase[PendingReboot]):
    """Ubuntu's reboot flag (``/var/run/reboot-required``) and the packages that asked for it."""

    default = staticmethod(lambda: PendingReboot(False, ()))
    command = (
        "if [ -f /var/run/reboot-required ]; then echo reboot-required; fi; "
        "if [ -f /var/run/reboot-required.pkgs ]; then sed 's/^/pkg /' /var/run/reboot-required.pkgs; fi; true"
    )

    def process(self, output: list[str]) -> PendingReboot:
        return parse_reboot_required(output)


class NvidiaDevChar(FactBase[DevCharState]):
    """
    NVIDIA character devices and their ``/dev/char/MAJOR:MINOR`` links. Missing links are what makes
    containers lose their GPUs after ``systemctl daemon-reload`` (nvidia-container-toolkit#48).
    """

    default = staticmethod(lambda: DevCharState({}, {}))
    command = (
        'for f in /dev/nvidia*; do if [ -c "$f" ]; then echo "dev $(stat -c \'%t %T\' "$f") $f"; fi; done; '
        'for l in /dev/char/*; do if [ -L "$l" ]; then echo "link ${l##*/} $(readlink -f "$l")"; fi; done; true'
    )

    def process(self, output: list[str]) -> DevCharState:
        return _parse(output, parse_dev_char)


class BootId(FactBase[str | None]):
    """The kernel's boot id; it changes on every boot (systemd-nspawn gives each container boot its own)."""

    command = "cat /proc/sys/kernel/random/boot_id"

    def process(self, output: list[str]) -> str | None:
        return output[0].strip() if output else None


def summarize(values: Iterable[Any]) -> list[Any]:
    """Facts as JSON-able values (for `rigup doctor --json`)."""
    out: list[Any] = []
    for value in values:
        out.append(value.to_json() if isinstance(value, _Jsonable) else value)
    return out
