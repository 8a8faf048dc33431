"""Where `rigup top` reads (rigup.cli.top draws what it reads): the fleet's Prometheus, one named on the command
line, or the targets themselves (each pod's /metrics, each rig's GPU exporter, each gateway's /metrics/), chosen
from the fleet file (fleet_source); what to scrape of the targets (direct_endpoints), the metrics login they ask
for, the names rigup gives the gateway's routes and --limit's filter for rows read from Prometheus."""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from rigup.client.fleet_metrics import (
    DirectSource,
    Endpoint,
    FallbackSource,
    Keep,
    PrometheusSource,
    RouteNames,
    SentinelMarks,
    Source,
    fleet_monitor,
    metrics_url,
)
from rigup.client.targets import Target, api_host, fleet_targets, limit_selection
from rigup.desired.fleet import Fleet, load_fleet
from rigup.desired.fleet_file import fleet_path
from rigup.desired.knobs import knob
from rigup.desired.metrics_auth import PrometheusLogin, prometheus_login
from rigup.desired.roles import serves_variant


def direct_endpoints(targets: Sequence[Target], login: PrometheusLogin | str | None = None) -> list[Endpoint]:
    """What to scrape for the fleet targets: each pod's /metrics, one GPU exporter per rig that runs
    the exporters (over TLS with the metrics login it asks for: `login`, else the string says why there is
    none), each gateway's /metrics/ (the entrance's routers' metrics, joined by its front)."""
    out: list[Endpoint] = []
    rigs_seen: set[str] = set()
    for target in targets:
        host = target.host or target.name
        if serves_variant(target.data):
            pod = target.pod.name if target.pod is not None else target.variant or host
            if target.api_url is not None:
                out.append(Endpoint("pod", host, metrics_url(target.api_url), pod, target.served_model))
            else:
                out.append(Endpoint("pod", host, None, pod, None, problem=target.error or "no API URL"))
            if host not in rigs_seen and knob(target.data, "metrics_exporters") and target.ssh is not None:
                rigs_seen.add(host)
                address = "127.0.0.1" if target.ssh.local else api_host(target.ssh.hostname)
                url = f"https://{address}:{knob(target.data, 'gpu_exporter_port')}/metrics"
                if isinstance(login, PrometheusLogin):
                    out.append(Endpoint("gpu", host, url, login=login))
                else:
                    out.append(Endpoint("gpu", host, url, problem=f"it asks who is calling: {login or 'no metrics login'}"))
        if target.gateway_url is None and target.gateway_error is None:
            continue  # runs no gateway (or another of its pods reports it)
        url = f"{target.gateway_url}/metrics/" if target.gateway_url is not None else None
        if url is None or target.gateway_key is None:
            out.append(Endpoint("gateway", host, url, problem=target.gateway_error or "no gateway key"))
        else:
            out.append(Endpoint("gateway", host, url, key=target.gateway_key, ca_file=target.gateway_ca))
    return out


def metrics_login(fleet: Fleet) -> PrometheusLogin | str:
    """The metrics login the fleet's exporters ask for, as the converge left it beside the fleet file (the fleet CA
    is the fleet's: read with the first host's knobs), or why there is none."""
    if not fleet.hosts:
        return "no host in the fleet"
    return prometheus_login(fleet.resolved_data(fleet.hosts[0].name), fleet.path.parent)


def named_prometheus_login(url: str, fleet: Fleet) -> PrometheusLogin | None:
    """The login rigup top presents to the Prometheus --prometheus names: the fleet's, as `rigup status` and top's
    own reading of the fleet's Prometheus present it (the metrics user, the password the converge left on this
    machine, the fleet CA's certificate checked: rigup.client.fleet_metrics.fleet_monitor), over https only, so the
    password never goes out in clear; None: an http URL, or no login on this machine (then a Prometheus that asks
    answers 401, which the frame's notes show)."""
    if urllib.parse.urlsplit(url).scheme.lower() != "https":
        return None
    monitor = fleet_monitor(fleet)
    if monitor is not None and monitor.login is not None:
        return monitor.login
    login = metrics_login(fleet)
    return login if isinstance(login, PrometheusLogin) else None


def fleet_route_names(targets: Sequence[Target]) -> RouteNames:
    """The name rigup gives each route (<host>/<unit>), found from its API base (the router's worker + /v1): the
    pod listening on that port at that address (127.0.0.1 for a pod on the gateway's own host). The routers'
    series name a route by its worker's URL only."""
    pods: list[tuple[int, set[str], str, str]] = []  # (port, addresses, host, name)
    for target in targets:
        if target.recipe is None or target.api_url is None or target.host is None:
            continue
        url = urllib.parse.urlsplit(target.api_url)
        if url.port is None:
            continue
        addresses = {target.host, url.hostname or ""}
        if target.ssh is not None:
            addresses.add(target.ssh.hostname)
        pods.append((url.port, addresses, target.host, f"{target.host}/{target.recipe.paths.unit_name}"))

    def name(gateway: str, api_base: str) -> str | None:
        url = urllib.parse.urlsplit(api_base)
        address = (url.hostname or "").strip("[]")
        loopback = address in ("127.0.0.1", "::1", "localhost")
        found = {n for port, addresses, host, n in pods
                 if port == url.port and (address in addresses or (loopback and host == gateway))}
        return found.pop() if len(found) == 1 else None

    return name


def selection_filter(fleet: Fleet, limit: Sequence[str] | None) -> Keep | None:
    """--limit for rows read from Prometheus: the selected hosts, and of "<host>/<pod>" that pod."""
    if not limit:
        return None
    selected = limit_selection(fleet, limit)
    return lambda host, pod: host in selected and (pod is None or selected[host] is None or pod in selected[host])


def fleet_source(fleet_file: str | None, limit: Sequence[str] | None, *, direct: bool = False,
                 prometheus: str | None = None, timeout: float) -> Source:
    """Where rigup top reads its frames: `prometheus` (a Prometheus URL, the fleet's rows kept to `limit`); else the
    fleet's Prometheus (rigup.client.fleet_metrics.fleet_monitor), falling back to reading the targets directly while
    it does not answer; else, with `direct` or when the fleet has none, the targets directly. Quarantines are marked
    on the rows while a Prometheus answers (SentinelMarks). A fleet file or `limit` that cannot be used raises
    RemoteError or ValueError, before any frame."""
    fleet_file_here = Path(fleet_file) if fleet_file is not None else fleet_path()
    if prometheus and not limit and not fleet_file_here.is_file():  # no fleet here: nothing to log in with
        return SentinelMarks(PrometheusSource(prometheus, timeout), prometheus, timeout)
    fleet = load_fleet(fleet_file)
    names = fleet_route_names(fleet_targets(fleet=fleet))  # every rig: a gateway routes beyond --limit

    def read_directly() -> DirectSource:
        return DirectSource(direct_endpoints(fleet_targets(limit, fleet=fleet), metrics_login(fleet)), timeout, names)

    if prometheus:
        login = named_prometheus_login(prometheus, fleet)
        return SentinelMarks(PrometheusSource(prometheus, timeout, keep=selection_filter(fleet, limit),
                                              route_names=names, login=login), prometheus, timeout, login)
    monitor = None if direct else fleet_monitor(fleet)
    if monitor is None:
        return read_directly()
    if monitor.url is None:
        source = read_directly()
        source.description += f" ({monitor.problem})"
        return source
    keep = selection_filter(fleet, limit)
    primary = PrometheusSource(monitor.url, timeout, scrape_interval_s=monitor.scrape_interval_s, keep=keep,
                               route_names=names, login=monitor.login)
    # the targets resolved (and --limit checked) up front; quarantines marked while Prometheus answers
    return SentinelMarks(FallbackSource(primary, read_directly()), monitor.url, timeout, monitor.login)
