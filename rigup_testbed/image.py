"""Build and cache the Debian 12 root that every test-bed host boots from.

The root is built once with debootstrap from Debian's archive, prepared for nspawn (no host keys, no
machine id, a passwordless-sudo user, no apt sources: hosts are offline and get the hub's sources at
creation), packed as a tarball keyed by a hash of everything that shapes it, and kept extracted next to
it as the read-only lower layer of every host's overlayfs root.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rigup import DEPLOY_ROOT as REPO_ROOT  # noqa: F401 - where pyinfra runs the deploy (tests use it)

SUITE = "bookworm"
MIRROR = os.environ.get("RIGUP_TESTBED_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SSH_USER = "rigup"

# What a freshly installed server rig has that the deploy relies on (pyinfra needs sh/sudo; apt repos
# need gnupg + ca-certificates; sources need git; the hub is reached with curl).
PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "libpam-systemd",
    "openssh-server",
    "sudo",
    "git",
    "curl",
    "ca-certificates",
    "python3",
    # Not on a fresh Ubuntu server: rigup apt-installs it for the gateway venv, which the hosts' only apt
    # source (the stand-in archive) cannot serve; so the real Debian package is there already.
    "python3-venv",
    "gnupg",
    "iproute2",
    # On every Ubuntu server, and what Docker CE's engine depends on for its NAT and port publishing.
    "iptables",
    # Priority: important (Debian 12's nftables 1.0.6-2+deb12u2, as in Ubuntu), so on every server install;
    # debootstrap's minbase leaves such packages out. A cluster member's firewall is nftables rules.
    "nftables",
    "iputils-ping",
    "procps",
    "kmod",
    "less",
)

# Units that cannot work inside a container and would leave the system "degraded".
MASKED_UNITS: tuple[str, ...] = (
    "systemd-timesyncd.service",
    "apt-daily.timer",
    "apt-daily-upgrade.timer",
    "e2scrub_all.timer",
    "fstrim.timer",
    "getty@tty1.service",
)

# Bump when _prepare changes in a way that changes the root.
PREPARE_VERSION = 3


# Machine-wide, so a fresh clone (CI's) starts warm: every entry is named by a hash of what shaped it
# (image spec, package set, requirements, layer digest) and built under a lock, so checkouts share it.
MACHINE_CACHE = Path("/var/tmp/rigup-testbed/cache")
CA_STORE = "/usr/local/share/ca-certificates"  # where an Ubuntu/Debian admin puts a CA for update-ca-certificates
CA_FILE_NAME = "rigup-testbed-ca.crt"


def cache_dir() -> Path:
    """Where images, archives, mirrors and layers live: $RIGUP_TESTBED_CACHE, else MACHINE_CACHE."""
    env = os.environ.get("RIGUP_TESTBED_CACHE")
    return Path(env) if env else MACHINE_CACHE


@dataclass(frozen=True)
class ImageSpec:
    """Everything that shapes the root; its hash names the cached tarball."""

    suite: str = SUITE
    mirror: str = MIRROR
    packages: tuple[str, ...] = PACKAGES
    masked_units: tuple[str, ...] = MASKED_UNITS
    ssh_user: str = SSH_USER
    prepare_version: int = PREPARE_VERSION

    @property
    def key(self) -> str:
        blob = json.dumps(
            {
                "suite": self.suite,
                "mirror": self.mirror,
                "packages": sorted(self.packages),
                "masked": sorted(self.masked_units),
                "user": self.ssh_user,
                "prepare": self.prepare_version,
            },
            sort_keys=True,
        )
        return f"debian-{self.suite}-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Image:
    """A built image: the tarball and its extracted root (never written to once extracted)."""

    spec: ImageSpec
    tarball: Path
    root: Path
    timings: dict[str, float] = field(default_factory=dict)


def _compressor() -> tuple[str, list[str]]:
    # zstd unpacks several times faster than gzip, which matters on a 2-core machine.
    if shutil.which("zstd"):
        return ".tar.zst", ["--zstd"]
    return ".tar.gz", ["--gzip"]


def _chroot(root: Path, script: str) -> None:
    subprocess.run(
        ["chroot", str(root), "/bin/sh", "-eu", "-c", script],
        check=True,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"},
    )


def _prepare(root: Path, spec: ImageSpec) -> None:
    """Turn a debootstrapped tree into something every host can share."""
    user = spec.ssh_user
    _chroot(
        root,
        f"""
useradd --create-home --shell /bin/bash --groups sudo {user}
passwd --lock {user} >/dev/null
install -d -m 0700 -o {user} -g {user} /home/{user}/.ssh
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
""",
    )
    sudoers = root / "etc/sudoers.d" / f"90-{user}"
    sudoers.write_text(f"{user} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    sudoers.chmod(0o440)
    # Host keys and the machine id are per host (written when a host is created).
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/machine-id").write_text("")
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.exists() or dbus_id.is_symlink():
        dbus_id.unlink()
    # Hosts are offline: apt sources come from the hub when a host is created.
    (root / "etc/apt/sources.list").write_text("# test bed: sources are in sources.list.d (the hub)\n")
    (root / "etc/ssh/sshd_config.d/10-rigup-testbed.conf").write_text(
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUseDNS no\n"
    )
    for unit in spec.masked_units:
        link = root / "etc/systemd/system" / unit
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to("/dev/null")
    (root / "etc/rigup-testbed").mkdir(exist_ok=True)
    (root / "etc/rigup-testbed/image.json").write_text(json.dumps({"key": spec.key, "suite": spec.suite}) + "\n")


def _debootstrap(target: Path, spec: ImageSpec) -> None:
    subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            "--components=main",
            "--include=" + ",".join(spec.packages),
            spec.suite,
            str(target),
            spec.mirror,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _extract(tarball: Path, dest: Path, flags: list[str]) -> None:
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    subprocess.run(["tar", *flags, "--numeric-owner", "--xattrs", "-xpf", str(tarball), "-C", str(tmp)], check=True)
    tmp.rename(dest)


def ensure_image(spec: ImageSpec | None = None, cache: Path | None = None) -> Image:
    """Return the cached image for `spec`, building and/or extracting it when missing.

    Holds a lock on the cache so two runs never build the same image at once.
    """
    spec = spec or ImageSpec()
    base = (cache or cache_dir()) / "images"
    base.mkdir(parents=True, exist_ok=True)
    suffix, flags = _compressor()
    tarball = base / f"{spec.key}{suffix}"
    root = base / spec.key / "root"
    timings: dict[str, float] = {}
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not tarball.exists():
            started = time.monotonic()
            build = base / f"{spec.key}.build"
            if build.exists():
                shutil.rmtree(build)
            build.mkdir()
            try:
                _debootstrap(build, spec)
                timings["debootstrap_s"] = time.monotonic() - started
                _prepare(build, spec)
                packed = time.monotonic()
                partial = tarball.with_name(tarball.name + ".partial")
                subprocess.run(
                    ["tar", *flags, "--numeric-owner", "--xattrs", "-cpf", str(partial), "-C", str(build), "."],
                    check=True,
                )
                partial.rename(tarball)
                timings["pack_s"] = time.monotonic() - packed
                if not root.exists():
                    # The freshly built tree is the extracted image; no need to unpack it again.
                    root.parent.mkdir(exist_ok=True)
                    build.rename(root)
            finally:
                shutil.rmtree(build, ignore_errors=True)
        if not root.exists():
            started = time.monotonic()
            root.parent.mkdir(exist_ok=True)
            _extract(tarball, root, flags)
            timings["extract_s"] = time.monotonic() - started
    return Image(spec=spec, tarball=tarball, root=root, timings=timings)


def ensure_layer(image: Image, debs: list[Path], trusted_cas: Sequence[bytes] = ()) -> Path | None:
    """A cached overlay layer over `image` with `debs` installed by dpkg (what every host has before its
    first boot) and `trusted_cas` (PEM certificates) in its trust store as an Ubuntu box trusts a CA
    (/usr/local/share/ca-certificates/rigup-testbed-ca[-N].crt, then update-ca-certificates), or None when
    there is nothing to add. Hosts stack it between the image and their own upper layer, so installing
    costs once per package set and CA instead of once per host."""
    if not debs and not trusted_cas:
        return None
    digest = hashlib.sha256()
    for deb in sorted(debs, key=lambda d: d.name):
        digest.update(deb.name.encode() + b"\0" + hashlib.sha256(deb.read_bytes()).digest())
    for pem in trusted_cas:
        digest.update(b"ca\0" + hashlib.sha256(pem).digest())
    layer = image.root.parent / "layers" / digest.hexdigest()[:16]
    with open(image.root.parent.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if layer.exists():
            return layer
        build = layer.with_name(layer.name + ".build")
        if build.exists():
            _umount_quiet(build / "merged")
            shutil.rmtree(build)
        for sub in ("upper", "work", "merged"):
            (build / sub).mkdir(parents=True)
        merged = build / "merged"
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o",
             f"lowerdir={image.root},upperdir={build / 'upper'},workdir={build / 'work'}", str(merged)],
            check=True,
        )  # fmt: skip
        chroot_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive"}
        try:
            if debs:
                staging = merged / "var/cache/rigup-testbed-debs"
                staging.mkdir(parents=True)
                for deb in debs:
                    shutil.copyfile(deb, staging / deb.name)
                proc = subprocess.run(
                    ["chroot", str(merged), "dpkg", "--install", *[f"/var/cache/rigup-testbed-debs/{d.name}" for d in debs]],
                    text=True, capture_output=True, env=chroot_env,
                )  # fmt: skip
                shutil.rmtree(staging)
                if proc.returncode != 0:
                    raise RuntimeError(f"dpkg --install of {[d.name for d in debs]} failed: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
            if trusted_cas:
                store = merged / CA_STORE.lstrip("/")
                store.mkdir(parents=True, exist_ok=True)
                for i, pem in enumerate(trusted_cas):
                    (store / (CA_FILE_NAME if i == 0 else CA_FILE_NAME.replace(".crt", f"-{i}.crt"))).write_bytes(pem)
                proc = subprocess.run(["chroot", str(merged), "update-ca-certificates"], text=True, capture_output=True,
                                      env=chroot_env)
                if proc.returncode != 0:
                    raise RuntimeError(f"update-ca-certificates failed: {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        finally:
            subprocess.run(["umount", str(merged)], check=True)
        (build / "upper").rename(layer)
        shutil.rmtree(build)
        return layer


def _umount_quiet(path: Path) -> None:
    subprocess.run(["umount", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    t0 = time.monotonic()
    img = ensure_image()
    print(json.dumps({"tarball": str(img.tarball), "root": str(img.root), **img.timings,
                      "total_s": time.monotonic() - t0}, indent=1))
