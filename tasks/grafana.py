"""Grafana: on the hosts of monitor_group with grafana: True, dashboards over this host's Prometheus.

True afterwards: Grafana from grafana_apt_url (signed; suite stable, main) listens on grafana_port (a
drop-in of grafana-server.service) with a provisioned datasource (this host's Prometheus, with its login and
the fleet CA's certificate: the file is 0600 grafana) and rigup's fleet overview dashboard
(rigup.desired.dashboards) under /var/lib/grafana/dashboards/rigup, and vLLM's official dashboards at each
vLLM version the fleet's pods run (the lock's git:vllm@<ref> commits of vllm_git_url, read on the control
machine from vllm_dashboards_path) in a folder per version under /var/lib/grafana/dashboards/vllm, a version
no pod serves any more removed (all re-read by Grafana on change). Without grafana: True: nothing here.
Reads: monitor_group, grafana, grafana_apt_url, grafana_apt_key_url, grafana_port, prometheus_listen_address,
vllm_git_url, vllm_dashboards_path, every host's serves_variant, and the fleet CA's and the metrics password's
knobs (fleet_ca_dir, fleet_ca_cert_file, fleet_ca_key_file, fleet_ca_key_passphrase_file, metrics_password_file).
Restarts: grafana-server when its port, datasource or dashboards provider changed after it started
(dashboard files need none).
Included by deploy.py on monitor_group hosts that passed preflight, after tasks/alertmanager.py.
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
from rigup.desired.monitoring import MonitoringError
from rigup.operations.apt import GRAFANA_KEYRING, GRAFANA_LIST, signed_repository
from rigup.operations.fleet_certs import fleet_ca_of
from rigup.operations.planning_errors import stop_the_run_on, vllm_dashboards_or_stop
from rigup.operations.serving import secret_file
from rigup.operations.units import unit_runs_current_files
from rigup.runstate import fleet_plan

with stop_the_run_on(host, MonitoringError, KnobError):
    fleet = fleet_plan(state)
    plan = fleet.host(host.name).monitor()
assert plan is not None  # deploy.py includes this file on monitor_group hosts only

if plan.grafana_port is not None:  # grafana: True
    fleet_ca, metrics_login = fleet_ca_of(host)  # the datasource logs in to Prometheus
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
    files.put(
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
