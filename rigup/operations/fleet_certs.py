"""A fleet service's certificate, key and web config on its host, issued by the fleet CA while the deploy is planned.

The control machine's fleet CA (rigup.desired.fleet_ca) issues, or reuses, the certificate of `service` on the
host for the host's names; its key reaches the host only on a command's stdin into a 0600 file of the user the
service runs as (rigup.operations.serving.secret_file), never on a command line or in pyinfra's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from io import StringIO
from typing import Any

from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import files

from rigup.desired.fleet_ca import FleetCA, FleetCAError, Issued, ensure_ca, host_sans, issue
from rigup.desired.knobs import knob
from rigup.desired.metrics_auth import WEB_DIR, MetricsCredentials, metrics_credentials, web_config_text, web_file
from rigup.desired.secrets import SecretError
from rigup.operations.planning_errors import stop_the_run_on
from rigup.operations.serving import secret_file


def fleet_ca_of(host: Any) -> tuple[FleetCA, MetricsCredentials]:
    """The fleet CA and the metrics credentials, or the run stops with one line naming the host."""
    with stop_the_run_on(host, FleetCAError, SecretError):
        ca = ensure_ca(host.data)
        return ca, metrics_credentials(host.data, ca)


def issued_certificate(host: Any, service: str, sans: Sequence[str]) -> tuple[FleetCA, Issued]:
    """The fleet CA and `service`'s certificate on the host for `sans`, issued now or reused (renewed as every
    certificate the CA issues: fleet_cert_days, fleet_cert_renew_days), or the run stops with one line naming the host."""
    with stop_the_run_on(host, FleetCAError, SecretError):
        ca = ensure_ca(host.data)
        return ca, issue(ca, host.name, service, list(sans), days=int(knob(host.data, "fleet_cert_days")),
                         renew_days=float(knob(host.data, "fleet_cert_renew_days")))


def service_web_files(host: Any, ca: FleetCA, credentials: MetricsCredentials, service: str, owner: str) -> list[str]:
    """Write `service`'s certificate (0644), key and exporter-toolkit web config (0600, `owner`) under WEB_DIR,
    with the fleet CA's certificate beside them; the paths written (what the service's unit runs from)."""
    with stop_the_run_on(host, FleetCAError):
        issued = issue(ca, host.name, service, host_sans(host.name, host.data),
                       days=int(knob(host.data, "fleet_cert_days")), renew_days=float(knob(host.data, "fleet_cert_renew_days")))
    files.directory(name="Create the directory of the fleet's certificates", path=WEB_DIR, mode="755")
    files.put(name="Write the fleet CA's certificate", src=StringIO(ca.cert_pem), dest=web_file("fleet-ca", "crt"), mode="644")
    files.put(name=f"Write {service}'s certificate (fleet CA)", src=StringIO(issued.cert.read_text()),
              dest=web_file(service, "crt"), mode="644")
    secret_file(name=f"Write {service}'s key (0600, {owner})", path=web_file(service, "key"),
                content=HiddenValue(issued.key.read_text()), owner=owner)
    secret_file(name=f"Write {service}'s web config (TLS, basic auth)", path=web_file(service, "yml"),
                content=HiddenValue(web_config_text(service, credentials)), owner=owner)
    return [web_file(service, suffix) for suffix in ("crt", "key", "yml")]
