"""Plumbing shared by the hub's HTTP services (hubserve, hfhub, gitremotes): an HTTP server on a
background thread, over TLS when given a certificate and key (--tls-cert/--tls-key: the hub serves HTTPS
with the bed's CA, rigup_testbed/tls.py), and subprocess mode (ready file, SIGTERM/SIGINT, clean stop).

A service run as `python -m rigup_testbed.<module> ... --ready-file F` writes F (JSON with at least
"pid") once it serves, and removes it when it stops; rigup_testbed/hub.py waits for that file.
Standard library only.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


class ThreadingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that refuses the certificate (the failure tests make) or drops the connection mid-way
        is one line in the log, not a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ssl.SSLError, ConnectionError, TimeoutError)):
            sys.stderr.write(f"{client_address[0]} connection ended: {type(exc).__name__}: {exc}\n")
            return
        super().handle_error(request, client_address)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls-cert and --tls-key (paths; the key file is 0600): serve HTTPS with them."""
    parser.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, help="the certificate's key (PEM, a 0600 file)")


def tls_of(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """(certificate, key) from --tls-cert/--tls-key, None for plain HTTP; one without the other is an error."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("--tls-cert and --tls-key go together")
    return None if args.tls_cert is None else (args.tls_cert, args.tls_key)


class BackgroundServer:
    """`server_cls` bound to (bind, port) with the address family `bind` needs (IPv4 or IPv6); `start()`
    serves it on a daemon thread, `stop()` shuts it down and closes the socket. `port` is the bound one."""

    def __init__(
        self,
        bind: str,
        port: int,
        handler: Callable[..., http.server.BaseHTTPRequestHandler],
        name: str,
        server_cls: type[ThreadingServer] = ThreadingServer,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        bound_cls = type(name, (server_cls,), {"address_family": family})
        self.server = bound_cls((bind, port), handler)
        if tls is not None:
            from rigup_testbed.tls import server_context  # here: plain-HTTP users need no openssl wrapper

            # the handshake runs in the request's thread, on its first read: a client that never finishes
            # one holds that thread only, never the accept loop
            self.server.socket = server_context(*tls).wrap_socket(
                self.server.socket, server_side=True, do_handshake_on_connect=False)
        self.scheme = "https" if tls is not None else "http"
        self.port = int(self.server.server_address[1])
        self.name = name
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name=self.name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def write_ready(path: Path, info: Mapping[str, Any]) -> None:
    """The ready file, written whole (a reader never sees half of it); "pid" is this process."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}, indent=2))
    os.replace(tmp, path)


def run_service(
    ready_file: Path,
    start: Callable[[], tuple[Mapping[str, Any], Sequence[str]]],
    stop: Callable[[], None],
    failed: Callable[[], str | None] | None = None,
) -> int:
    """Subprocess mode: start() -> (ready info, lines for stdout); then serve until SIGTERM or SIGINT
    (exit 0) or until failed() returns a reason (printed on stderr, exit 1); stop() and remove the
    ready file either way."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    info, lines = start()
    write_ready(ready_file, info)
    for line in lines:
        print(line, flush=True)
    try:
        while not stopping.wait(0.5):
            reason = failed() if failed is not None else None
            if reason is not None:
                print(reason, file=sys.stderr, flush=True)
                return 1
    finally:
        stop()
        ready_file.unlink(missing_ok=True)
    return 0
