"""The fleet gateway: LiteLLM's proxy as one OpenAI endpoint over what the rigs actually serve.

What the control machine decides for a gateway host: where the proxy lives, which pinned venv it runs
from (files/gateway/requirements.txt, hash-pinned by scripts/gateway-lock), its systemd unit and its
environment file (the only place its keys are written), and the LiteLLM config.

Routes come from each rig's provenance record (the release that last passed rigup's health gate) and
whether that release's unit runs now, read on the rig at the end of the converge, never from the
fleet file's intent: a rig whose switch failed and rolled back keeps routing to what it serves again.
One route per rig and served model; rigs serving the same model share its name, so LiteLLM spreads
requests over them, retries another on failure, and its background health checks take a failing
route out of rotation (general_settings.enable_health_check_routing).
"""

from __future__ import annotations

import hashlib
import ipaddress
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import yaml

from rigup import DEPLOY_ROOT
from rigup.desired.knobs import knob, knob_int
from rigup.desired.roles import is_gateway, serves_variant
from rigup.desired.secrets import SecretError, load_api_key, read_secret_file
from rigup.desired.templating import render_template

REQUIREMENTS_FILE = DEPLOY_ROOT / "files" / "gateway" / "requirements.txt"
UNIT_NAME = "rigup-gateway.service"
UNIT_FILE = f"/etc/systemd/system/{UNIT_NAME}"
MASTER_KEY_ENV = "LITELLM_MASTER_KEY"
CONFIG_HEADER = "# Rendered by rigup from what each rig serves (provenance + running unit). Do not edit.\n"
# LiteLLM's provider for an OpenAI-compatible vLLM server (no model-cost lookups, no key format checks).
PROVIDER = "hosted_vllm"
LOCAL_HOST = "@local"  # pyinfra's local connector: the machine the deploy runs on


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


def litellm_version() -> str:
    found = re.search(r"^litellm==(\S+)", requirements_text(), re.MULTILINE)
    if found is None:
        raise GatewayError(f"{REQUIREMENTS_FILE}: no litellm== pin (run scripts/gateway-lock VERSION)")
    return found.group(1)


@dataclass(frozen=True)
class GatewayPaths:
    root: str  # {install_root}/gateway

    @property
    def config_file(self) -> str:
        return posixpath.join(self.root, "config.yaml")

    @property
    def env_file(self) -> str:
        return posixpath.join(self.root, "gateway.env")

    @property
    def requirements_file(self) -> str:
        return posixpath.join(self.root, f"requirements-{requirements_sha256()[:12]}.txt")

    @property
    def venv(self) -> str:
        """Named by the pin's hash: a new pin builds beside the running one, which keeps serving meanwhile."""
        return posixpath.join(self.root, f"venv-{requirements_sha256()[:12]}")


def gateway_paths(install_root: str) -> GatewayPaths:
    return GatewayPaths(posixpath.join(install_root.rstrip("/"), "gateway"))


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
    if name == LOCAL_HOST:
        return None
    return str(data.get("ssh_hostname") or name)


def config_document(routes: Iterable[Route], *, health_check_interval_s: int, num_retries: int) -> dict[str, Any]:
    """LiteLLM's proxy config: a deployment per route (rigup's fields in model_info identify it), the
    gateway key from the environment, background checks that route around a failing rig, retries."""
    model_list = [
        {
            "model_name": r.model,
            "litellm_params": {
                "model": f"{PROVIDER}/{r.model}",
                "api_base": r.api_base,
                # vLLM without --api-key accepts any bearer; the key itself stays in the environment file
                "api_key": f"os.environ/{r.key_env}" if r.key_env else "EMPTY",
            },
            "model_info": {"id": r.route_id, "rigup_host": r.host, "rigup_unit": r.unit, "rigup_variant": r.variant},
        }
        for r in sorted(routes, key=lambda r: (r.model, r.host, r.unit))
    ]
    return {
        "model_list": model_list,
        "router_settings": {
            "routing_strategy": "simple-shuffle",
            "num_retries": num_retries,
            # a route that fails once is cooled down at once, so the retry goes to another rig of the model
            # (LiteLLM never cools down the only deployment of a model)
            "allowed_fails": 0,
            # longer than the check interval, so a route the checks found failing stays out until re-checked
            "cooldown_time": 2 * health_check_interval_s,
        },
        "general_settings": {
            "master_key": f"os.environ/{MASTER_KEY_ENV}",
            "background_health_checks": True,
            "health_check_interval": health_check_interval_s,
            "enable_health_check_routing": True,
            "health_check_staleness_threshold": 3 * health_check_interval_s,
        },
        # prometheus: /metrics (behind the master key) for the fleet's Prometheus: each route's state,
        # failures, cooldowns and latency
        "litellm_settings": {"telemetry": False, "drop_params": True, "callbacks": ["prometheus"]},
    }


def config_text(routes: Iterable[Route], *, health_check_interval_s: int, num_retries: int) -> str:
    document = config_document(routes, health_check_interval_s=health_check_interval_s, num_retries=num_retries)
    return CONFIG_HEADER + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)


def routes_in_config(text: str | None) -> list[Route]:
    """The routes a config rigup wrote holds (for rigs outside this run: they keep theirs)."""
    if not text:
        return []
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError:
        return []
    routes = []
    for entry in (document or {}).get("model_list") or ():
        try:
            info, params = entry["model_info"], entry["litellm_params"]
            key = params.get("api_key")
            routes.append(
                Route(
                    host=str(info["rigup_host"]),
                    unit=str(info["rigup_unit"]),
                    variant=str(info["rigup_variant"]),
                    model=str(entry["model_name"]),
                    api_base=str(params["api_base"]),
                    key_env=key.removeprefix("os.environ/") if isinstance(key, str) and key.startswith("os.environ/") else None,
                )
            )
        except (KeyError, TypeError, AttributeError):
            continue  # not one of rigup's routes
    return routes


def env_text(master_key: str, rig_keys: Mapping[str, str], origins: Mapping[str, str] | None = None) -> str:
    """The gateway's environment file (0600): its own key and each rig's key, single-quoted for systemd.
    `origins`: variable -> where its value comes from, for the message when one cannot be written."""
    lines = []
    for name, value in [(MASTER_KEY_ENV, master_key), *sorted(rig_keys.items())]:
        if not value or any(c in value for c in "'\"\\\n\r\0$`"):
            where = (origins or {}).get(name, name)
            raise GatewayError(f"{where}: the key is empty or contains a quote, backslash, $, ` or newline")
        lines.append(f"{name}='{value}'\n")
    return "".join(lines)


def unit_text(paths: GatewayPaths, *, bind_address: str, port: int) -> str:
    return render_template(
        "rigup-gateway.service.j2", paths=paths, bind_address=bind_address, port=port, version=litellm_version()
    )


@dataclass(frozen=True)
class GatewayPlan:
    """What a gateway host gets: paths, listen address, keys, and the rigs it routes to."""

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
    env_text: str = field(repr=False)

    @property
    def readiness_url(self) -> str:
        address = "127.0.0.1" if self.bind_address in ("0.0.0.0", "::") else self.bind_address
        address = f"[{address}]" if ":" in address else address
        return f"http://{address}:{self.port}/health/readiness"


def gateway_plan(
    host_name: str,
    data: Mapping[str, Any],
    groups: Iterable[str],
    fleet: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    read_secrets: bool = True,
) -> GatewayPlan | None:
    """The gateway plan of one host (None: it is not in gateway_group). `fleet` is every host of the
    inventory with its data, in order; the ones that serve a variant become its rigs."""
    if not is_gateway(data, groups):
        return None
    key_file = knob(data, "gateway_api_key_file")
    if key_file is None:
        raise GatewayError(
            f"gateway_api_key_file is not set: a gateway host needs a 0600 file on the control machine holding "
            f"the key its clients send (group {knob(data, 'gateway_group')!r})"
        )
    rigs, roots, rig_keys = [], {}, {}
    origins = {MASTER_KEY_ENV: "gateway_api_key_file"}
    for name, rig_data in fleet:
        if not serves_variant(rig_data):
            continue
        try:
            key = load_api_key(rig_data) if read_secrets else None
        except SecretError as exc:
            raise GatewayError(f"the key of rig {name!r}, which the gateway routes to: {exc}") from None
        has_key = knob(rig_data, "serving_api_key_file") is not None
        if key is not None:
            rig_keys[key_env(name)] = key
            origins[key_env(name)] = f"serving_api_key_file of rig {name!r}"
        address = reach_address(name, rig_data, host_name)
        rigs.append(RigEndpoint(name, address, key_env(name) if has_key else None, name == host_name))
        roots[name] = knob(rig_data, "install_root")
    master = read_secret_file(key_file, "gateway_api_key_file") if read_secrets else "unread"
    return GatewayPlan(
        host=host_name,
        paths=gateway_paths(knob(data, "install_root")),
        bind_address=knob(data, "gateway_bind_address"),
        port=knob(data, "gateway_port"),
        pip_index_url=knob(data, "gateway_pip_index_url"),
        health_check_interval_s=knob_int(data, "gateway_health_check_interval_s", minimum=1),
        num_retries=knob_int(data, "gateway_num_retries", minimum=0),
        ready_timeout_s=knob_int(data, "gateway_ready_timeout_s", minimum=1),
        rigs=tuple(rigs),
        install_roots=roots,
        env_text=env_text(master, rig_keys, origins) if read_secrets else "",
    )
