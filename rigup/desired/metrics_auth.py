"""Who may read a rig's node_exporter: TLS from the fleet CA and bcrypt basic auth (exporter-toolkit's web config).

node_exporter (the OS package) reads a web config (Prometheus' exporter-toolkit, docs/web-configuration.md):
`tls_server_config` (its certificate and key, issued by the fleet CA for the rig's names: rigup.desired.fleet_ca)
and `basic_auth_users` (a user and the bcrypt hash of its password). The fleet's Prometheus scrapes it over
https with that user, its password read from a 0600 file of the prometheus user (`basic_auth.password_file`),
trusting the fleet CA (`tls_config.ca_file`). The password is made once on the control machine (or read from
metrics_password_file) and never leaves it but for that 0600 file; the hash is not secret, and is kept beside
the password so a re-run renders the same web config (bcrypt salts every hash anew).

The flag that names the web config: `--web.config.file` from node_exporter 1.5.0 (exporter-toolkit's
kingpinflag, node_exporter.go at v1.5.0; Debian 12's 1.5.0 and Ubuntu 24.04's 1.7.0), `--web.config` before
it (node_exporter.go line 166 at v1.3.1, what Ubuntu 22.04 ships).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import yaml

from rigup.desired.fleet_ca import FleetCA
from rigup.desired.knobs import knob
from rigup.desired.secrets import read_secret_file

METRICS_USER = "rigup-prometheus"  # the user Prometheus presents to the exporters
WEB_DIR = "/etc/prometheus/rigup-web"  # on every host: the services' certificates, keys and web configs
CA_FILE = f"{WEB_DIR}/fleet-ca.crt"  # the fleet CA's certificate, what Prometheus trusts
PASSWORD_FILE = f"{WEB_DIR}/metrics.password"  # on the monitor host: 0600, prometheus
NODE_EXPORTER_SERVICE = "node-exporter"  # its certificate's name in the fleet CA
PASSWORD_NAME, HASH_NAME = "metrics.password", "metrics.bcrypt"  # beside the CA when generated
BCRYPT_ROUNDS = 10  # exporter-toolkit checks the hash at every request: its docs advise a low cost


def web_file(service: str, suffix: str) -> str:
    """Where a service's certificate (crt), key (key) or web config (yml) is on its host."""
    return f"{WEB_DIR}/{service}.{suffix}"


def node_exporter_web_flag(os_id: str | None, version_id: str | None) -> str:
    """node_exporter's flag for its web config on this OS release (see the module's docstring)."""
    return "--web.config" if (os_id, version_id) == ("ubuntu", "22.04") else "--web.config.file"


def _private_write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


@dataclass(frozen=True)
class MetricsCredentials:
    """The user and password Prometheus presents, and the hash the exporters check."""

    user: str
    password: str = field(repr=False)
    password_hash: str


def metrics_credentials(host_data: Mapping[str, Any], ca: FleetCA) -> MetricsCredentials:
    """The password from metrics_password_file (0600), else one made once in the CA's directory (0600);
    its bcrypt hash as kept beside it while it still matches (else hashed again and kept)."""
    path = knob(host_data, "metrics_password_file")
    if path is not None:
        password, hash_file = read_secret_file(path, "metrics_password_file"), ca.directory / f"{Path(path).name}.bcrypt"
    else:
        password_file = ca.directory / PASSWORD_NAME
        if not password_file.exists():
            _private_write(password_file, secrets.token_urlsafe(32) + "\n")
        password, hash_file = read_secret_file(password_file, f"the metrics password ({password_file})"), ca.directory / HASH_NAME
    try:
        kept = hash_file.read_text().strip()
        if not bcrypt.checkpw(password.encode(), kept.encode()):
            kept = ""
    except (OSError, ValueError):
        kept = ""
    if not kept:
        kept = bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()
        _private_write(hash_file, kept + "\n")
    return MetricsCredentials(METRICS_USER, password, kept)


def web_config_text(service: str, credentials: MetricsCredentials) -> str:
    """The exporter-toolkit web config of `service` on its host: TLS with its fleet-CA certificate, basic auth."""
    document = {
        "tls_server_config": {"cert_file": web_file(service, "crt"), "key_file": web_file(service, "key")},
        "basic_auth_users": {credentials.user: credentials.password_hash},
    }
    header = f"# Written by rigup: {service} asks for TLS and basic auth (exporter-toolkit web config).\n"
    return header + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)


def scrape_auth() -> dict[str, Any]:
    """What a Prometheus scrape config adds to reach an exporter behind web_config_text: https, the user and
    the password from its 0600 file, the fleet CA."""
    return {
        "scheme": "https",
        "basic_auth": {"username": METRICS_USER, "password_file": PASSWORD_FILE},
        "tls_config": {"ca_file": CA_FILE},
    }
