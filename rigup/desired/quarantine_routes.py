"""Quarantine routes (issue 43): what the entrance host's rigup-quarantine-routes is given, so that a pod its rig's
sentinel quarantined leaves its model's router within a second and comes back when released.

Why this shape: vllm-router 0.1.17 routes to the workers it holds and takes workers in and out over its admin
API (`POST /remove_worker?url=`, `POST /add_worker?url=`, `GET /list_workers`, checked against the pinned wheel:
a removed worker gets no new request, and --worker-urls come back whole at a restart). The quarantine is decided
on each rig by its sentinel (rigup/rig/servingctl.py), which the routers cannot hear; making the pod's own
/health fail instead would mean touching vLLM. So one small loop on the entrance host reads each rig's
quarantines where the monitor reads them (node_exporter's textfile, TLS from the fleet CA, the metrics user) every
poll_s and sets each router's workers (rigup/rig/quarantine_routes.py). The rule for a model's last route is
there too (decide), with gateway_quarantine_removes_last_route.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from rigup.desired.entrance import ModelRouter
from rigup.desired.knobs import knob
from rigup.desired.metrics_auth import METRICS_USER
from rigup.desired.templating import render_template

UNIT = "rigup-quarantine-routes.service"
UNIT_FILE = f"/etc/systemd/system/{UNIT}"
POLL_S = 1  # seconds between reads of the rigs' quarantines: a quarantined pod is out within about this
CONFIG_NAME = "quarantine-routes.json"  # in the entrance directory, no secret
PASSWORD_NAME = "metrics.password"  # in the entrance directory, 0600 root; the unit hands it as a credential
CA_NAME = "fleet-ca.crt"  # in the entrance directory: what the rigs' node_exporter certificates are checked with


def config_path(root: str) -> str:
    return posixpath.join(root, CONFIG_NAME)


def password_path(root: str) -> str:
    return posixpath.join(root, PASSWORD_NAME)


def ca_path(root: str) -> str:
    return posixpath.join(root, CA_NAME)


def sentinel_urls(addresses: Mapping[str, str | None], rig_data: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Where the entrance reads each rig's sentinel series: its node_exporter (https, the textfile collector
    only), at the address the entrance reaches the rig by. Rigs without exporters (metrics_exporters false: no
    sentinel either) or without an address the entrance can use are left out."""
    urls = {}
    for rig, address in sorted(addresses.items()):
        data = rig_data[rig]
        if address is None or not knob(data, "metrics_exporters"):
            continue
        host = f"[{address}]" if ":" in address else address
        urls[rig] = f"https://{host}:{knob(data, 'node_exporter_port')}/metrics?collect%5B%5D=textfile"
    return urls


def pod_of(unit: str) -> str:
    """The pod a route's unit runs (rigup-<pod>.service): the sentinel's `pod` label."""
    return unit.removeprefix("rigup-").removesuffix(".service")


def config_text(routers: Sequence[ModelRouter], routes: Sequence[Any], sentinels: Mapping[str, str], *,
                removes_last_route: bool, root: str) -> str:
    """rigup-quarantine-routes' config: each router's admin URL and workers (with the rig and pod each is), the
    rigs' sentinel URLs and the last-route rule (rigup/rig/quarantine_routes.py reads it). No secret."""
    by_worker = {(r.model, r.api_base.removesuffix("/v1")): r for r in routes}
    document = {
        "poll_s": POLL_S,
        "removes_last_route": removes_last_route,
        "ca_file": ca_path(root),
        "user": METRICS_USER,
        "sentinels": dict(sorted(sentinels.items())),
        "routers": [
            {"model": router.model, "admin": f"http://127.0.0.1:{router.port}",
             "workers": [{"url": url, "host": by_worker[(router.model, url)].host,
                          "pod": pod_of(by_worker[(router.model, url)].unit)} for url in router.workers]}
            for router in routers
        ],
    }
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def unit_text(script: str, root: str) -> str:
    return render_template("rigup-quarantine-routes.service.j2", script=script, config=config_path(root),
                           password=password_path(root))
