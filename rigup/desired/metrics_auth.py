"""Who may read a rig's node_exporter: TLS from the fleet CA and bcrypt basic auth (exporter-toolkit's web config).

node_exporter (the OS package) reads a web config (Prometheus' exporter-toolkit, docs/web-configuration.md):
`tls_server_config` (its certificate and key, issued by the fleet CA for the rig's names: rigup.desired.fleet_ca)
and `basic_auth_users` (a user and the bcrypt hash of its password). The fleet's Prometheus scrapes it over
https with that user, its password read from a 0600 file of the prometheus user (`basic_auth.password_file`),
trusting the fleet CA (`tls_config.ca_file`). The password is made once on the control machine (or read from
metrics_password_file) and never leaves it but for that 0600 file; the hash is not secret, and is kept beside
the password so a re-run renders the same web config (bcrypt salts every hash anew).

The monitor's Prometheus and Alertmanager ask the same: their own web config (`--web.config.file`: Prometheus
from 2.24.0, whose CHANGELOG adds TLS and basic auth to its HTTP endpoints, Debian 12 ships 2.42 and Ubuntu 22.04
2.31; Alertmanager's cmd/alertmanager/main.go line 194 at v0.23.0 (61046b1) and line 208 at v0.25.0 (258fab7),
Ubuntu 22.04's and Debian 12's), with certificates of their own and the same user and hash. Whoever reads
Prometheus presents that login: Prometheus itself (its own job, and its alerts to Alertmanager), Grafana's
datasource, and on the control machine `rigup top` (prometheus_login: the password and the CA's certificate as
the converge left them there, nothing made).

The DCGM exporter asks the same: the pinned 4.5.3-4.8.2 hands `--web-config-file` to exporter-toolkit's
web.ListenAndServe (pkg/cmd/app.go line 232, internal/pkg/server/server.go line 202 at 691c927); its certificate,
key and web config are mounted read-only into its container at the paths the web config names.

The flag that names the web config: `--web.config.file` from node_exporter 1.5.0 (exporter-toolkit's
kingpinflag, node_exporter.go at v1.5.0; Debian 12's 1.5.0 and Ubuntu 24.04's 1.7.0), `--web.config` before
it (node_exporter.go line 166 at v1.3.1, what Ubuntu 22.04 ships).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import bcrypt
import yaml

from rigup.desired.fleet_ca import CA_CERT_NAME, FleetCA, ca_directory
from rigup.desired.knobs import knob
from rigup.desired.secrets import SecretError, read_secret_file

METRICS_USER = "rigup-prometheus"  # the user Prometheus presents to the exporters
WEB_DIR = "/etc/prometheus/rigup-web"  # on every host: the services' certificates, keys and web configs
CA_FILE = f"{WEB_DIR}/fleet-ca.crt"  # the fleet CA's certificate, what Prometheus trusts
PASSWORD_FILE = f"{WEB_DIR}/metrics.password"  # on the monitor host: 0600, prometheus
NODE_EXPORTER_SERVICE = "node-exporter"  # its certificate's name in the fleet CA
PROMETHEUS_SERVICE = "prometheus"  # the monitor's Prometheus: the same web config, the same login
ALERTMANAGER_SERVICE = "alertmanager"  # the monitor's Alertmanager (Prometheus sends it alerts with that login)
GPU_EXPORTER_SERVICE = "gpu-exporter"  # every rig's DCGM exporter (--web-config-file, the files mounted read-only)
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
        if not _hash_matches(password, kept):
            kept = ""
    except (OSError, ValueError):
        kept = ""
    if not kept:
        kept = bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()
        _private_write(hash_file, kept + "\n")
    return MetricsCredentials(METRICS_USER, password, kept)


@lru_cache(maxsize=16)
def _hash_matches(password: str, kept: str) -> bool:
    """bcrypt's check, once per run for a password and hash: it costs ~70 ms of CPU at BCRYPT_ROUNDS by design,
    and a converge asks for every host's web configs."""
    return bcrypt.checkpw(password.encode(), kept.encode())


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


@dataclass(frozen=True)
class PrometheusLogin:
    """What a reader of the fleet's Prometheus presents and trusts: the user, its password, the fleet CA's certificate."""

    user: str
    password: str = field(repr=False)
    ca_file: str  # a path on the control machine

    @property
    def auth(self) -> tuple[str, str]:
        return (self.user, self.password)


def prometheus_login(host_data: Mapping[str, Any], base_dir: Path | None = None) -> PrometheusLogin | str:
    """The login the control machine reads the fleet's Prometheus with, as converges left it (metrics_password_file
    or the password beside the CA, and the CA's certificate); nothing is made. A string: why there is none."""
    directory = ca_directory(host_data, base_dir)
    own_cert = knob(host_data, "fleet_ca_cert_file")
    cert = Path(str(own_cert)).expanduser() if own_cert is not None else directory / CA_CERT_NAME
    path = knob(host_data, "metrics_password_file")
    password_file = Path(str(path)).expanduser() if path is not None else directory / PASSWORD_NAME
    if not cert.is_file() or not password_file.is_file():
        missing = cert if not cert.is_file() else password_file
        return f"no {missing} on this machine (the converge that sets the monitor up makes it)"
    try:
        password = read_secret_file(password_file, f"the metrics password ({password_file})")
    except SecretError as exc:
        return str(exc)
    return PrometheusLogin(METRICS_USER, password, str(cert))
