"""Facts about the host itself: OS release, Secure Boot, free disk, sizes of paths, a pending reboot
and the boot id (which changes on every boot)."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase, FactProcessError

from rigup.facts.util import ABSENT, parse_fact_output, tool_absent
from rigup.parsers.system import (
    CAPABILITY_TOOLS,
    Capabilities,
    DiskFree,
    OsInfo,
    PendingReboot,
    SecureBootState,
    parse_capabilities,
    parse_df_sections,
    parse_os_release,
    parse_reboot_required,
    parse_sb_state,
)


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
        if tool_absent(output):
            return None
        return parse_fact_output(output, parse_sb_state)


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
        return parse_fact_output(output, parse_df_sections)


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


class OsReleaseInfo(FactBase[OsInfo | None]):
    """``/etc/os-release``: id, version id, codename (``OsInfo(id="ubuntu", version_id="24.04", ...)``)."""

    command = "cat /etc/os-release"

    def process(self, output: list[str]) -> OsInfo | None:
        return parse_fact_output(output, parse_os_release)


class RebootPending(FactBase[PendingReboot]):
    """Ubuntu's reboot flag (``/var/run/reboot-required``) and the packages that asked for it."""

    default = staticmethod(lambda: PendingReboot(False, ()))
    command = (
        "if [ -f /var/run/reboot-required ]; then echo reboot-required; fi; "
        "if [ -f /var/run/reboot-required.pkgs ]; then sed 's/^/pkg /' /var/run/reboot-required.pkgs; fi; true"
    )

    def process(self, output: list[str]) -> PendingReboot:
        return parse_fact_output(output, parse_reboot_required)


class BootId(FactBase[str | None]):
    """The kernel's boot id; it changes on every boot (systemd-nspawn gives each container boot its own)."""

    command = "cat /proc/sys/kernel/random/boot_id"

    def process(self, output: list[str]) -> str | None:
        return output[0].strip() if output else None


class HostCapabilities(FactBase[Capabilities]):
    """
    What the host can run, read as the login user without sudo (``host.get_fact(HostCapabilities,
    _sudo=False)``), so that a host without sudo still answers: process 1, whether systemd runs, the
    user id, whether sudo works without a password, and which of systemctl, apt-get, dpkg and docker
    are installed.

    .. code:: python

        Capabilities(pid1="systemd", systemd_running=True, uid=1000, sudo="passwordless",
                     tools=("systemctl", "apt-get", "dpkg", "docker"))
    """

    command = (
        'echo "pid1=$(cat /proc/1/comm 2>/dev/null)"; '
        "if [ -d /run/systemd/system ]; then echo systemd=yes; else echo systemd=no; fi; "
        'echo "uid=$(id -u)"; '
        "if ! command -v sudo >/dev/null 2>&1; then echo sudo=absent; "
        "elif sudo -n true >/dev/null 2>&1; then echo sudo=passwordless; else echo sudo=password; fi; "
        "for t in " + " ".join(CAPABILITY_TOOLS) + "; do "
        'if command -v "$t" >/dev/null 2>&1; then echo "$t=yes"; else echo "$t=no"; fi; done'
    )

    def process(self, output: list[str]) -> Capabilities:
        return parse_fact_output(output, parse_capabilities)
