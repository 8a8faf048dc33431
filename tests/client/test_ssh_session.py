"""rigup.client.ssh.SshSession.run: every byte a command wrote comes back, whatever order SSH
delivers the exit status, the output and end of file in."""

from __future__ import annotations

import select

import pytest

from rigup.client import ssh


class ScriptedChannel:
    """A paramiko channel whose events arrive one per poll, in a given order: ("out", bytes),
    ("err", bytes), ("exit", rc), ("eof", None)."""

    def __init__(self, events: list[tuple[str, object]]) -> None:
        self.events = list(events)
        self.out: list[bytes] = []
        self.err: list[bytes] = []
        self.status: int | None = None
        self.eof_received = False
        self.closed = False
        self.command = ""

    def _tick(self) -> None:
        if self.events:
            kind, value = self.events.pop(0)
            if kind == "out":
                self.out.append(value)  # type: ignore[arg-type]
            elif kind == "err":
                self.err.append(value)  # type: ignore[arg-type]
            elif kind == "exit":
                self.status = value  # type: ignore[assignment]
            else:
                self.eof_received = True

    def exec_command(self, command: str) -> None:
        self.command = command

    def sendall(self, data: bytes) -> None:
        pass

    def shutdown_write(self) -> None:
        pass

    def recv_ready(self) -> bool:
        return bool(self.out)

    def recv_stderr_ready(self) -> bool:
        return bool(self.err)

    def recv(self, n: int) -> bytes:
        return self.out.pop(0)

    def recv_stderr(self, n: int) -> bytes:
        return self.err.pop(0)

    def exit_status_ready(self) -> bool:
        self._tick()  # polled once per loop: the next event arrives
        return self.status is not None

    def recv_exit_status(self) -> int:
        assert self.status is not None
        return self.status

    def close(self) -> None:
        self.closed = True


class Transport:
    def __init__(self, channel: ScriptedChannel) -> None:
        self.channel = channel

    def is_active(self) -> bool:
        return True

    def open_session(self, timeout: float) -> ScriptedChannel:
        return self.channel


class Client:
    def __init__(self, channel: ScriptedChannel) -> None:
        self.transport = Transport(channel)

    def get_transport(self) -> Transport:
        return self.transport


@pytest.mark.parametrize("events", [
    [("out", b"a" * 10), ("exit", 3), ("out", b"b" * 10), ("err", b"late"), ("eof", None)],  # exit first
    [("out", b"a" * 10), ("out", b"b" * 10), ("err", b"late"), ("eof", None), ("exit", 3)],  # as usual
])
def test_run_returns_all_output_whatever_arrives_first(events, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(select, "select", lambda *a: ([], [], []))
    session = ssh.SshSession(ssh.SshSettings(hostname="rig", user="root"))
    channel = ScriptedChannel(events)
    session.client = Client(channel)  # type: ignore[assignment]
    result = session.run("cat big", timeout=5)
    assert result.stdout == "a" * 10 + "b" * 10 and result.stderr == "late"
    assert result.rc == 3 and channel.closed
