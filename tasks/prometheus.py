"""Prometheus: on the hosts of monitor_group, Prometheus over every pod, GPU, node and gateway.

True afterwards: prometheus (the OS package) runs on prometheus_listen_address, keeping
prometheus_retention of samples (flags in /etc/default/prometheus), asking every caller for TLS with
its fleet-CA certificate and basic auth (its web config under /etc/prometheus/rigup-web, the login
node_exporter asks for: rigup.desired.metrics_auth); /etc/prometheus/prometheus.yml
(checked by promtool before it replaces the one in use) scrapes every prometheus_scrape_interval_s:
Prometheus itself, each rig's GPU exporter and node_exporter (file_sd rigup-targets/gpu.json and
node.json, from the fleet file; node_exporter over https, trusting the fleet CA's certificate in
/etc/prometheus/rigup-web/fleet-ca.crt, with basic auth, the password in a 0600 file of the prometheus
user there, never in prometheus.yml: rigup.desired.metrics_auth), each gateway's /metrics with its key read from a 0600 file of the
prometheus user under /etc/prometheus/rigup-keys (never in prometheus.yml), over https verified against the fleet
CA's certificate (or its gateway_tls_ca_file, written beside it; plain HTTP only with gateway_plain_http), and every pod
(rigup-targets/vllm.json, from each rig's provenance records, read after every rig's serving phase
in this run: a variant switch moves its target at this converge; a rig that cannot be read keeps its
targets). Labels: host, and pod, variant, model on pods. /etc/prometheus/rigup-alerts.yml holds
rigup's alert rules (promtool-checked), thresholds from the alert_* knobs. prometheus-alertmanager is
installed here with Prometheus when alertmanager_webhook_url_file is set (tasks/alertmanager.py runs it).
Reads: monitor_group, gateway_group, prometheus_listen_address, prometheus_retention,
prometheus_scrape_interval_s, alert_ttft_p95_s, alert_gpu_temp_c, alert_disk_free_ratio,
alertmanager_webhook_url_file, alertmanager_port, and every host's serves_variant, metrics_exporters,
node_exporter_port, gpu_exporter_port, install_root, ssh_hostname, gateway_port,
gateway_bind_address, gateway_api_key_file, gateway_plain_http, gateway_tls_cert_file, gateway_tls_ca_file, and the fleet CA's and the metrics password's knobs
(fleet_ca_dir, fleet_ca_cert_file, fleet_ca_key_file, fleet_ca_key_passphrase_file, metrics_password_file).
Restarts: prometheus when its flags, config, rules, keys, the fleet CA's certificate, the exporters' password
or its own certificate, key or web config changed after it started; target changes need none (file_sd is
re-read on change).
Not idempotent: "Wait for Prometheus to answer" runs only after such a restart.
Included by deploy.py on monitor_group hosts that passed preflight, after the gateway; then
tasks/alertmanager.py and tasks/grafana.py.
"""

from io import StringIO

from pyinfra import host, state
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import files

from rigup.desired.knobs import KnobError
from rigup.desired.metrics_auth import CA_FILE, METRICS_USER, PASSWORD_FILE, PROMETHEUS_SERVICE, WEB_DIR
from rigup.desired.monitoring import (
    JOB_PODS,
    KEYS_DIR,
    PROMETHEUS_CONFIG_FILE,
    PROMETHEUS_DEFAULTS_FILE,
    PROMETHEUS_UNIT,
    PROMETHEUS_USER,
    RULES_FILE,
    TARGETS_DIR,
    MonitoringError,
    targets_file,
    targets_text,
)
from rigup.operations.apt import os_packages
from rigup.operations.fleet_certs import fleet_ca_of, service_web_files
from rigup.operations.monitoring import answers_with_login, checked_file, pod_targets_file
from rigup.operations.planning_errors import stop_the_run_on
from rigup.operations.serving import secret_file
from rigup.operations.units import unit_runs_current_files
from rigup.runstate import fleet_plan

with stop_the_run_on(host, MonitoringError, KnobError):
    plan = fleet_plan(state).host(host.name).monitor()  # targets: every rig, exporter and gateway of the fleet
assert plan is not None  # deploy.py includes this file on monitor_group hosts only

packages = ["prometheus"] + (["prometheus-alertmanager"] if plan.alertmanager_port is not None else [])
os_packages(name="Install Prometheus (OS archive)", packages=packages, no_recommends=True)

files.put(
    name="Set Prometheus' flags (listen address, retention)",
    src=StringIO(plan.defaults_text()),
    dest=PROMETHEUS_DEFAULTS_FILE,
    mode="644",
)
files.directory(name="Create the directory of the gateways' keys", path=KEYS_DIR, mode="750", group=PROMETHEUS_USER)
key_files = sorted(plan.gateway_keys)
for key_file in host.loop(key_files):
    secret_file(
        name="Write a gateway's key for Prometheus (0600, prometheus)",
        path=key_file,
        content=HiddenValue(plan.gateway_keys[key_file] + "\n"),
        owner=PROMETHEUS_USER,
    )
fleet_ca, metrics_login = fleet_ca_of(host)  # node_exporter asks for TLS and basic auth (rigup.desired.metrics_auth)
files.directory(name="Create the directory of the fleet's certificates", path=WEB_DIR, mode="755")
files.put(name="Write the fleet CA's certificate (what Prometheus trusts)", src=StringIO(fleet_ca.cert_pem), dest=CA_FILE,
          mode="644")
for gateway in host.loop([g for g in plan.gateways if g.ca_source is not None and g.ca_file is not None]):
    files.put(name="Write the CA certificate a gateway's front is checked with (its gateway_tls_ca_file)",
              src=gateway.ca_source, dest=gateway.ca_file, mode="644")
secret_file(
    name="Write the exporters' password for Prometheus (0600, prometheus)",
    path=PASSWORD_FILE,
    content=HiddenValue(metrics_login.password + "\n"),
    owner=PROMETHEUS_USER,
)
# Prometheus asks its callers the same (TLS from the fleet CA, basic auth): its certificate, key and web config
prometheus_web = service_web_files(host, fleet_ca, metrics_login, PROMETHEUS_SERVICE, owner=PROMETHEUS_USER)
files.directory(name="Create the targets directory", path=TARGETS_DIR, mode="755")
for job, groups in host.loop(sorted(plan.static_targets().items())):
    files.put(
        name="Write the exporters' targets from the fleet file",
        src=StringIO(targets_text(groups)),
        dest=targets_file(job),
        mode="644",
    )
checked_file(
    name="Write rigup's alert rules (promtool check rules)",
    path=RULES_FILE,
    content=plan.rules_text,
    check="promtool check rules {} >/dev/null",
)
checked_file(
    name="Write prometheus.yml (promtool check config)",
    path=PROMETHEUS_CONFIG_FILE,
    content=plan.config_text(),
    check="promtool check config {} >/dev/null",
)
prometheus = unit_runs_current_files(
    name="Run Prometheus on its current flags, config, rules and keys (restart only on a change)",
    unit=PROMETHEUS_UNIT,
    files=[PROMETHEUS_DEFAULTS_FILE, PROMETHEUS_CONFIG_FILE, RULES_FILE, *key_files, CA_FILE, PASSWORD_FILE, *prometheus_web],
)
answers_with_login(
    name="Wait for Prometheus to answer (with the login it asks for)",
    url=f"{plan.local_url}/-/ready",
    ca_file=CA_FILE,
    user=METRICS_USER,
    password_file=PASSWORD_FILE,
    timeout_s=120,
    unit=PROMETHEUS_UNIT,
    what="Prometheus",
    _if=prometheus.did_change,
)
pod_targets_file(
    name="Write the pod targets from what each rig serves now",
    path=targets_file(JOB_PODS),
    rigs=list(plan.rigs),
)
