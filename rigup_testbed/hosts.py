"""Test-bed hosts: a copy-on-write root over the cached image, booted with systemd-nspawn.

Each host has its own overlayfs root (upper layer under the test bed's work dir), network namespace,
cgroup, time namespace (uptime restarts on reboot), SSH host key (pinned in the test bed's
known_hosts), machine id and simulated hardware (/etc/rigup-testbed/hardware.json). A supervisor
process started detached (rigup_testbed/supervisor.py) keeps it running across reboots.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rigup_testbed import hardware as hw
from rigup_testbed.image import Image
from rigup_testbed.net import Network, create_host_netns
from rigup_testbed.state import Ledger, TestbedError, cgroup_paths, is_same_process, make_cgroup, run, spawn

SUPERVISOR = Path(__file__).with_name("supervisor.py")
# A test's commands on a host share one SSH connection (OpenSSH's multiplexing, Host.ssh): a connection of its own
# costs ~0.11 s of the control machine's CPU and ~0.06 s of the rig's (20 sessions measured), and a suite opens
# about 1,100. The master closes itself MUX_PERSIST_S after its last session, or when the host goes down (its keepalives
# unanswered for 10 s); the bed's teardown closes it too.
MUX_PERSIST_S = 60
MUX_ERRORS = ("mux_client", "Control socket", "ControlSocket")  # the client's own words when the master is gone
_mux_locks: dict[str, threading.Lock] = {}
_mux_locks_guard = threading.Lock()


@dataclass(frozen=True)
class HostSpec:
    """What to create: a name, simulated hardware, and where it sits in the fleet file."""

    name: str
    hardware: str = "2x3090"  # preset name from rigup_testbed.hardware.PRESETS
    secure_boot: bool = False
    group: str = "rigs"
    data: Mapping[str, object] = field(default_factory=dict)  # extra host keys for the fleet file


@dataclass
class Host:
    name: str
    index: int
    ip: str
    netns: str
    machine: str
    dir: Path
    hardware: hw.Hardware
    ssh_user: str
    ssh_key: Path
    known_hosts: Path
    group: str = "rigs"
    data: Mapping[str, object] = field(default_factory=dict)

    @property
    def root(self) -> Path:
        """The host's / as seen from the control machine (the merged overlay)."""
        return self.dir / "root"

    @property
    def run_dir(self) -> Path:
        return self.dir / "run"

    @property
    def cgroup_rel(self) -> str:
        # netns is "<instance>-<name>"; the cgroup is rigup-testbed/<instance>/<name>.
        return f"{self.netns[: -len(self.name) - 1]}/{self.name}"

    def ssh_argv(self, *, connect_timeout: int = 5) -> list[str]:
        return [
            "ssh",
            "-F", "/dev/null",
            "-i", str(self.ssh_key),
            "-o", "IdentitiesOnly=yes",
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"ConnectTimeout={connect_timeout}",
            "-o", "LogLevel=ERROR",
            f"{self.ssh_user}@{self.ip}",
        ]  # fmt: skip

    @property
    def control_path(self) -> Path:
        """The socket of the host's shared SSH connection (in the bed's 0700 ssh directory)."""
        return self.ssh_key.parent / f"cm-{self.name}"

    def _mux_master(self) -> bool:
        """Open the host's shared connection unless it is open; False when it could not be opened (the host is
        down, say): the command then connects on its own, as it would without one."""
        with _mux_locks_guard:
            lock = _mux_locks.setdefault(str(self.control_path), threading.Lock())
        with lock:
            if self.control_path.exists():
                return True
            *options, target = self.ssh_argv()
            try:
                proc = subprocess.run(
                    [*options, "-M", "-N", "-f", "-o", f"ControlPath={self.control_path}",
                     "-o", f"ControlPersist={MUX_PERSIST_S}", "-o", "ServerAliveInterval=5",
                     "-o", "ServerAliveCountMax=2", target],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=20,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                return False
            return proc.returncode == 0 and self.control_path.exists()

    def close_ssh(self) -> None:
        """Close the host's shared connection, if open."""
        if self.control_path.exists():
            *options, target = self.ssh_argv()
            subprocess.run([*options, "-o", f"ControlPath={self.control_path}", "-O", "exit", target],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=10, check=False)

    def ssh(self, command: str, *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run `command` on the host as the SSH user (prefix `sudo` for root), over its shared connection."""
        *options, target = self.ssh_argv()
        proc = None
        if self._mux_master():
            shared = [*options, "-o", "ControlMaster=no", "-o", f"ControlPath={self.control_path}", target, command]
            proc = subprocess.run(shared, text=True, capture_output=True, timeout=timeout)
            if proc.returncode == 255 and any(word in proc.stderr for word in MUX_ERRORS):
                proc = None  # the master went away before the command reached it
        if proc is None:  # a connection of its own
            proc = subprocess.run([*options, target, command], text=True, capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise TestbedError(f"{self.name}: `{command}` failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def boots(self) -> int:
        """How many times the supervisor has started this host (1 + reboots)."""
        path = self.run_dir / "boots"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def nspawn_pid(self) -> int | None:
        path = self.run_dir / "nspawn.pid"
        try:
            pid, start = (int(x) for x in path.read_text().split())
        except (FileNotFoundError, ValueError):
            return None
        return pid if is_same_process(pid, start) else None

    def running(self) -> bool:
        return self.nspawn_pid() is not None

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "index": self.index,
            "ip": self.ip,
            "netns": self.netns,
            "machine": self.machine,
            "dir": str(self.dir),
            "hardware": self.hardware.to_dict(),
            "ssh_user": self.ssh_user,
            "ssh_key": str(self.ssh_key),
            "known_hosts": str(self.known_hosts),
            "group": self.group,
            "data": dict(self.data),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> Host:
        return cls(
            name=str(d["name"]),
            index=int(d["index"]),  # type: ignore[call-overload]
            ip=str(d["ip"]),
            netns=str(d["netns"]),
            machine=str(d["machine"]),
            dir=Path(str(d["dir"])),
            hardware=hw.from_dict(d["hardware"]),  # type: ignore[arg-type]
            ssh_user=str(d["ssh_user"]),
            ssh_key=Path(str(d["ssh_key"])),
            known_hosts=Path(str(d["known_hosts"])),
            group=str(d.get("group", "rigs")),
            data=dict(d.get("data", {})),  # type: ignore[call-overload]
        )


def _passwd_ids(root: Path, user: str) -> tuple[int, int]:
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3])
    raise TestbedError(f"user {user} missing from the image")


def _write(root: Path, path: str, content: str | bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    target.write_bytes(content)
    target.chmod(mode)
    if owner is not None:
        os.chown(target, *owner)


def create_host(
    ledger: Ledger,
    net: Network,
    image: Image,
    spec: HostSpec,
    index: int,
    workdir: Path,
    *,
    client_pubkey: str,
    known_hosts: Path,
    ssh_key: Path,
    extra_files: Mapping[str, str | bytes] | None = None,
    layer: Path | None = None,
) -> Host:
    """Lay out the host's root, network and identity (not started yet).

    `layer`: an overlay layer between the image and the host's own (image.ensure_layer: packages a
    freshly installed rig already has).
    """
    host_dir = workdir / "hosts" / spec.name
    if host_dir.exists():
        raise TestbedError(f"{host_dir} exists (left over from an earlier run? run teardown)")
    ledger.add("dir", path=str(host_dir))
    for sub in ("upper", "work", "root", "run", "docker"):  # docker: the rig's /var/lib/docker
        (host_dir / sub).mkdir(parents=True)
    ip = create_host_netns(ledger, net, spec.name, index)
    root = host_dir / "root"
    ledger.add("mount", target=str(root))
    lower = f"{layer}:{image.root}" if layer is not None else str(image.root)
    run([
        "mount", "-t", "overlay", "overlay",
        "-o", f"lowerdir={lower},upperdir={host_dir / 'upper'},workdir={host_dir / 'work'}",
        str(root),
    ])  # fmt: skip

    hardware = hw.preset(spec.hardware, spec.name, secure_boot=spec.secure_boot)
    user = image.spec.ssh_user
    uid_gid = _passwd_ids(root, user)
    _write(root, "/etc/hostname", f"{spec.name}\n")
    _write(root, "/etc/hosts", f"127.0.0.1 localhost\n127.0.1.1 {spec.name}\n{net.hub_ip} rigup-hub\n")
    # Offline on purpose: no nameserver, so a lookup fails at once instead of timing out.
    _write(root, "/etc/resolv.conf", "# rigup test bed: hosts have no DNS; the hub is rigup-hub in /etc/hosts\n")
    _write(root, "/etc/machine-id", secrets.token_hex(16) + "\n", 0o444)
    _write(root, hw.PATH_IN_HOST, hardware.to_json())
    # Like a rig with internet: containers may reach PyPI at start (a test can write {"network": false}).
    _write(root, "/etc/rigup-testbed/containers.json", '{"network": true}\n')
    _write(root, f"/home/{user}/.ssh/authorized_keys", client_pubkey.strip() + "\n", 0o600, uid_gid)
    # One host key per host, generated now; sshd loads only it, and the control side pins it.
    key = root / "etc/ssh/ssh_host_ed25519_key"
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{spec.name}", "-f", str(key)])
    _write(root, "/etc/ssh/sshd_config.d/20-rigup-testbed-hostkey.conf", "HostKey /etc/ssh/ssh_host_ed25519_key\n")
    # the tests' shared connection (Host.ssh) may carry more sessions at once than sshd's default 10
    _write(root, "/etc/ssh/sshd_config.d/21-rigup-testbed-sessions.conf", "MaxSessions 64\n")
    pub = (key.with_suffix(".pub")).read_text().split()
    with open(known_hosts, "a") as kh:
        kh.write(f"{ip} {pub[0]} {pub[1]}\n")
    for path, content in (extra_files or {}).items():
        _write(root, path, content)

    host = Host(
        name=spec.name,
        index=index,
        ip=ip,
        netns=net.host_netns(spec.name),
        machine=net.host_netns(spec.name),
        dir=host_dir,
        hardware=hardware,
        ssh_user=user,
        ssh_key=ssh_key,
        known_hosts=known_hosts,
        group=spec.group,
        data=dict(spec.data),
    )
    return host


# What a booted rig needs so that Docker's real engine runs in it under the rig's systemd (measured on
# this kernel, 6.18, with systemd-nspawn 252 on a hybrid cgroup host; each line below was missing once and
# dockerd or runc said so):
#   * cgroup v2 inside the rig (SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1): on a hybrid host nspawn mounts the v1
#     controllers read-only, where dockerd's cgroup driver cannot create a container's cgroup. On v2 the
#     rig's own cgroup subtree is writable and dockerd uses the systemd driver, as on Ubuntu 22.04/24.04.
#     The host binds no controllers to v2, so no memory/cpu/pids limits: `docker info` warns, nothing fails.
#   * /proc/sys/net writable (SYSTEMD_NSPAWN_API_VFS_WRITABLE=network) and CAP_NET_ADMIN: dockerd turns on
#     ip_forward and builds its bridge and NAT rules in the rig's own network namespace.
#   * the @keyring system calls and bpf allowed: runc gives each container a session keyring (nspawn's
#     filter answers EPERM, which runc does not tolerate) and cgroup v2 device rules are a BPF program.
#   * /var/lib/docker on the machine's own file system (a directory per host, bound in): overlay2 cannot
#     stack on the rig's overlayfs root ("failed to mount overlay: invalid argument").
NSPAWN_ENV = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1", "SYSTEMD_NSPAWN_API_VFS_WRITABLE": "network"}


def nspawn_args(host: Host) -> list[str]:
    return [
        "--boot",
        "--quiet",
        f"--directory={host.root}",
        f"--machine={host.machine}",
        f"--network-namespace-path=/run/netns/{host.netns}",
        # No systemd on the control machine to register with; run in the cgroup the supervisor made.
        "--register=no",
        "--keep-unit",
        "--console=read-only",
        "--link-journal=no",
        "--resolv-conf=off",
        "--timezone=off",
        # Docker's real engine in the rig (NSPAWN_ENV says why each is needed)
        f"--bind={host.dir / 'docker'}:/var/lib/docker",
        "--capability=CAP_NET_ADMIN",
        "--system-call-filter=@keyring bpf",
    ]


def start_host(ledger: Ledger, host: Host) -> None:
    """Start the host's supervisor (detached); it boots the host and boots it again after reboots."""
    # nspawn's per-machine runtime dir; it cannot always remove it itself (/run on disk here).
    ledger.add("dir", path=f"/run/systemd/nspawn/propagate/{host.machine}")
    make_cgroup(ledger, host.cgroup_rel)
    cmd = [
        sys.executable,
        str(SUPERVISOR),
        "--machine", host.machine,
        "--run-dir", str(host.run_dir),
        *[arg for cg in cgroup_paths(host.cgroup_rel) for arg in ("--cgroup", str(cg))],
        *[arg for item in NSPAWN_ENV.items() for arg in ("--nspawn-env", "=".join(item))],
        "--",
        *nspawn_args(host),
    ]  # fmt: skip
    # A clean poweroff of a booted host takes ~1 s; give it more before SIGKILL.
    spawn(ledger, f"supervisor:{host.name}", cmd, log=host.run_dir / "console.log", stop_timeout=20.0)


def wait_ready(hosts: list[Host], timeout: float = 120.0, allow_degraded: bool = False) -> dict[str, float]:
    """Wait until every host accepts SSH as the SSH user and systemd finished booting.

    Returns seconds to ready per host. Raises TestbedError naming the hosts that did not make it (and
    the failed units of a degraded one).
    """
    started = time.monotonic()
    results: dict[str, float] = {}
    errors: dict[str, str] = {}

    def one(host: Host) -> None:
        last = ""
        deadline = started + timeout
        while time.monotonic() < deadline:
            if not host.running() and host.boots() > 0 and (host.run_dir / "exit").exists():
                errors[host.name] = f"systemd-nspawn stopped; see {host.run_dir / 'console.log'}"
                return
            try:
                proc = subprocess.run(
                    [*host.ssh_argv(connect_timeout=2), "systemctl is-system-running --wait"],
                    text=True,
                    capture_output=True,
                    timeout=max(1.0, deadline - time.monotonic()),
                )
            except subprocess.TimeoutExpired:
                break
            state = proc.stdout.strip()
            if state == "running" or (state == "degraded" and allow_degraded):
                results[host.name] = time.monotonic() - started
                return
            if state == "degraded":
                failed = host.ssh("systemctl --failed --no-legend --plain", check=False).stdout.strip()
                errors[host.name] = f"booted degraded; failed units: {failed}"
                return
            last = (proc.stderr.strip() or state)[-300:]
            time.sleep(0.2)
        errors[host.name] = f"not ready after {timeout:.0f}s: {last}"

    threads = [threading.Thread(target=one, args=(h,), name=f"wait-{h.name}") for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise TestbedError("hosts not ready: " + "; ".join(f"{n}: {e}" for n, e in sorted(errors.items())))
    return results
