"""Monitoring: on the hosts of monitor_group, Prometheus over every pod, GPU, node and gateway.

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
rigup's alert rules (promtool-checked), thresholds from the alert_* knobs. With
alertmanager_webhook_url_file set, prometheus-alertmanager (OS package) listens on 127.0.0.1:
alertmanager_port, asking for the same TLS and login (its own web config; Prometheus sends it alerts
with them), with no HA cluster listener, and sends every alert to that webhook (alertmanager.yml, which
holds the URL, is 0600 for the prometheus user). With grafana: True, Grafana from grafana_apt_url (signed; suite stable, main)
listens on grafana_port with a provisioned datasource (this Prometheus, with its login: the file is
0600 grafana) and rigup's fleet overview
dashboard (rigup.desired.dashboards) under /var/lib/grafana/dashboards/rigup, and vLLM's official
dashboards at each vLLM version the fleet's pods run (the lock's git:vllm@<ref> commits of
vllm_git_url, read on the control machine from vllm_dashboards_path) in a folder per version under
/var/lib/grafana/dashboards/vllm, a version no pod serves any more removed (all re-read by Grafana on
change).
Reads: monitor_group, gateway_group, prometheus_listen_address, prometheus_retention,
prometheus_scrape_interval_s, alert_ttft_p95_s, alert_gpu_temp_c, alert_disk_free_ratio,
alertmanager_webhook_url_file, alertmanager_port, grafana, grafana_apt_url, grafana_apt_key_url,
grafana_port, vllm_git_url, vllm_dashboards_path, and every host's serves_variant, metrics_exporters,
node_exporter_port, gpu_exporter_port, install_root, ssh_hostname, gateway_port,
gateway_bind_address, gateway_api_key_file, gateway_plain_http, gateway_tls_cert_file, gateway_tls_ca_file, and the fleet CA's and the metrics password's knobs
(fleet_ca_dir, fleet_ca_cert_file, fleet_ca_key_file, fleet_ca_key_passphrase_file, metrics_password_file).
Restarts: prometheus (and alertmanager, grafana) when its flags, config, rules, keys, the fleet CA's
certificate, the exporters' password or its own certificate, key or web config changed after it started;
target changes need none (file_sd is re-read on change).
Not idempotent: "Wait for Prometheus to answer" runs only after such a restart.
Included by deploy.py on monitor_group hosts that passed preflight, after the gateway.
"""

from io import StringIO

from pyinfra import host, logger, state
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.facts.files import FindDirectories
from pyinfra.operations import apt, files

from rigup.desired.dashboards import (
    DASHBOARDS_DIR,
    DASHBOARDS_PROVIDER_FILE,
    DATASOURCE_FILE,
    GRAFANA_PACKAGE,
    GRAFANA_PORT_DROPIN,
    GRAFANA_UNIT,
    GRAFANA_USER,
    OVERVIEW_FILE,
    VLLM_DASHBOARDS_DIR,
    dashboards_provider_text,
    datasource_text,
    overview_text,
    port_dropin_text,
    ref_label,
    vllm_ref_dir,
)
from rigup.desired.knobs import KnobError, knob
from rigup.desired.metrics_auth import (
    ALERTMANAGER_SERVICE,
    CA_FILE,
    METRICS_USER,
    PASSWORD_FILE,
    PROMETHEUS_SERVICE,
    WEB_DIR,
)
from rigup.desired.monitoring import (
    ALERTMANAGER_CONFIG_FILE,
    ALERTMANAGER_DEFAULTS_FILE,
    ALERTMANAGER_UNIT,
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
from rigup.operations.apt import GRAFANA_KEYRING, GRAFANA_LIST, os_packages, signed_repository
from rigup.operations.fleet_certs import fleet_ca_of, service_web_files
from rigup.operations.monitoring import answers_with_login, checked_file, pod_targets_file
from rigup.operations.planning_errors import stop_the_run_on, vllm_dashboards_or_stop
from rigup.operations.serving import secret_file
from rigup.operations.units import unit_runs_current_files
from rigup.runstate import fleet_plan

with stop_the_run_on(host, MonitoringError, KnobError):
    fleet = fleet_plan(state)
    plan = fleet.host(host.name).monitor()  # targets: every rig, exporter and gateway of the fleet
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

if plan.alertmanager_port is not None:
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

if plan.grafana_port is not None:
    signed_repository(
        name="Add Grafana's signed apt repository",
        key_url=knob(host.data, "grafana_apt_key_url"),
        keyring=GRAFANA_KEYRING,
        source_list=GRAFANA_LIST,
        uri=knob(host.data, "grafana_apt_url"),
        suite="stable",
        components="main",
    )
    apt.packages(name="Install Grafana", packages=[GRAFANA_PACKAGE], no_recommends=True)
    port_dropin = files.put(
        name="Set Grafana's port",
        src=StringIO(port_dropin_text(plan.grafana_port)),
        dest=GRAFANA_PORT_DROPIN,
        mode="644",
    )
    secret_file(
        name="Provision the Prometheus datasource (0600, grafana: it holds Prometheus' login)",
        path=DATASOURCE_FILE,
        content=HiddenValue(datasource_text(plan.local_url, metrics_login, fleet_ca.cert_pem)),
        owner=GRAFANA_USER,
    )
    vllm_boards, vllm_notes = vllm_dashboards_or_stop(host, fleet.named_groups())
    for note in vllm_notes:
        logger.info(f"{host.print_prefix}{note}")
    vllm_dirs = sorted({vllm_ref_dir(board.ref) for board in vllm_boards})
    files.put(
        name="Provision the dashboards folders (rigup's and one per vLLM version served)",
        src=StringIO(dashboards_provider_text(board.ref for board in vllm_boards)),
        dest=DASHBOARDS_PROVIDER_FILE,
        mode="644",
    )
    files.directory(name="Create the dashboards directory", path=DASHBOARDS_DIR, mode="755")
    files.put(name="Write rigup's fleet overview dashboard", src=StringIO(overview_text()), dest=OVERVIEW_FILE, mode="644")
    for stale in sorted(set(host.get_fact(FindDirectories, path=VLLM_DASHBOARDS_DIR, maxdepth=1) or [])
                        - {VLLM_DASHBOARDS_DIR, *vllm_dirs}):
        files.directory(name=f"Remove the dashboards of a vLLM version no pod serves ({stale})", path=stale,
                        present=False)
    for path in vllm_dirs:
        files.directory(name=f"Create {path}", path=path, mode="755")
    for board in vllm_boards:
        files.put(name=f"Write vLLM {ref_label(board.ref)}'s {board.file}", src=StringIO(board.text),
                  dest=board.dest, mode="644")
    unit_runs_current_files(
        name="Run Grafana on its current port, datasource and dashboards provider",
        unit=GRAFANA_UNIT,
        files=[GRAFANA_PORT_DROPIN, DATASOURCE_FILE, DASHBOARDS_PROVIDER_FILE],
    )
