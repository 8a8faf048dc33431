"""Client side of the stand-in Docker engine: image references and RPC over /run/docker.sock.

The stand-in dockerd listens on the same unix socket as the real one (socket-activated by docker.socket,
group docker, mode 0660), so "daemon down" and "permission denied" look as they do with real Docker.
What travels over it is NOT Docker's Engine API: a small JSON RPC (POST /rpc/<method>) private to the
stand-ins (docker CLI, compose plugin).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
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
    return str(common.path(shown)) if not os.environ.get("DOCKER_HOST") else shown, host


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


def rpc(method: str, timeout: float = 120.0, **params: Any) -> Any:
    path, host = socket_path()
    conn = _UnixConnection(path, timeout)
    try:
        body = json.dumps(params).encode()
        conn.request("POST", f"/rpc/{method}", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"null")
    except PermissionError:
        shown = host[len("unix://"):]
        raise DaemonDown(
            f"permission denied while trying to connect to the Docker daemon socket at {host}: "
            f'Get "http://%2Fvar%2Frun%2Fdocker.sock/v1.51/{method}": dial unix {shown}: connect: permission denied'
        ) from None
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected):
        raise DaemonDown(f"Cannot connect to the Docker daemon at {host}. Is the docker daemon running?") from None
    finally:
        conn.close()
    if resp.status >= 400:
        raise DaemonError(data.get("message", "error") if isinstance(data, dict) else str(data), resp.status)
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
    return "sha256:" + hashlib.sha256(f"rigup-standin-manifest:{canonical(ref)}".encode()).hexdigest()
