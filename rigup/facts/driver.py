"""Facts about the NVIDIA driver: the loaded kernel module, the driver packages apt knows, Canonical's
prebuilt module packages, and the /dev/char links the container toolkit needs."""

from __future__ import annotations

from dataclasses import dataclass

from pyinfra.api import FactBase, FactProcessError, QuoteString, StringCommand

from rigup.facts.util import parse_fact_output
from rigup.parsers.apt import AptPolicy, parse_apt_cache_policy
from rigup.parsers.common import JsonDataclass
from rigup.parsers.dpkg import DPKG_QUERY_FORMAT, DebPackage, parse_dpkg_query
from rigup.parsers.system import DevCharState, LoadedModule, parse_dev_char, parse_nvidia_version_file


class NvidiaKernelModule(FactBase[LoadedModule | None]):
    """
    The loaded NVIDIA kernel module (``/proc/driver/nvidia/version``); None when none is loaded.

    .. code:: python

        LoadedModule(version="580.95.05", flavour="open", gcc="gcc version 13.3.0 (Ubuntu ...)")
    """

    command = "cat /proc/driver/nvidia/version 2>/dev/null || true"

    def process(self, output: list[str]) -> LoadedModule | None:
        return parse_fact_output(output, parse_nvidia_version_file)


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
        return parse_fact_output(output, parse_dpkg_query)


@dataclass(frozen=True)
class PrebuiltModules(JsonDataclass):
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
            policy=parse_fact_output(rest, parse_apt_cache_policy),
        )


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
        return parse_fact_output(output, parse_dev_char)

