"""Alertmanager: on the hosts of monitor_group with alertmanager_webhook_url_file set, every alert to that webhook.

True afterwards: prometheus-alertmanager (the OS package, installed by tasks/prometheus.py) listens on
127.0.0.1:alertmanager_port, asking for the same TLS and login as Prometheus (its own certificate, key and
exporter-toolkit web config under /etc/prometheus/rigup-web; Prometheus sends it alerts with them), with no
HA cluster listener (flags in /etc/default/prometheus-alertmanager), and sends every alert to that webhook
(alertmanager.yml, which holds the URL, is 0600 for the prometheus user). Without the knob: nothing here.
Reads: monitor_group, alertmanager_webhook_url_file, alertmanager_port, and the fleet CA's and the metrics
password's knobs (fleet_ca_dir, fleet_ca_cert_file, fleet_ca_key_file, fleet_ca_key_passphrase_file,
metrics_password_file).
Restarts: alertmanager when its flags, config, or its certificate, key or web config changed after it started.
Included by deploy.py on monitor_group hosts that passed preflight, after tasks/prometheus.py.
"""

from io import StringIO

from pyinfra import host, state
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import files

from rigup.desired.knobs import KnobError
from rigup.desired.metrics_auth import ALERTMANAGER_SERVICE
from rigup.desired.monitoring import (
    ALERTMANAGER_CONFIG_FILE,
    ALERTMANAGER_DEFAULTS_FILE,
    ALERTMANAGER_UNIT,
    PROMETHEUS_USER,
    MonitoringError,
)
from rigup.operations.fleet_certs import fleet_ca_of, service_web_files
from rigup.operations.planning_errors import stop_the_run_on
from rigup.operations.serving import secret_file
from rigup.operations.units import unit_runs_current_files
from rigup.runstate import fleet_plan

with stop_the_run_on(host, MonitoringError, KnobError):
    plan = fleet_plan(state).host(host.name).monitor()
assert plan is not None  # deploy.py includes this file on monitor_group hosts only

if plan.alertmanager_port is not None:  # alertmanager_webhook_url_file is set
    fleet_ca, metrics_login = fleet_ca_of(host)
    alertmanager_web = service_web_files(host, fleet_ca, metrics_login, ALERTMANAGER_SERVICE, owner=PROMETHEUS_USER)
    files.put(
        name="Set Alertmanager's flags (loopback, its web config, no HA cluster)",
        src=StringIO(plan.alertmanager_defaults_text()),
        dest=ALERTMANAGER_DEFAULTS_FILE,
        mode="644",
    )
    secret_file(
        name="Write alertmanager.yml (0600, prometheus: it holds the webhook's URL)",
        path=ALERTMANAGER_CONFIG_FILE,
        content=HiddenValue(plan.alertmanager_config_text()),
        owner=PROMETHEUS_USER,
    )
    unit_runs_current_files(
        name="Run Alertmanager on its current flags and config",
        unit=ALERTMANAGER_UNIT,
        files=[ALERTMANAGER_DEFAULTS_FILE, ALERTMANAGER_CONFIG_FILE, *alertmanager_web],
    )
