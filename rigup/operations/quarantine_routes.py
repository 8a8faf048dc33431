"""Operations of quarantine routes on the entrance host (issue 43): the config rigup-quarantine-routes reads, from
the routes and routers the entrance task decided in this pass (rigup.operations.gateway.entrance_routes, recorded in
rigup.runstate)."""

from __future__ import annotations

from collections.abc import Mapping
from io import StringIO

from pyinfra import host
from pyinfra.api import operation
from pyinfra.operations import files

from rigup.desired.quarantine_routes import config_path, config_text
from rigup.facts.units import TextFile
from rigup.runstate import decided_routes


@operation()
def quarantine_routes_config(root: str, sentinels: Mapping[str, str], removes_last_route: bool):
    """
    Write rigup-quarantine-routes' config: each router's admin URL and workers (the rig and pod of each), where each
    rig's sentinel series are read, and gateway_quarantine_removes_last_route. Runs after entrance_routes, whose
    routes and routers of this pass it takes.

    + root: the entrance directory ({install_root}/gateway)
    + sentinels: rig name -> the URL of its node_exporter's textfile series (rigup.desired.quarantine_routes.sentinel_urls)
    + removes_last_route: whether a quarantine may take a model's last routes
    """
    decided = decided_routes(host)
    text = config_text(decided.routers, decided.routes, sentinels, removes_last_route=removes_last_route, root=root)
    path = config_path(root)
    if host.get_fact(TextFile, path=path) == text:
        host.noop("quarantine routes' config unchanged")
        return
    yield from files.put._inner(src=StringIO(text), dest=path, mode="644")
