"""TLS for the unit tests' fake servers: certificates from real fleet CAs (rigup.desired.fleet_ca with the real
openssl), so a client's verification is checked against what the converge issues, and a second CA for the
client that must be refused."""

from __future__ import annotations

import socketserver
import ssl
from dataclasses import dataclass
from pathlib import Path

from rigup.desired.fleet_ca import ensure_ca, host_sans, issue
from rigup.desired.knobs import load_defaults


@dataclass(frozen=True)
class ServerCert:
    ca_cert: Path  # what a client trusts
    cert: Path
    key: Path


def fleet_certificate(directory: Path, host: str = "gw-1", service: str = "entrance") -> ServerCert:
    """A fleet CA in `directory` and the certificate it issues `service` on `host` for 127.0.0.1 and localhost
    (host_sans of a host reached at 127.0.0.1), as the converge does for the entrance."""
    data = {**load_defaults(), "fleet_ca_dir": str(directory)}
    ca = ensure_ca(data)
    issued = issue(ca, host, service, host_sans(host, {"ssh_hostname": "127.0.0.1", **data}), days=30, renew_days=1)
    return ServerCert(ca.cert, issued.cert, issued.key)


def serve_tls(server: socketserver.TCPServer, cert: ServerCert) -> None:
    """Make `server` (not serving yet) speak TLS with `cert`, as the entrance's nginx does (TLS 1.2 and 1.3)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert.cert, cert.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
