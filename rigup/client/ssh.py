"""SSH from the control machine to a rig (the fleet file's settings), and the serving logs read over it."""

from __future__ import annotations

import getpass
import os
import re
import select
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import paramiko

from rigup.desired.knobs import knob
from rigup.desired.roles import LOCAL_HOST
from rigup.parsers.nvidia_smi import GPU_MEMORY_QUERY, parse_memory_used

SSH_CONNECT_TIMEOUT_S = 10.0


class RemoteError(RuntimeError):
    """A rig could not be reached or a command could not run; the message says which and why."""


@dataclass(frozen=True)
class SshSettings:
    hostname: str
    port: int = 22
    user: str | None = None
    key_file: str | None = None
    known_hosts_file: str | None = None
    strict_host_key_checking: str = "accept-new"  # yes | accept-new | no (pyinfra's values)
    config_file: str | None = None
    connect_retries: int = 0
    sudo: bool = True  # prefix root commands with `sudo -n` (the fleet's `_sudo`)

    @property
    def local(self) -> bool:
        """pyinfra's local connector (a host named @local): commands run here, without SSH."""
        return self.hostname == LOCAL_HOST

    @classmethod
    def from_data(cls, name: str, data: dict[str, Any]) -> SshSettings:
        return cls(
            hostname=str(data.get("ssh_hostname") or name),
            port=int(data.get("ssh_port") or 22),
            user=data.get("ssh_user"),
            key_file=data.get("ssh_key"),
            known_hosts_file=data.get("ssh_known_hosts_file"),
            strict_host_key_checking=str(data.get("ssh_strict_host_key_checking") or "accept-new"),
            config_file=data.get("ssh_config_file"),
            connect_retries=int(data.get("ssh_connect_retries") or 0),
            sudo=bool(knob(data, "_sudo")),
        )


@dataclass(frozen=True)
class CommandResult:
    rc: int
    stdout: str
    stderr: str


class Runner(Protocol):
    """Runs a shell command on a rig (SshSession, or a fake in tests)."""

    def run(self, command: str, *, sudo: bool = False, timeout: float = 30.0, stdin: bytes | None = None) -> CommandResult: ...


class LocalSession:
    """The machine rigup runs on (a fleet host named @local), as a Runner: sh here, sudo -n for root
    commands unless this user is root or _sudo is false."""

    def __init__(self, settings: SshSettings) -> None:
        self.settings = settings

    def connect(self) -> None:
        pass

    def close(self) -> None:
        pass

    def run(self, command: str, *, sudo: bool = False, timeout: float = 30.0, stdin: bytes | None = None) -> CommandResult:
        argv = ["sh", "-c", command]
        if sudo and self.settings.sudo and os.geteuid() != 0:
            argv = ["sudo", "-n", "--", *argv]
        try:
            done = subprocess.run(argv, input=stdin or b"", capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise RemoteError(f"{LOCAL_HOST}: command timed out after {timeout:g} s") from None
        except OSError as exc:
            raise RemoteError(f"{LOCAL_HOST}: {exc}") from None
        return CommandResult(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


class SshSession:
    """One SSH connection to a rig for running read-only commands. Use as a context manager."""

    def __init__(self, settings: SshSettings, timeout: float = SSH_CONNECT_TIMEOUT_S) -> None:
        self.settings = settings
        self.timeout = timeout
        self.client: paramiko.SSHClient | None = None
        self.user = settings.user

    def __enter__(self) -> SshSession:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> None:
        s = self.settings
        hostname, port, user, key_file = s.hostname, s.port, s.user, s.key_file
        known_hosts, strict = s.known_hosts_file, s.strict_host_key_checking
        if s.config_file:
            config = paramiko.SSHConfig.from_path(os.path.expanduser(s.config_file)).lookup(hostname)
            hostname = config.get("hostname", hostname)
            port = int(config.get("port", port)) if s.port == 22 else port
            user = user or config.get("user")
            if key_file is None and config.get("identityfile"):
                key_file = config["identityfile"][0]
            known_hosts = known_hosts or (config.get("userknownhostsfile") or "").split(" ")[0] or None
            strict = config.get("stricthostkeychecking", strict) if s.strict_host_key_checking == "accept-new" else strict
        self.user = user or getpass.getuser()
        client = paramiko.SSHClient()
        if str(strict).lower() not in ("no", "off", "false"):
            if known_hosts:
                client.load_host_keys(os.path.expanduser(known_hosts))
            else:
                client.load_system_host_keys()
        if str(strict).lower() in ("yes", "true", "on"):
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
        else:
            # accept-new: trust a host seen for the first time (not written back: these tools only
            # read); a changed key of a known host still fails (paramiko's BadHostKeyException).
            client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        attempts = max(1, s.connect_retries + 1)
        for attempt in range(attempts):
            try:
                client.connect(
                    hostname,
                    port=port,
                    username=self.user,
                    key_filename=os.path.expanduser(key_file) if key_file else None,
                    timeout=self.timeout,
                    banner_timeout=self.timeout,
                    auth_timeout=self.timeout,
                )
                self.client = client
                return
            except (paramiko.SSHException, OSError, socket.timeout) as exc:
                if attempt + 1 == attempts or isinstance(exc, paramiko.BadHostKeyException):
                    client.close()
                    raise RemoteError(f"ssh {self.user}@{hostname}:{port}: {_ssh_reason(exc)}") from None
                time.sleep(1.0)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def run(self, command: str, *, sudo: bool = False, timeout: float = 30.0, stdin: bytes | None = None) -> CommandResult:
        """Run `command` with sh; `sudo` runs it as root (sudo -n unless the SSH user is root)."""
        if self.client is None:
            raise RemoteError("not connected")
        if sudo and self.settings.sudo and self.user != "root":
            command = f"sudo -n -- sh -c {shlex.quote(command)}"
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise RemoteError(f"ssh {self.settings.hostname}: connection closed")
        channel = transport.open_session(timeout=self.timeout)
        try:
            channel.exec_command(command)
            if stdin is not None:
                channel.sendall(stdin)
            channel.shutdown_write()
            out: list[bytes] = []
            err: list[bytes] = []
            deadline = time.monotonic() + timeout
            while True:
                progressed = False
                while channel.recv_ready():
                    out.append(channel.recv(65536))
                    progressed = True
                while channel.recv_stderr_ready():
                    err.append(channel.recv_stderr(65536))
                    progressed = True
                # The exit status can arrive before the last output (sshd reports the exit as the
                # process ends, with output still queued behind the window): done at end of file.
                done = channel.exit_status_ready() and (channel.eof_received or channel.closed)
                if done and not channel.recv_ready() and not channel.recv_stderr_ready():
                    break
                if time.monotonic() > deadline:
                    raise RemoteError(f"ssh {self.settings.hostname}: {command.split()[0]} timed out after {timeout:g} s")
                if not progressed:
                    select.select([channel], [], [], 0.05)
            rc = channel.recv_exit_status()
        finally:
            channel.close()
        return CommandResult(rc, b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace"))


def _ssh_reason(exc: BaseException) -> str:
    if isinstance(exc, paramiko.BadHostKeyException):
        return "host key differs from the known one (refusing to connect)"
    if isinstance(exc, paramiko.AuthenticationException):
        return "authentication failed"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        # paramiko wraps the errors of every address it tried
        reasons = {_ssh_reason(error) for error in exc.errors.values()}
        return ", ".join(sorted(reasons))
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        return "host key unknown and ssh_strict_host_key_checking is yes"
    return str(exc) or type(exc).__name__


class LazySsh:
    """An SSH session opened on first use and kept for the rest of a host's work.

    A rig that cannot be reached is tried once: later calls raise the same RemoteError at once, so
    the checks that need the rig skip quickly instead of each waiting for a timeout.
    """

    def __init__(self, settings: SshSettings | None) -> None:
        self.settings = settings
        self.session: SshSession | LocalSession | None = None
        self.failure: RemoteError | None = None

    def run(self, command: str, *, sudo: bool = False, timeout: float = 30.0, stdin: bytes | None = None) -> CommandResult:
        if self.settings is None:
            raise RemoteError("no SSH settings for this target")
        if self.failure is not None:
            raise self.failure
        if self.session is None:
            session = LocalSession(self.settings) if self.settings.local else SshSession(self.settings)
            try:
                session.connect()
            except RemoteError as exc:
                self.failure = exc
                raise
            self.session = session
        return self.session.run(command, sudo=sudo, timeout=timeout, stdin=stdin)

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


class ServiceLog(Protocol):
    """The serving log of a rig: vLLM's own lines (SpecDecoding metrics, patch markers)."""

    def tail(self, lines: int) -> list[str]:
        """The last `lines` lines. Raises RemoteError when the log cannot be read."""
        ...

    def grep(self, pattern: str, lines: int) -> list[str]:
        """The last `lines` lines since the service started that match the extended regex."""
        ...


class JournalLog:
    """journalctl of rigup-<variant>.service on the rig: the unit runs compose in the foreground, so
    the container's output is in the unit's journal."""

    def __init__(self, runner: Runner, unit: str) -> None:
        self.runner = runner
        self.unit = unit

    def _journal(self, command: str) -> list[str]:
        result = self.runner.run(command, sudo=True, timeout=60)
        if result.rc != 0:
            raise RemoteError(f"journalctl -u {self.unit}: {result.stderr.strip() or f'exit {result.rc}'}")
        return result.stdout.splitlines()

    def tail(self, lines: int) -> list[str]:
        unit = shlex.quote(self.unit)
        return self._journal(f"journalctl -u {unit} -n {int(lines)} --no-pager -o cat")

    def grep(self, pattern: str, lines: int) -> list[str]:
        # Only the current run of the unit (its invocation id), so markers of an earlier start
        # cannot pass or fail today's check; `|| true`: no match is not an error.
        unit = shlex.quote(self.unit)
        command = (
            f"inv=$(systemctl show -p InvocationID --value {unit}); "
            f'if [ -n "$inv" ]; then journalctl _SYSTEMD_INVOCATION_ID="$inv" --no-pager -o cat; '
            f"else journalctl -u {unit} -b --no-pager -o cat; fi "
            f"| {{ grep -E -- {shlex.quote(pattern)} || true; }} | tail -n {int(lines)}"
        )
        return self._journal(command)


class FileLog:
    """A log file on the control machine (a local server's log, e.g. the test responder's)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _lines(self) -> list[str]:
        try:
            return self.path.read_text(errors="replace").splitlines()
        except OSError as exc:
            raise RemoteError(f"cannot read {self.path}: {exc.strerror or exc}") from None

    def tail(self, lines: int) -> list[str]:
        return self._lines()[-lines:]

    def grep(self, pattern: str, lines: int) -> list[str]:
        regex = re.compile(pattern)
        return [line for line in self._lines() if regex.search(line)][-lines:]


def gpu_memory(runner: Runner) -> list[tuple[int, int]]:
    """(used MiB, total MiB) per GPU, from nvidia-smi on the rig. Raises RemoteError."""
    result = runner.run(GPU_MEMORY_QUERY, timeout=30)
    if result.rc != 0:
        raise RemoteError(f"nvidia-smi: {(result.stdout + result.stderr).strip()[:200] or f'exit {result.rc}'}")
    rows = parse_memory_used(result.stdout)
    if not rows:
        raise RemoteError(f"nvidia-smi printed no GPU rows: {result.stdout.strip()[:200]!r}")
    return rows

