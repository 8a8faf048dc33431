"""Quarantine routes: on gateway_group hosts, after the entrance, a pod its rig's sentinel quarantined leaves its model's
vllm-router within a second and returns when the sentinel releases it (issue 43, docs/sentinel.md).

True afterwards: {install_root}/bin/rigup-quarantine-routes (rigup/rig/quarantine_routes.py) runs as
rigup-quarantine-routes.service (DynamicUser, no write access) from {install_root}/gateway/quarantine-routes.json
(each router's loopback admin URL and its workers with the rig and pod of each, where each rig's sentinel series are
read, gateway_quarantine_removes_last_route; no secret); every second it reads each rig's rigup_sentinel_quarantined
from the rig's node_exporter (https, the fleet CA's certificate in {install_root}/gateway/fleet-ca.crt, the
monitor's metrics user with the password from {install_root}/gateway/metrics.password, 0600 root, handed to the
unit as a credential) and removes and adds the routers' workers accordingly.
Reads: gateway_quarantine_removes_last_route, install_root, fleet_ca_dir (and the CA knobs), metrics_password_file,
and every rig's metrics_exporters and node_exporter_port.
Restarts: rigup-quarantine-routes when its script, config, password, CA certificate or unit changed after it started.
Included by deploy.py after tasks/gateway.py, on the hosts that ran it.
"""

from io import StringIO

from pyinfra import host, state
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import files

from rigup.desired.knobs import knob
from rigup.desired.quarantine_routes import UNIT, UNIT_FILE, ca_path, config_path, password_path, sentinel_urls, unit_text
from rigup.layout import RigLayout
from rigup.operations.fleet_certs import fleet_ca_of
from rigup.operations.quarantine_routes import quarantine_routes_config
from rigup.operations.serving import secret_file
from rigup.operations.units import unit_runs_current_files
from rigup.rig import QUARANTINE_ROUTES_SCRIPT
from rigup.runstate import fleet_plan

plan = fleet_plan(state).host(host.name).gateway()
assert plan is not None  # deploy.py includes this file after tasks/gateway.py, which stopped the run otherwise
root = plan.paths.root
script = RigLayout(knob(host.data, "install_root")).quarantine_routes
fleet_ca, metrics_login = fleet_ca_of(host)
files.put(name="Upload rigup-quarantine-routes", src=str(QUARANTINE_ROUTES_SCRIPT), dest=script, mode="755")
files.put(name="Write the fleet CA's certificate the rigs' node_exporter is checked with", src=StringIO(fleet_ca.cert_pem),
          dest=ca_path(root), mode="644")
secret_file(name="Write the metrics password the rigs' sentinel series are read with (0600)", path=password_path(root),
            content=HiddenValue(metrics_login.password + "\n"))
quarantine_routes_config(
    name="Write the quarantine routes' config from this run's routes",
    root=root,
    sentinels=sentinel_urls({r.host: r.address for r in plan.rigs},
                            {r.host: host.inventory.get_host(r.host).data for r in plan.rigs}),
    removes_last_route=bool(knob(host.data, "gateway_quarantine_removes_last_route")),
)
files.put(name="Write rigup-quarantine-routes' unit", src=StringIO(unit_text(script, root)), dest=UNIT_FILE, mode="644")
unit_runs_current_files(
    name="Run rigup-quarantine-routes on its current files (restart only on a change)",
    unit=UNIT,
    files=[UNIT_FILE, script, config_path(root), password_path(root), ca_path(root)],
)
