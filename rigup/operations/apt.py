"""apt operations: packages from the OS archive (the package lists refreshed only when one is missing), rigup's
signed third-party repositories (Docker's, NVIDIA's container toolkit and CUDA repositories), and the
disabling of other entries for them that would make apt refuse to work."""

from __future__ import annotations

import re
from io import StringIO
from typing import Any

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files

from rigup.facts.apt import AptSourceEntries
from rigup.parsers.apt import AptSource

# Files rigup owns for the third-party apt repositories (one place, used by several task files).
KEYRING_DIR = "/etc/apt/keyrings"
DOCKER_KEYRING = f"{KEYRING_DIR}/rigup-docker.asc"
DOCKER_LIST = "/etc/apt/sources.list.d/rigup-docker.list"
CTK_KEYRING = f"{KEYRING_DIR}/rigup-nvidia-container-toolkit.asc"
CTK_LIST = "/etc/apt/sources.list.d/rigup-nvidia-container-toolkit.list"
CUDA_KEYRING = f"{KEYRING_DIR}/rigup-cuda.asc"
CUDA_LIST = "/etc/apt/sources.list.d/rigup-cuda.list"
GRAFANA_KEYRING = f"{KEYRING_DIR}/rigup-grafana.asc"
GRAFANA_LIST = "/etc/apt/sources.list.d/rigup-grafana.list"


@operation()
def os_packages(packages: list[str], no_recommends: bool = False):
    """
    Install packages from the OS archive, refreshing apt's package lists first only when one of them is
    missing: a converged host sends no apt command at all, and a fresh one's lists may be older than the
    archive's current versions (an install from stale lists fails on a 404).

    + packages: the Debian package names
    + no_recommends: install without their recommended packages

    **Example:**

    .. code:: python

        os_packages(name="Install nftables", packages=["nftables"])
    """
    installed = host.get_fact(DebPackages) or {}
    if any(package not in installed for package in packages):
        yield from apt.update._inner()
    yield from apt.packages._inner(packages=packages, no_recommends=no_recommends)


def ctk_repo_uri(base_url: str) -> str:
    """NVIDIA's flat toolkit repository: apt expands $(ARCH) (amd64, arm64)."""
    return f"{base_url.rstrip('/')}/$(ARCH)"


# The CUDA repository names its architecture directories after NVIDIA's platforms, not Debian's
# (developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/{x86_64,sbsa}/).
CUDA_ARCH_DIRS = {"amd64": "x86_64", "arm64": "sbsa"}


def cuda_repo_uri(base_url: str, distro: str, arch: str) -> str:
    """NVIDIA's CUDA repository for one Ubuntu release ("ubuntu2404") and Debian architecture."""
    return f"{base_url.rstrip('/')}/{distro}/{CUDA_ARCH_DIRS.get(arch, arch)}/"


APT_ENV = "DEBIAN_FRONTEND=noninteractive"
APT_GET = (
    "apt-get",
    "-y",
    "-o",
    "Dpkg::Options::=--force-confdef",
    "-o",
    "Dpkg::Options::=--force-confold",
)


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

        apt.apt_source_exclusive(
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


@operation()
def signed_repository(
    key_url: str,
    keyring: str,
    source_list: str,
    uri: str,
    suite: str = "/",
    components: str = "",
    arch: str | None = None,
    exclusive_arch: str | None = None,
):
    """
    A signed apt repository: its signing key, one source entry that names the key, fresh package lists.

    + key_url: where the ASCII-armoured signing key is downloaded from (once; a present key is kept)
    + keyring: path of the key on the rig (under /etc/apt/keyrings)
    + source_list: the .list file holding the one entry
    + uri, suite, components: the entry, ``deb [arch=ARCH signed-by=KEYRING] URI SUITE COMPONENTS``
    + arch: restrict the entry to one architecture (None: every architecture the rig has)
    + exclusive_arch: also disable every other entry for ``uri`` on this architecture (apt refuses
      two entries for one repository with different Signed-By values)

    The package lists are updated only when the key, the entry or another entry for ``uri`` changed.

    **Example:**

    .. code:: python

        signed_repository(
            name="Add Docker's apt repository",
            key_url="https://download.docker.com/linux/ubuntu/gpg",
            keyring="/etc/apt/keyrings/rigup-docker.asc",
            source_list="/etc/apt/sources.list.d/rigup-docker.list",
            uri="https://download.docker.com/linux/ubuntu",
            suite="noble",
            components="stable",
            arch="amd64",
        )
    """
    options = " ".join(part for part in (f"arch={arch}" if arch else "", f"signed-by={keyring}") if part)
    entry = " ".join(part for part in ("deb", f"[{options}]", uri, suite, components) if part) + "\n"
    yield from files.directory._inner(path=KEYRING_DIR, mode="755")
    changes = [
        files.download._inner(src=key_url, dest=keyring, mode="644"),
        files.put._inner(src=StringIO(entry), dest=source_list, mode="644"),
    ]
    if exclusive_arch is not None:
        changes.append(apt_source_exclusive._inner(uri=uri, keep=source_list, arch=exclusive_arch))
    changed = False
    for commands in changes:
        for command in commands:
            changed = True
            yield command
    if changed:
        yield from apt.update._inner()
