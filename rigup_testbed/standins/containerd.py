#!/usr/bin/python3
"""Stand-in for containerd (package containerd.io), run by containerd.service (Type=notify).

The stand-in dockerd runs its "containers" itself, so this only has to be there like the real one:
a service that starts, listens on /run/containerd/containerd.sock and answers --version.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path

import common

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    meta = common.read_json(HERE / "version.json", {}) or {}
    if argv[:1] in (["--version"], ["-v"]):
        print(f"containerd containerd.io {meta.get('version', '1.7.28')} {meta.get('commit', '')}")
        return 0
    sock_path = common.path("/run/containerd/containerd.sock")
    sock_path.parent.mkdir(parents=True, exist_ok=True)
    if sock_path.exists():
        sock_path.unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock_path))
    os.chmod(sock_path, 0o660)
    s.listen(16)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    addr = os.environ.get("NOTIFY_SOCKET")
    if addr:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as n:
            n.connect("\0" + addr[1:] if addr.startswith("@") else addr)
            n.sendall(b"READY=1")
    print(f"containerd successfully booted (rigup stand-in {meta.get('version', '')})", file=sys.stderr)
    stop.wait()
    s.close()
    sock_path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
