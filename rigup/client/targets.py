"""The targets of the fleet's commands: each pod of each selected host of the fleet file (its recipe, API URL,
key, SSH settings and the gateway it runs), or a bare API URL given on the command line; --limit's selection.
What rigup's commands (rigup.cli) and rigup top's sources (rigup.client.top_sources) talk to."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rigup.client.ssh import LOCAL_HOST, RemoteError, SshSettings
from rigup.desired.fleet import Fleet, load_fleet
from rigup.desired.fleet_ca import ca_cert_path
from rigup.desired.fleet_plan import fleet_entries, plan_fleet
from rigup.desired.gateway import GatewayError, front_trust, gateway_plan
from rigup.desired.knobs import knob, url_host
from rigup.desired.pod_keys import key_owner, pod_api_key
from rigup.desired.pods import Pod
from rigup.desired.recipe import Recipe, RecipeError, pods_of
from rigup.desired.roles import serves_variant
from rigup.desired.secrets import SecretError, read_secret_file


@dataclass(frozen=True)
class Target:
    """One rig (or a bare API URL given on the command line)."""

    name: str
    api_url: str | None  # None when the recipe could not be resolved
    api_key: str | None = field(default=None, repr=False)
    data: dict[str, Any] = field(default_factory=dict)
    recipe: Recipe | None = None
    error: str | None = None  # why the target is unusable (bad variant, unreadable key file, ...)
    ssh: SshSettings | None = None  # None: no SSH (a bare URL)
    gateway_url: str | None = None  # the fleet gateway this host runs (gateway_group), None: none
    gateway_key: str | None = field(default=None, repr=False)
    gateway_error: str | None = None  # why the gateway cannot be asked (its key); the rig itself is fine
    gateway_ca: str | None = None  # the CA certificate its https front is verified against; None: the system's store
    host: str | None = None  # the fleet host (name is "<host>/<pod>" for a pod the host lists)
    pod: Pod | None = None  # which of the host's pods (rigup.desired.pods); None: a bare URL, a gateway-only host
    host_units: tuple[str, ...] = ()  # the units of every pod of the host (none of them is "another variant")
    cluster_head: str | None = None  # a cluster worker: the head's target name, which serves the cluster
    ca_file: str | None = None  # an https api_url's certificate is verified against it; None: the system's store

    @property
    def variant(self) -> str | None:
        return self.recipe.variant if self.recipe is not None else knob(self.data, "variant")

    @property
    def served_model(self) -> str | None:
        return self.recipe.served_model_name if self.recipe is not None else None


def api_host(hostname: str) -> str:
    if hostname == LOCAL_HOST:
        return "127.0.0.1"  # the serving port on this machine
    return url_host(hostname)


def select_hosts(fleet: Fleet, limit: Sequence[str] | None) -> list[str]:
    """Host names in fleet order; `limit` names hosts or groups (like pyinfra's --limit), or one pod
    of a host as "<host>/<pod>" (its host is selected; fleet_targets keeps that pod alone)."""
    return list(limit_selection(fleet, limit))


def limit_selection(fleet: Fleet, limit: Sequence[str] | None) -> dict[str, set[str] | None]:
    """Selected host -> the pods --limit names of it ("<host>/<pod>"), None for the whole host; in fleet order."""
    names = [host.name for host in fleet.hosts]
    if not limit:
        return {name: None for name in names}
    whole: set[str] = set()
    pods: dict[str, set[str]] = {}
    for item in limit:
        if item in fleet.groups:
            whole.update(h.name for h in fleet.groups[item])
        elif item in names:
            whole.add(item)
        elif "/" in item and item.split("/", 1)[0] in names:
            host, pod = item.split("/", 1)
            pods.setdefault(host, set()).add(pod)
        else:
            raise RemoteError(f"{fleet.path}: --limit {item!r} is neither a host nor a group (nor <host>/<pod>)")
    return {name: (None if name in whole else pods[name]) for name in names if name in whole or name in pods}


def fleet_targets(limit: Sequence[str] | None = None, fleet: Fleet | None = None) -> list[Target]:
    """A Target per pod of each selected host of the fleet file ($RIGUP_RIGS or rigs.yaml): one for a
    host without pods, named after the host; "<host>/<pod>" for each pod a host lists. The recipe is the
    pod's plan, as a preview: the API URL, model and unit do not depend on pins (status needs the lock)."""
    fleet = fleet if fleet is not None else load_fleet()
    planned = plan_fleet(fleet_entries(fleet))  # each selected host planned when first asked for
    targets = []
    for name, only in limit_selection(fleet, limit).items():
        data = fleet.resolved_data(name)
        ssh = SshSettings.from_data(name, data)
        gateway_url, gateway_key, gateway_error, gateway_ca = gateway_of(fleet, name, data, ssh)
        if not planned.roles(name).rig:  # a gateway-only host
            targets.append(Target(name, None, data=data, ssh=ssh, gateway_url=gateway_url, gateway_key=gateway_key,
                                  gateway_error=gateway_error, gateway_ca=gateway_ca, host=name))
            continue
        try:
            pods = pods_of(data)
        except RecipeError as exc:
            targets.append(Target(name, None, data=data, error=f"recipe: {exc}", ssh=ssh, host=name))
            continue
        units = tuple(pod.unit for pod in pods)
        if only is not None:
            unknown = sorted(only - {pod.name for pod in pods if pod.listed})
            if unknown:
                raise RemoteError(f"{fleet.path}: --limit {name}/{unknown[0]}: {name} lists no pod {unknown[0]!r}")
        first = len(targets)
        for pod in pods:
            if only is not None and pod.name not in only:
                continue
            # the gateway a host runs is reported once, with the first of its pods selected
            gateway = (gateway_url, gateway_key, gateway_error, gateway_ca) if len(targets) == first else (None,) * 4
            label = pod.target(name)
            try:
                recipe = planned.pod(name, pod).recipe
            except (RecipeError, KeyError, ValueError) as exc:
                targets.append(Target(label, None, data=data, error=f"recipe: {exc}", ssh=ssh, host=name, pod=pod,
                                      host_units=units))
                continue
            url = f"http://{api_host(ssh.hostname)}:{recipe.host_port}"
            api_key, key_error = None, None
            cluster_head = recipe.cluster.cluster.head if recipe.cluster is not None else None
            try:  # serving_api_key_file's, else the pod's own (a cluster's: its head's) the converge made
                api_key = pod_api_key(data, *key_owner(name, pod.name, cluster_head), fleet.path.parent, make=False)
            except SecretError as exc:
                key_error = str(exc)
            head = None
            if recipe.cluster is not None and recipe.cluster.role == "worker":
                # a worker answers nothing itself: the cluster's endpoint is its head's
                head_name = recipe.cluster.cluster.head
                head_ssh = SshSettings.from_data(head_name, fleet.resolved_data(head_name))
                url = f"http://{api_host(head_ssh.hostname)}:{recipe.host_port}"
                head = f"{head_name}/{pod.name}"
            targets.append(Target(label, url, api_key, data, recipe, key_error, ssh, *gateway, host=name, pod=pod,
                                  host_units=units, cluster_head=head))
    return targets


def gateway_of(fleet: Fleet, name: str, data: dict[str, Any],
               ssh: SshSettings) -> tuple[str | None, str | None, str | None, str | None]:
    """(URL, key, problem, CA certificate) of the gateway `name` runs; all None when it is not in gateway_group.
    The URL is https unless gateway_plain_http; its certificate is verified against the CA (the fleet CA's, or
    gateway_tls_ca_file), None: the system's trust store. A CA file not there yet: no URL, the problem says so."""
    try:
        plan = gateway_plan(name, data, [fleet.host(name).group], [], read_secrets=False)
    except GatewayError as exc:
        return None, None, f"gateway: {exc}", None
    if plan is None:
        return None, None, None, None
    address = "127.0.0.1" if ssh.local else api_host(ssh.hostname)
    scheme, ca_file = front_trust(data, fleet.path.parent)
    url = f"{scheme}://{address}:{plan.port}"
    if ca_file is not None and not Path(ca_file).is_file():
        made = " (the fleet CA is made at the first converge)" if plan.fleet_ca_issues else ""
        return None, None, f"gateway: the CA certificate its TLS is checked with, {ca_file}, is not there{made}", None
    # asked with gateway_api_key_file's key (client "default"), else the first of gateway_clients
    key_file, knob_name = knob(data, "gateway_api_key_file"), "gateway_api_key_file"
    if key_file is None:
        key_file, knob_name = (knob(data, "gateway_clients") or [{}])[0].get("key_file"), "gateway_clients"
    try:
        return url, read_secret_file(key_file, knob_name), None, ca_file
    except SecretError as exc:
        return url, None, f"gateway: {exc}", ca_file


def url_ca_file(url: str, ca_file: str | None) -> str | None:
    """The CA certificate an https URL given on the command line is verified against: --ca-file; else that of
    the fleet's entrance at that address and port (the fleet file's: the fleet CA's or gateway_tls_ca_file),
    else the fleet CA's certificate when there is one; else None, the system's trust store. Never unchecked."""
    if ca_file is not None:
        if not Path(ca_file).expanduser().is_file():
            raise RemoteError(f"--ca-file: {ca_file} does not exist")
        return str(Path(ca_file).expanduser())
    if urlsplit(url).scheme != "https":
        return None
    try:
        fleet = load_fleet()
    except (OSError, ValueError):
        return None  # no fleet file here: the system's trust store
    wanted = urlsplit(url.rstrip("/")).netloc
    for host in fleet.hosts:
        data = fleet.resolved_data(host.name)
        gateway_url, _, _, gateway_ca = gateway_of(fleet, host.name, data, SshSettings.from_data(host.name, data))
        if gateway_url is not None and urlsplit(gateway_url).netloc == wanted:
            return gateway_ca
    cert = ca_cert_path(fleet.resolved_data(fleet.hosts[0].name), fleet.path.parent) if fleet.hosts else None
    return str(cert) if cert is not None and cert.is_file() else None


def url_target(url: str, api_key_file: str | None = None, ca_file: str | None = None) -> Target:
    """A target for a bare API URL (no fleet, no SSH); an https URL's certificate verified (url_ca_file)."""
    api_key = read_secret_file(api_key_file, "--api-key-file") if api_key_file else os.environ.get("RIGUP_API_KEY") or None
    return Target(name=url, api_url=url.rstrip("/"), api_key=api_key, ca_file=url_ca_file(url, ca_file))


def api_targets(url: str | None, api_key_file: str | None, limit: Sequence[str] | None,
                ca_file: str | None = None) -> list[Target]:
    """The API URL given on the command line (--url, --api-key-file, --ca-file), else the fleet's hosts that
    serve a variant (--limit)."""
    if url:
        return [url_target(url, api_key_file, ca_file)]
    return [t for t in fleet_targets(limit) if serves_variant(t.data)]  # a gateway-only host serves no model
