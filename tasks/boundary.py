"""Boundary: default deny on every fleet host (rigup.desired.boundary; docs/security.md's port table).

True afterwards (firewall: true): /etc/rigup/boundary.nft holds rigup's nftables table (rigup_boundary)
rendered from the run's FleetPlan, and rigup-boundary.service (enabled, before the network and Docker)
has it loaded: new connections reach SSH, the entrance on gateway_group's hosts, and each internal
service only from the fleet members that use it (and the control machine, by the address its SSH
connection comes from), plus firewall_allow's networks; everything else is dropped, Docker's published
ports included (judged on the forward hook by the port asked for before Docker's DNAT).
With firewall: false: no unit, file or table (preflight warns).
Reads: firewall, firewall_allow, every host's roles and ssh_hostname, the ports of what each role runs
(each pod's port, node_exporter_port, gpu_exporter_port, prometheus_listen_address, grafana,
grafana_port, gateway_port, image_mirror_port, model_fleet_port, model_fleet_source, clusters), ssh_port.
Reloads: the table, when its file changed (`nft -f` replaces rigup's table alone, in one transaction:
no moment without rules). Restarts: nothing else.
Included by deploy.py on every host that passed preflight, before anything listens.
"""

import posixpath
from io import StringIO

from pyinfra import host
from pyinfra.operations import files, server

from rigup.desired.boundary import RULES_FILE, UNIT, BoundaryError, host_rules, peer_hostnames, table_text, unit_text
from rigup.desired.knobs import knob
from rigup.desired.recipe import RecipeError
from rigup.facts.boundary import BoundaryView
from rigup.operations.apt import os_packages
from rigup.operations.boundary import boundary_absent
from rigup.operations.planning_errors import stop_the_run_on
from rigup.operations.units import unit_runs_current_files
from rigup.runstate import fleet_plan

if knob(host.data, "firewall"):
    with stop_the_run_on(host, BoundaryError, RecipeError):
        fleet = fleet_plan(host.state)
        seen = host.get_fact(BoundaryView, peers=peer_hostnames(fleet, host.name))
        text = table_text(host.name, host_rules(fleet, host.name, seen.control, seen.peers))
    os_packages(name="Install nftables (the boundary's firewall)", packages=["nftables"])
    files.directory(name="Create /etc/rigup", path=posixpath.dirname(RULES_FILE), mode="755")
    rules = files.put(name="Write the boundary's rules (default deny, holes from the fleet's roles)",
                      src=StringIO(text), dest=RULES_FILE, mode="644")
    files.put(name="Write the boundary's unit", src=StringIO(unit_text()), dest=f"/etc/systemd/system/{UNIT}",
              mode="644")
    unit_runs_current_files(name="Run the boundary", unit=UNIT, files=[f"/etc/systemd/system/{UNIT}"])
    server.shell(name="Load the boundary's new rules (one transaction)", commands=[f"systemctl reload {UNIT}"],
                 _if=rules.did_change)
else:
    boundary_absent(name="Remove the boundary (firewall: false)")
