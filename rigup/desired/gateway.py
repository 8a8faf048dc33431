"""The fleet's entrance on the hosts of gateway_group: nginx from the OS archive as the front, one vllm-router per
served model behind it (rigup.desired.entrance renders them), routing to what the rigs actually serve.

What the control machine decides for an entrance host: where its files live, which pinned venv the routers run
from (files/router/requirements.txt, vllm-router hash-pinned), the clients and their keys, each pod's key (its own,
or its rig's serving_api_key_file key), TLS.

Routes come from each rig's provenance record (the release that last passed rigup's health gate) and
whether that release's unit runs now, read on the rig at the end of the converge, never from the
fleet file's intent: a rig whose switch failed and rolled back keeps routing to what it serves again.
One route per rig and served model; rigs serving the same model share that model's router, which spreads
requests over them, health-checks them and retries another on failure.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rigup import DEPLOY_ROOT
from rigup.desired.entrance import Client, EntranceError, EntrancePaths, client_entries, client_key, pod_address
from rigup.desired.fleet_ca import FleetCAError, ca_cert_path, host_sans, sans_of
from rigup.desired.knobs import knob, knob_int
from rigup.desired.pod_keys import pod_api_key
from rigup.desired.roles import gateway_group, is_gateway, is_local, serves_variant
from rigup.desired.secrets import SecretError, load_api_key, read_secret_file
from rigup.desired.templating import render_template
from rigup.layout import RigLayout

REQUIREMENTS_FILE = DEPLOY_ROOT / "files" / "router" / "requirements.txt"
ROUTER_UNIT = "rigup-router@.service"  # one instance per served model: rigup-router@<slug>.service
UNIT_FILE = f"/etc/systemd/system/{ROUTER_UNIT}"
FRONT_UNIT = "nginx.service"  # the archive package's unit
TLS_SERVICE = "entrance"  # the fleet CA's name for the front's certificate: fleet-ca/issued/<host>/entrance.crt
DEFAULT_CLIENT = "default"  # the client whose key is gateway_api_key_file's


class GatewayError(ValueError):
    """A gateway setting rigup cannot use; the message names the host and the knob."""


@dataclass(frozen=True)
class Route:
    """One deployment of a served model in the gateway: a rig's variant unit."""

    host: str  # the rig's inventory name
    unit: str  # rigup-<variant>.service
    variant: str
    model: str  # the served model name: the route's public model name
    api_base: str  # http://address:port/v1
    key_env: str | None  # the gateway environment variable holding the rig's API key; None: open API

    @property
    def route_id(self) -> str:
        return f"{self.host}/{self.unit}"


@dataclass(frozen=True)
class RigEndpoint:
    """How the gateway reaches one rig: its name, the address to use and the env var of its key."""

    host: str
    address: str | None  # IP or name; 127.0.0.1 for the gateway host itself; None: none the gateway can use
    key_env: str | None
    local: bool  # the gateway runs on this rig (a loopback-bound variant is reachable)


@cache
def requirements_text() -> str:
    return REQUIREMENTS_FILE.read_text()


def requirements_sha256() -> str:
    return hashlib.sha256(requirements_text().encode()).hexdigest()


def router_version() -> str:
    found = re.search(r"^vllm-router==(\S+)", requirements_text(), re.MULTILINE)
    if found is None:
        raise GatewayError(f"{REQUIREMENTS_FILE}: no vllm-router== pin")
    return found.group(1)


@dataclass(frozen=True)
class GatewayPaths(EntrancePaths):
    root: str  # {install_root}/gateway

    @property
    def config_file(self) -> str:
        """The routes rigup wrote (routes.json): what each router is fed and status shows; no secret."""
        return posixpath.join(self.root, "routes.json")

    @property
    def site_file(self) -> str:
        return "/etc/nginx/conf.d/rigup-entrance.conf"  # the package's nginx.conf includes conf.d/*.conf

    @property
    def tls_cert(self) -> str:
        return posixpath.join(self.root, "tls.crt")

    @property
    def tls_key(self) -> str:
        return posixpath.join(self.root, "tls.key")

    @property
    def tls_ca(self) -> str:
        """The CA certificate the host's own readiness wait verifies the front with (the fleet CA's, or
        gateway_tls_ca_file's)."""
        return posixpath.join(self.root, "tls-ca.crt")

    @property
    def requirements_file(self) -> str:
        return posixpath.join(self.root, f"requirements-{requirements_sha256()[:12]}.txt")

    @property
    def venv(self) -> str:
        """Named by the pin's hash: a new pin builds beside the running one, which keeps serving meanwhile."""
        return posixpath.join(self.root, f"venv-{requirements_sha256()[:12]}")


def gateway_paths(install_root: str) -> GatewayPaths:
    return GatewayPaths(RigLayout(install_root).gateway_dir)


def pod_of_unit(unit: str) -> str:
    """The pod a route's unit runs (rigup-<pod>.service)."""
    return unit.removeprefix("rigup-").removesuffix(".service")


def score_sample_rate(data: Mapping[str, Any]) -> float:
    """gateway_score_sample_rate: the share of the pods' completions the entrance's hop scores (0 to 1)."""
    value = knob(data, "gateway_score_sample_rate")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise GatewayError(f"gateway_score_sample_rate must be a share of completions from 0 to 1, got {value!r}")
    return float(value)


def scored_pods(routes: Iterable[Route]) -> list[tuple[str, str, str]]:
    """(host:port, rig/pod, model) of each routed pod: how the hop's scored completions are labelled, with the
    rig's inventory name and the pod's name as the sentinel and vLLM's scrape label them."""
    return sorted({(pod_address(r.api_base), f"{r.host}/{pod_of_unit(r.unit)}", r.model) for r in routes})


def key_env(host_name: str) -> str:
    """The gateway environment variable that holds one rig's serving API key."""
    return "RIGUP_RIG_KEY_" + re.sub(r"[^A-Za-z0-9]", "_", host_name).upper()


def route_for(rig: RigEndpoint, record: Mapping[str, Any] | None, active_units: Iterable[str]) -> tuple[Route | None, str]:
    """The rig's route from its provenance record and its running units; (None, why) when there is none."""
    if not record:
        return None, "no release has passed rigup's health gate here"
    gate = record.get("gate") if isinstance(record.get("gate"), Mapping) else {}
    if gate.get("result") != "passed":
        return None, f"its last health gate did not pass ({gate.get('result', 'no result')})"
    release = record.get("release") if isinstance(record.get("release"), Mapping) else {}
    member = release.get("cluster") if isinstance(release.get("cluster"), Mapping) else {}
    if member.get("role") == "worker":
        return None, f"a worker of cluster {member.get('name')}: its head serves the cluster"
    unit, model, port = record.get("unit"), release.get("served_model_name"), release.get("host_port")
    if not (isinstance(unit, str) and isinstance(model, str) and isinstance(port, int)):
        return None, "its provenance record names no unit, served model or port"
    if unit not in set(active_units):
        return None, f"{unit} is not running"
    bind = str(release.get("bind_address") or "0.0.0.0")
    if is_loopback(bind) and not rig.local:
        return None, f"{unit} listens on {bind} only (serving_bind_address), out of the gateway's reach"
    if bind in ("0.0.0.0", "::"):
        address = rig.address
    else:  # it listens on that address alone (127.0.0.1 is reachable only from the rig itself: rig.local)
        address = bind
    if address is None:
        return None, "pyinfra's @local has no address the gateway on another host can reach"
    address = f"[{address}]" if ":" in address else address
    key = rig.key_env if release.get("api_key_env") else None
    return Route(rig.host, unit, str(record.get("variant")), model, f"http://{address}:{port}/v1", key), "serves " + model


def current_records(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One record per unit, the newest (written_at): a host that moved between the one-variant form and
    pods keeps the earlier layout's record beside the new one, both naming a unit that may run now."""
    newest: dict[Any, Mapping[str, Any]] = {}
    for record in records:
        unit = record.get("unit")
        if unit not in newest or str(record.get("written_at") or "") > str(newest[unit].get("written_at") or ""):
            newest[unit] = record
    return list(newest.values())


def is_loopback(address: str) -> bool:
    """A loopback address (127.0.0.0/8, ::1) or the name localhost: reachable from its own host only."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def reach_address(name: str, data: Mapping[str, Any], seen_from: str) -> str | None:
    """How host `seen_from` reaches fleet host `name`: 127.0.0.1 when it is the host itself, None for
    pyinfra's @local seen from another host (the control machine: no address it can use), else its
    ssh_hostname (or its name)."""
    if name == seen_from:
        return "127.0.0.1"
    if is_local(name):
        return None
    return str(data.get("ssh_hostname") or name)


def routes_document(routes: Iterable[Route]) -> dict[str, Any]:
    """The entrance's routes as rigup wrote them (routes.json on the gateway host): what each router is fed,
    what `rigup status` shows, and what a rig that cannot be read at the next converge keeps."""
    return {"routes": [
        {"model": r.model, "host": r.host, "unit": r.unit, "variant": r.variant, "api_base": r.api_base,
         "key_env": r.key_env}
        for r in sorted(routes, key=lambda r: (r.model, r.host, r.unit))
    ]}


def routes_text(routes: Iterable[Route]) -> str:
    return json.dumps(routes_document(routes), indent=1, sort_keys=True) + "\n"


def routes_in_config(text: str | None) -> list[Route]:
    """The routes a routes.json rigup wrote holds (for rigs outside this run: they keep theirs)."""
    if not text:
        return []
    try:
        document = json.loads(text)
    except ValueError:
        return []
    routes = []
    for entry in (document or {}).get("routes") or () if isinstance(document, dict) else ():
        try:
            routes.append(Route(host=str(entry["host"]), unit=str(entry["unit"]), variant=str(entry["variant"]),
                                model=str(entry["model"]), api_base=str(entry["api_base"]),
                                key_env=entry["key_env"] if isinstance(entry.get("key_env"), str) else None))
        except (KeyError, TypeError):
            continue  # not one of rigup's routes
    return routes


def workers_by_model(routes: Iterable[Route]) -> dict[str, list[str]]:
    """Each served model -> its pods' base URLs (what vllm-router's --worker-urls takes: no /v1)."""
    out: dict[str, list[str]] = {}
    for r in routes:
        out.setdefault(r.model, []).append(r.api_base.removesuffix("/v1"))
    return out


def router_unit_text(paths: GatewayPaths) -> str:
    return render_template("rigup-router@.service.j2", paths=paths, version=router_version())


@dataclass(frozen=True)
class GatewayPlan:
    """What an entrance host gets: paths, listen address, clients, the pods' keys, TLS, and the rigs it routes to."""

    host: str
    paths: GatewayPaths
    bind_address: str
    port: int
    pip_index_url: str | None  # None: pip's own config on the gateway host
    health_check_interval_s: int
    num_retries: int
    ready_timeout_s: int
    rigs: tuple[RigEndpoint, ...]
    install_roots: dict[str, str]  # rig -> its install_root (its provenance record lives there)
    clients: tuple[Client, ...] = field(repr=False)
    rig_data: Mapping[str, Mapping[str, Any]] = field(repr=False)  # each rig's data: whose key its pods carry
    tls_files: tuple[str, str] | None = None  # the user's (certificate, key) on the control machine; None: see plain_http
    plain_http: bool = False  # gateway_plain_http: no TLS at all; False without tls_files: the fleet CA issues one
    client_ca: str | None = None  # control-machine CA certificate its clients trust for it; None: the system's store
    cert_sans: tuple[str, ...] = ()  # the names of the fleet CA's certificate for it (when fleet_ca_issues)
    score_sample_rate: float = 0.0  # gateway_score_sample_rate: the share of completions the hop scores

    def pod_keys(self, routes: Sequence[Route]) -> dict[str, str]:
        """Each routed pod's host:port -> its key, which the entrance's hop sends it (rigup.desired.pod_keys): its
        rig's serving_api_key_file key, else the pod's own from the control machine, made there when it is not yet
        (a pod that served before this run has its file already). A route whose rig is no longer in the fleet
        file gets none (its pod refuses)."""
        keys = {}
        for route in routes:
            data = self.rig_data.get(route.host)
            if data is not None:
                keys[pod_address(route.api_base)] = pod_api_key(data, route.host, pod_of_unit(route.unit))
        return keys

    @property
    def fleet_ca_issues(self) -> bool:
        """The front's certificate is issued at converge by the fleet CA (no gateway_tls_cert_file, not plain HTTP)."""
        return not self.plain_http and self.tls_files is None

    @property
    def tls(self) -> tuple[str, str] | None:
        """Where the certificate and key are on the host (nginx reads them), when the front speaks TLS."""
        return None if self.plain_http else (self.paths.tls_cert, self.paths.tls_key)

    @property
    def scheme(self) -> str:
        return "http" if self.plain_http else "https"

    @property
    def readiness_url(self) -> str:
        address = "127.0.0.1" if self.bind_address in ("0.0.0.0", "::") else self.bind_address
        address = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{address}:{self.port}/health"

    def readiness(self, cert_names: Sequence[str]) -> tuple[str, str | None]:
        """What the host's own readiness wait asks, verifying the front's certificate as a client would: the URL,
        and curl's --connect-to (None: the URL's address) when the URL names the front by a name of its certificate
        (`cert_names`, the user's certificate's) that is not the address it listens on here."""
        url = self.readiness_url
        if self.plain_http or self.fleet_ca_issues:  # the fleet CA's certificate names 127.0.0.1 and the bind address
            return url, None
        address = urlsplit(url).hostname or "127.0.0.1"
        if address in cert_names or not cert_names:
            return url, None
        name, target = cert_names[0].replace("*", "rigup-ready", 1), f"[{address}]" if ":" in address else address
        name = f"[{name}]" if ":" in name else name
        return f"https://{name}:{self.port}/health", f"{name}:{self.port}:{target}:{self.port}"


def _clients(data: Mapping[str, Any], read_secrets: bool) -> tuple[Client, ...]:
    """The entrance's clients: gateway_clients, and gateway_api_key_file's key as client "default"."""
    entries = client_entries(knob(data, "gateway_clients"), "gateway_clients")
    legacy = knob(data, "gateway_api_key_file")
    if legacy is not None:
        if DEFAULT_CLIENT in {name for name, _ in entries}:
            raise GatewayError(f"gateway_clients names a client {DEFAULT_CLIENT!r}, the name gateway_api_key_file's "
                               "key has: rename it, or list that key file there and unset gateway_api_key_file")
        entries.insert(0, (DEFAULT_CLIENT, str(legacy)))
    if not entries:
        raise GatewayError(
            f"gateway_api_key_file is not set and gateway_clients is empty: an entrance host needs at least one client "
            f"(a name and a 0600 key file on the control machine) (group {gateway_group(data)!r})"
        )
    if not read_secrets:
        return tuple(Client(name, "unread") for name, _ in entries)
    clients = []
    for name, key_file in entries:
        knob_name = "gateway_api_key_file" if name == DEFAULT_CLIENT and key_file == legacy else f"gateway_clients[{name}]"
        clients.append(Client(name, client_key(name, key_file, knob_name)))
    keys = [c.key for c in clients]
    if len(set(keys)) != len(keys):
        raise GatewayError("gateway_clients: two clients share one key; each client needs its own")
    return tuple(clients)


def front_trust(data: Mapping[str, Any], base_dir: Path | None = None) -> tuple[str, str | None]:
    """How a client reaches the entrance of a host with `data`: its scheme ("http" only with gateway_plain_http)
    and the control-machine CA certificate its certificate is verified against (the fleet CA's for one issued at
    converge, gateway_tls_ca_file's for the user's; None: the system's trust store, or plain HTTP). `base_dir`:
    the fleet file's directory (default: $RIGUP_RIGS's), where a relative fleet_ca_dir is."""
    if knob(data, "gateway_plain_http") is True:
        return "http", None
    if knob(data, "gateway_tls_cert_file") is not None:
        own_ca = knob(data, "gateway_tls_ca_file")
        return "https", str(Path(str(own_ca)).expanduser()) if own_ca is not None else None
    return "https", str(ca_cert_path(data, base_dir))


def gateway_plan(
    host_name: str,
    data: Mapping[str, Any],
    groups: Iterable[str],
    fleet: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    read_secrets: bool = True,
) -> GatewayPlan | None:
    """The entrance plan of one host (None: it is not in gateway_group). `fleet` is every host of the
    inventory with its data, in order; the ones that serve a variant become its rigs."""
    if not is_gateway(data, groups):
        return None
    try:
        clients = _clients(data, read_secrets)
    except (EntranceError, SecretError) as exc:
        raise GatewayError(str(exc)) from None
    rigs, roots, rig_data = [], {}, {}
    for name, data_of_rig in fleet:
        if not serves_variant(data_of_rig):
            continue
        if read_secrets:
            try:
                own = load_api_key(data_of_rig)  # serving_api_key_file's; None: each pod's own (pod_keys)
            except SecretError as exc:
                raise GatewayError(f"the key of rig {name!r}, which the gateway routes to: {exc}") from None
            if own is not None and any(c in own for c in '"\\\n\r;$'):
                raise GatewayError(f"serving_api_key_file of rig {name!r}: the key holds a quote, backslash, ';' or '$' "
                                   "(nginx would parse it)")
        address = reach_address(name, data_of_rig, host_name)
        rigs.append(RigEndpoint(name, address, key_env(name), name == host_name))
        roots[name] = knob(data_of_rig, "install_root")
        rig_data[name] = data_of_rig
    cert, tls_key = knob(data, "gateway_tls_cert_file"), knob(data, "gateway_tls_key_file")
    if (cert is None) != (tls_key is None):
        raise GatewayError("gateway_tls_cert_file and gateway_tls_key_file are set together (a certificate and its key)")
    plain_http, own_ca = knob(data, "gateway_plain_http") is True, knob(data, "gateway_tls_ca_file")
    bind_address = str(knob(data, "gateway_bind_address"))
    if plain_http and (cert is not None or own_ca is not None):
        raise GatewayError("gateway_plain_http is true but gateway_tls_cert_file or gateway_tls_ca_file is set: the front "
                           "speaks TLS or plain HTTP, not both; unset one")
    if own_ca is not None and cert is None:
        raise GatewayError("gateway_tls_ca_file is set without gateway_tls_cert_file: it names the CA of your own "
                           "certificate (the fleet CA's certificate is trusted without it)")
    client_ca, cert_sans = front_trust(data)[1], []
    if not plain_http and cert is None:  # the fleet CA's, for the host's names and the one address it listens on
        try:
            cert_sans = host_sans(host_name, data)
            if bind_address not in ("0.0.0.0", "::"):
                cert_sans += [n for n in sans_of([bind_address]) if n not in cert_sans]
        except FleetCAError as exc:
            raise GatewayError(f"the entrance's certificate: {exc}") from None
    if tls_key is not None and read_secrets:
        try:
            read_secret_file(tls_key, "gateway_tls_key_file")  # 0600, or refused with the reason
        except SecretError as exc:
            if "exactly one" not in str(exc):  # a PEM key has many lines: only the mode and presence matter
                raise GatewayError(str(exc)) from None
    return GatewayPlan(
        host=host_name,
        paths=gateway_paths(knob(data, "install_root")),
        bind_address=bind_address,
        port=knob(data, "gateway_port"),
        pip_index_url=knob(data, "gateway_pip_index_url"),
        health_check_interval_s=knob_int(data, "gateway_health_check_interval_s", minimum=1),
        num_retries=knob_int(data, "gateway_num_retries", minimum=0),
        ready_timeout_s=knob_int(data, "gateway_ready_timeout_s", minimum=1),
        score_sample_rate=score_sample_rate(data),
        rigs=tuple(rigs),
        install_roots=roots,
        clients=clients,
        rig_data=rig_data,
        tls_files=(str(cert), str(tls_key)) if cert is not None else None,
        plain_http=plain_http,
        client_ca=client_ca,
        cert_sans=tuple(cert_sans),
    )
