"""Client side of the stand-in Docker engine: image references and RPC over /run/docker.sock.

The stand-in dockerd listens on the same unix socket as the real one (socket-activated by docker.socket,
group docker, mode 0660), so "daemon down" and "permission denied" look as they do with real Docker.
What travels over it is NOT Docker's Engine API: a small JSON RPC (POST /rpc/<method>) private to the
stand-ins (docker CLI, compose plugin).
"""

from __future__ import annotations

import json
import os
import socket

TYPE_CHECKING = False  # typing's own flag, without importing typing
if TYPE_CHECKING:
    from typing import Any

import common

DEFAULT_HOST = "unix:///var/run/docker.sock"


class DaemonDown(Exception):
    pass


class DaemonError(Exception):
    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


def socket_path() -> tuple[str, str]:
    """(path to connect to, address as the real CLI prints it)."""
    host = os.environ.get("DOCKER_HOST") or DEFAULT_HOST
    if not host.startswith("unix://"):
        raise DaemonDown(f"the rigup stand-in only speaks to unix sockets, not {host}")
    shown = host[len("unix://"):]
    return common.spath(shown) if not os.environ.get("DOCKER_HOST") else shown, host


def _exchange(path: str, timeout: float, request: bytes) -> bytes:
    """One HTTP/1.0 exchange over the unix socket: the daemon answers and closes (plain socket, not
    http.client: importing that costs a CLI call more than the call itself)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(request)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        s.close()


def rpc(method: str, timeout: float = 120.0, **params: Any) -> Any:
    path, host = socket_path()
    body = json.dumps(params).encode()
    request = (f"POST /rpc/{method} HTTP/1.0\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    try:
        raw = _exchange(path, timeout, request)
    except PermissionError:
        shown = host[len("unix://"):]
        raise DaemonDown(
            f"permission denied while trying to connect to the Docker daemon socket at {host}: "
            f'Get "http://%2Fvar%2Frun%2Fdocker.sock/v1.51/{method}": dial unix {shown}: connect: permission denied'
        ) from None
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError):
        raise DaemonDown(f"Cannot connect to the Docker daemon at {host}. Is the docker daemon running?") from None
    head, sep, payload = raw.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status_line) < 2 or not status_line[1].isdigit():
        # the daemon went away mid-answer (http.client's RemoteDisconnected)
        raise DaemonDown(f"Cannot connect to the Docker daemon at {host}. Is the docker daemon running?")
    status = int(status_line[1])
    data = json.loads(payload or b"null")
    if status >= 400:
        raise DaemonError(data.get("message", "error") if isinstance(data, dict) else str(data), status)
    return data


# --- image references ----------------------------------------------------------------------------


def parse_ref(ref: str) -> dict[str, str]:
    """Split an image reference like Docker's reference.ParseNormalizedNamed.

    Returns domain, path (with library/ for official images), tag (may be ""), digest (may be "").
    """
    name, _, digest = ref.partition("@")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        domain, path = first, rest
    else:
        domain, path = "docker.io", name
    if domain == "docker.io" and "/" not in path:
        path = "library/" + path
    if not digest and not tag:
        tag = "latest"
    return {"domain": domain, "path": path, "tag": tag, "digest": digest}


def familiar_name(parts: dict[str, str]) -> str:
    if parts["domain"] == "docker.io":
        return parts["path"][len("library/"):] if parts["path"].startswith("library/") else parts["path"]
    return f"{parts['domain']}/{parts['path']}"


def canonical(ref: str) -> str:
    p = parse_ref(ref)
    base = f"{p['domain']}/{p['path']}"
    return f"{base}@{p['digest']}" if p["digest"] else f"{base}:{p['tag']}"


def familiar(ref: str) -> str:
    p = parse_ref(ref)
    base = familiar_name(p)
    return f"{base}@{p['digest']}" if p["digest"] else f"{base}:{p['tag']}"


def fake_digest(ref: str) -> str:
    """The manifest digest the simulated registry serves for a tag (derived from the name)."""
    import hashlib  # here: only image references need it

    return "sha256:" + hashlib.sha256(f"rigup-standin-manifest:{canonical(ref)}".encode()).hexdigest()
