"""The knobs group_data/all.py declares, with their defaults, for code that runs outside pyinfra.

pyinfra loads group_data itself during a deploy; the CLI tools (render, lock, doctor, status) and the
fleet file validation need the same names and defaults, so they read the one file the same way.
"""

from __future__ import annotations

import copy
import difflib
import functools
import ipaddress
import json
import re
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, get_args

import yaml

from rigup import DEPLOY_ROOT
from rigup.desired.alert_for import ALERT_FOR_S
from rigup.desired.catalog import closest_variants, load_catalog, variant_names
from rigup.desired.interconnect import MODES as INTERCONNECT_MODES
from rigup.desired.pods import pods_problem
from rigup.layout import RigLayout
from rigup.parsers.dpkg import DriverSource
from rigup.parsers.system import Flavour

KNOBS_FILE = DEPLOY_ROOT / "group_data" / "all.py"


@functools.cache
def _declared() -> dict[str, Any]:
    """Every name group_data/all.py assigns, pyinfra's global arguments (_sudo) included."""
    namespace: dict[str, Any] = {}
    exec(compile(KNOBS_FILE.read_text(), str(KNOBS_FILE), "exec"), namespace)
    return {
        name: value
        for name, value in namespace.items()
        if not name.startswith("__") and not isinstance(value, types.ModuleType)
    }


@functools.cache
def _defaults() -> dict[str, Any]:
    """The knobs proper (what a fleet file may set under its own names)."""
    return {name: value for name, value in _declared().items() if not name.startswith("_")}


def load_defaults() -> dict[str, Any]:
    """Knob name -> default value (a fresh copy: callers may mutate it)."""
    return copy.deepcopy(_defaults())


def declared_values(data: Any) -> dict[str, Any]:
    """What `data` (a mapping of host data) holds under the names group_data/all.py declares: all that
    knob() can return from it (a derived default is a function of these). Hosts that differ only in other
    data (their SSH settings) give equal dicts."""
    values = ((name, data.get(name, _UNSET)) for name in _declared())
    return {name: value for name, value in values if value is not _UNSET}


def parse_data_value(text: str) -> Any:
    """Parse a `--data key=value` value the way pyinfra's CLI does: bools, ints, JSON, else text. A
    mapping or list in YAML's flow style (`{port: 8001}`, `[0, 1]`), as the fleet file writes it, is
    read as YAML."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return json.loads(text)
    except ValueError:
        pass
    if text.strip().startswith(("{", "[")):
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            return text
        if isinstance(value, (dict, list)):
            return value
    return text


_UNSET = object()


def _model_dir(data: Any) -> str:
    return RigLayout(str(knob(data, "install_root"))).default_model_dir


# Knobs whose default follows other knobs: group_data/all.py declares them None (its comment says what
# None means) and knob() returns this function of the host's data instead, so every reader gets the
# derived value and an overridden install_root takes the models with it.
DERIVED_DEFAULTS: dict[str, Callable[[Any], Any]] = {
    "model_dir": _model_dir,  # <install_root>/models
    "monitor_group": lambda data: knob(data, "gateway_group"),  # Prometheus beside the gateway
}


def knob(data: Any, name: str) -> Any:
    """The host's value of knob `name`, else its one default in group_data/all.py (for a knob in
    DERIVED_DEFAULTS, None is derived from the host's other knobs).

    `data` is pyinfra's host.data or a mapping of knobs. Deploys already see every default (pyinfra
    loads group_data); partial mappings (a CLI preview, a test) get the same defaults from here, so
    no other module repeats one. An undeclared name is a programming error (KeyError)."""
    value = data.get(name, _UNSET)
    if value is _UNSET:
        value = _declared()[name]
    if value is None and name in DERIVED_DEFAULTS:
        return DERIVED_DEFAULTS[name](data)
    return value


def knob_int(data: Any, name: str, minimum: int) -> int:
    """knob() for an integer knob with a lower bound; KnobError naming the knob, the value and what is allowed."""
    value = knob(data, name)
    rule = _int_at_least(minimum)
    if not rule.test(value):
        raise KnobError(f"{name} must be {rule.allowed}, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------
# validation: what each knob accepts (the fleet file check and the CLI's --data use these)


class KnobError(ValueError):
    """A knob value rigup cannot use; the message names the knob, the value and what is allowed."""


@dataclass(frozen=True)
class Rule:
    allowed: str  # what the knob accepts, as the message says it: "one of auto, never"
    test: Callable[[Any], bool]
    problem: Callable[[str, Any], str] | None = None  # (knob, value) -> the message, when not "must be <allowed>"

    def message(self, name: str, value: Any) -> str:
        if self.problem is not None:
            return self.problem(name, value)
        return f"{name!r} must be {self.allowed}, got {value!r}"


# Types of knobs whose default is None (the default's own type says nothing about them).
OPTIONAL_KNOB_TYPES: dict[str, tuple[type, ...]] = {
    "gpu_count": (int,),
    "gpu_power_cap_watts": (int,),
    "hf_token_file": (str,),
    "ca_bundle": (str,),
    "serving_api_key_file": (str,),
    "serving_health_timeout_s": (int, float),
    "model_fleet_address": (str,),
    "gateway_api_key_file": (str,),
    "gateway_tls_cert_file": (str,),
    "gateway_tls_key_file": (str,),
    "gateway_tls_ca_file": (str,),
    "gateway_pip_index_url": (str,),
    "model_dir": (str,),
    "monitor_group": (str,),
    "alertmanager_webhook_url_file": (str,),
    "fleet_ca_cert_file": (str,),
    "fleet_ca_key_file": (str,),
    "fleet_ca_key_passphrase_file": (str,),
    "metrics_password_file": (str,),
    "cluster": (dict,),
    "image_mirror_host": (str,),
    "image_mirror": (dict,),
}

# Knobs with a non-None default that still take None (group_data/all.py says what None means).
NONE_ALLOWED = frozenset(
    {"gpu_power_cap_watts", "gpu_power_cap_by_model", "variant_overrides", "source_refs", "docker_insecure_registries"}
)

# Knobs that are paths on the rig: absolute, and of the character set the systemd unit renders unquoted
# (the pattern rigup.desired.recipe checks them against when it resolves a recipe).
RIG_PATH_KNOBS = ("install_root", "model_dir")
RIG_PATH = re.compile(r"^/[A-Za-z0-9._+/-]*$")
# container_registry: host[:port][/path], as rigup.desired.recipe prefixes image names with it.
REGISTRY = re.compile(r"[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._-]+)*/?")

# Enum knobs. Where the code that reads a knob sits below this module (parsers, interconnect) its set
# is imported; the others are declared here, and the checks and the models plan import them.
REBOOT_POLICIES: tuple[str, ...] = ("auto", "never")
VRAM_MISFIT_POLICIES: tuple[str, ...] = ("fail", "warn")
MODEL_FLEET_MODES: tuple[str, ...] = ("auto", "off")

URL_KNOBS = (
    "nvidia_cuda_repo_url",
    "nvidia_cuda_repo_key_url",
    "docker_apt_url",
    "docker_apt_key_url",
    "nvidia_ctk_apt_url",
    "nvidia_ctk_apt_key_url",
    "hf_endpoint",
    "gateway_pip_index_url",
    "grafana_apt_url",
    "grafana_apt_key_url",
)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://\S+$")
# registry[:port]/repository:tag, as the GPU exporter's image is named (its registry is not Docker Hub).
IMAGE_REFERENCE = re.compile(r"[A-Za-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def _is_listen_address(value: Any) -> bool:
    if not isinstance(value, str) or ":" not in value:
        return False
    address, _, port = value.rpartition(":")
    address = address.removeprefix("[").removesuffix("]")
    return port.isdigit() and 1 <= int(port) <= 65535 and _is_ip(address)


def url_host(address: str) -> str:
    """`address` as the host part of a URL: an IPv6 address in brackets, anything else as it is."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def is_strict_int(value: Any) -> bool:
    """Whether `value` is an int and not a bool (YAML's true is not a port number)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _one_of(values: Iterable[str]) -> Rule:
    values = tuple(values)
    return Rule(f"one of {', '.join(values)}", lambda v: isinstance(v, str) and v in values)


def _int_at_least(minimum: int) -> Rule:
    return Rule(f"an integer of at least {minimum}", lambda v: is_strict_int(v) and v >= minimum)


def _text(what: str = "a non-empty string") -> Rule:
    return Rule(what, lambda v: isinstance(v, str) and bool(v.strip()))


def _list_of_text(what: str, non_empty: bool = False) -> Rule:
    return Rule(
        what,
        lambda v: isinstance(v, list)
        and (bool(v) or not non_empty)
        and all(isinstance(i, str) and i.strip() for i in v),
    )


def _is_ip(value: Any) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _rig_path() -> Rule:
    return Rule(
        "an absolute path on the rig (letters, digits and ._+-/, no '..'; e.g. /opt/rigup)",
        lambda v: isinstance(v, str) and bool(RIG_PATH.match(v)) and ".." not in v.split("/"),
    )


def _registry() -> Rule:
    return Rule(
        "a registry host, host[:port][/path] (e.g. docker.io, mirror.lan:5000)",
        lambda v: isinstance(v, str) and bool(REGISTRY.fullmatch(v)),
    )


def _source_refs() -> Rule:
    sources = tuple(sorted(load_catalog()["sources"]))
    return Rule(
        f"a mapping of source name ({', '.join(sources)}) to a branch, tag or commit",
        lambda v: isinstance(v, Mapping)
        and all(k in sources and isinstance(ref, str) and ref.strip() for k, ref in v.items()),
    )


def _variant() -> Rule:
    names = tuple(variant_names())
    return Rule(
        "a catalog variant (`rigup render --list` lists them)",
        lambda v: v in names,
        lambda name, v: f"{name!r} {v!r} is not in the catalog ({closest_variants(v)})",
    )


def _pods() -> Rule:
    return Rule(
        "a list of {name, variant, gpus, port, variant_overrides} mappings (see rigs.example.yaml)",
        lambda v: pods_problem(v) is None,
        lambda name, v: f"{name!r}: {pods_problem(v)}",
    )


def _alert_for() -> Rule:
    def problem(v: Any) -> str | None:
        if not isinstance(v, Mapping):
            return None
        for name, seconds in v.items():
            if name not in ALERT_FOR_S:
                close = difflib.get_close_matches(str(name), list(ALERT_FOR_S), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                return f"{name!r} is not a rigup alert that waits before it fires ({hint}those that do: {', '.join(ALERT_FOR_S)})"
            if not is_strict_int(seconds) or seconds < 0:
                return f"{name!r}: must be whole seconds, 0 or more, got {seconds!r}"
        return None

    return Rule(
        "a mapping of alert name (RigupPodDown, RigupGpuHot, ...) to whole seconds (e.g. {RigupReleaseDrift: 1800})",
        lambda v: isinstance(v, Mapping) and problem(v) is None,
        lambda name, v: f"{name!r}: {problem(v)}",
    )


FIREWALL_ALLOW_FORM = "a list of \"NETWORK\" or \"NETWORK PORT[-PORT]\" strings, e.g. [\"192.168.1.0/24\", \"10.8.0.5 8000-8100\"]"


def allow_problem(entry: Any) -> str | None:
    """Why one firewall_allow entry is unusable (None: it is fine)."""
    if not isinstance(entry, str) or not entry.split():
        return f"{entry!r} is not a string"
    words = entry.split()
    if len(words) > 2:
        return f"{entry!r} has {len(words)} words (a network, then at most one port or range)"
    try:
        ipaddress.ip_network(words[0], strict=False)
    except ValueError:
        return f"{words[0]!r} in {entry!r} is not an address or network"
    if len(words) == 2:
        bounds = words[1].split("-")
        if (len(bounds) > 2 or not all(b.isdigit() and 1 <= int(b) <= 65535 for b in bounds)
                or (len(bounds) == 2 and int(bounds[0]) > int(bounds[1]))):
            return f"{words[1]!r} in {entry!r} is not a port (1-65535) or a range a-b"
    return None


def _firewall_allow() -> Rule:
    def problem(name: str, value: Any) -> str:
        found = [p for e in value if (p := allow_problem(e)) is not None] if isinstance(value, list) else []
        return f"{name!r}: {found[0] if found else f'{value!r} is not a list'}; it takes {FIREWALL_ALLOW_FORM}"

    return Rule(FIREWALL_ALLOW_FORM, lambda v: isinstance(v, list) and all(allow_problem(e) is None for e in v), problem)


@functools.cache
def _rule_table() -> dict[str, Rule]:
    """Knob name -> what it accepts beyond its type."""
    port = Rule("an integer port from 1 to 65535", lambda v: is_strict_int(v) and 1 <= v <= 65535)
    table: dict[str, Rule] = {
        "firewall_allow": _firewall_allow(),
        "variant": _variant(),
        "pods": _pods(),
        # the fleet file's loader sets it on each client of an image_mirror_host, after these checks
        "image_mirror": Rule("set from image_mirror_host, not by hand (image_mirror_host: the fleet host running "
                             "the mirror)", lambda v: v is None),
        # the fleet file's loader sets it on each member of a `clusters` entry, after these checks
        "cluster": Rule(
            "set from the fleet file's top-level `clusters` list, not by hand (clusters: [{name, variant, hosts, "
            "gpus_per_host, port, variant_overrides}])",
            lambda v: v is None,
        ),
        "gpu_count": _int_at_least(1),
        "variant_overrides": Rule("a mapping of variant_overrides keys to values", lambda v: isinstance(v, Mapping)),
        "preflight_os_allowed": Rule(
            'a list of "<os-release ID> <VERSION_ID>" strings (e.g. "ubuntu 24.04")',
            lambda v: isinstance(v, list) and all(isinstance(i, str) and len(i.split()) == 2 for i in v),
        ),
        "preflight_disk_margin_gb": Rule("a number of GB, 0 or more", lambda v: _is_number(v) and v >= 0),
        "preflight_vram_misfit": _one_of(VRAM_MISFIT_POLICIES),
        "nvidia_driver_branch": Rule("a driver branch number (e.g. 580)", lambda v: is_strict_int(v) and v >= 1),
        "nvidia_driver_flavour": _one_of(get_args(Flavour)),
        "nvidia_driver_source": _one_of(get_args(DriverSource)),
        "driver_reboot": _one_of(REBOOT_POLICIES),
        "driver_reboot_timeout_s": _int_at_least(1),
        "gpu_power_cap_watts": _int_at_least(1),
        "gpu_power_cap_by_model": Rule(
            "a mapping of GPU model name (as nvidia-smi names it) to watts (an integer of at least 1, or null)",
            lambda v: isinstance(v, Mapping)
            and all(isinstance(k, str) and (w is None or (is_strict_int(w) and w >= 1)) for k, w in v.items()),
        ),
        "gpu_interconnect": _one_of(INTERCONNECT_MODES),
        "docker_packages": _list_of_text("a non-empty list of apt package names", non_empty=True),
        "docker_insecure_registries": _list_of_text('a list of "host:port" registries'),
        "nvidia_ctk_packages": _list_of_text("a non-empty list of apt package names", non_empty=True),
        "gpu_smoke_image": _text("an image reference (e.g. nvidia/cuda:12.6.0-base-ubuntu22.04)"),
        "container_registry": _registry(),
        "image_mirror_host": _text("a host name of the fleet file"),
        "image_mirror_port": port,
        "image_mirror_max_gb": Rule("a number of GB above 0", lambda v: _is_number(v) and v > 0),
        "source_refs": _source_refs(),
        "hf_token_file": _text("a file path on the control machine"),
        "ca_bundle": _text("a PEM file path on the control machine"),
        "lock_file": _text("a file path on the control machine"),
        "fleet_ca_dir": _text("a directory path on the control machine (relative: to the fleet file's directory)"),
        "fleet_ca_cert_file": _text("a file path on the control machine"),
        "fleet_ca_key_file": _text("a file path on the control machine"),
        "fleet_ca_key_passphrase_file": _text("a file path on the control machine"),
        "fleet_cert_days": _int_at_least(2),
        "fleet_cert_renew_days": _int_at_least(1),
        "metrics_password_file": _text("a file path on the control machine"),
        "model_download_retries": _int_at_least(1),
        "model_fleet_source": _one_of(MODEL_FLEET_MODES),
        "model_fleet_port": port,
        "model_fleet_address": _text("a host name or IP address"),
        "serving_bind_address": Rule("an IP address (e.g. 0.0.0.0, 127.0.0.1)", _is_ip),
        "serving_api_key_file": _text("a file path on the control machine"),
        "serving_health_timeout_s": Rule("a number of seconds above 0", lambda v: _is_number(v) and v > 0),
        "serving_keep_generations": _int_at_least(1),
        "gateway_group": _text("a group name of the fleet file"),
        "gateway_bind_address": Rule("an IP address (e.g. 0.0.0.0, 127.0.0.1)", _is_ip),
        "gateway_port": port,
        "gateway_api_key_file": _text("a file path on the control machine"),
        "gateway_clients": Rule("a list of {name, key_file}", lambda v: isinstance(v, list)),
        "gateway_tls_cert_file": _text("a file path on the control machine"),
        "gateway_tls_key_file": _text("a file path on the control machine"),
        "gateway_tls_ca_file": _text("a file path on the control machine"),
        "gateway_health_check_interval_s": _int_at_least(1),
        "gateway_num_retries": _int_at_least(0),
        "gateway_ready_timeout_s": _int_at_least(1),
        "gateway_score_sample_rate": Rule("a share of completions from 0 to 1 (0: none scored)",
                                          lambda v: _is_number(v) and 0 <= v <= 1),
        "node_exporter_port": port,
        "gpu_exporter_image": Rule(
            "an image reference registry/repository:tag (e.g. nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-ubuntu22.04)",
            lambda v: isinstance(v, str) and bool(IMAGE_REFERENCE.fullmatch(v)),
        ),
        "gpu_exporter_port": port,
        "monitor_group": _text("a group name of the fleet file"),
        "prometheus_listen_address": Rule(
            "host:port Prometheus listens on (e.g. 0.0.0.0:9090, 127.0.0.1:9090)", _is_listen_address
        ),
        "prometheus_retention": Rule(
            "a Prometheus duration, a number and a unit of y, w, d, h, m (e.g. 15d, 4w)",
            lambda v: isinstance(v, str) and bool(re.fullmatch(r"[1-9][0-9]*[ywdhm]", v)),
        ),
        "prometheus_scrape_interval_s": _int_at_least(1),
        "metrics_facts_interval_s": _int_at_least(5),
        "sentinel_interval_s": _int_at_least(5),
        "sentinel_fail_after": _int_at_least(1),
        "sentinel_pass_after": _int_at_least(1),
        "alert_ttft_p95_s": Rule("a number of seconds above 0", lambda v: _is_number(v) and v > 0),
        "alert_gpu_temp_c": Rule("a temperature in C from 40 to 110", lambda v: _is_number(v) and 40 <= v <= 110),
        "alert_disk_free_ratio": Rule("a fraction above 0 and below 1 (e.g. 0.1)", lambda v: _is_number(v) and 0 < v < 1),
        "alert_for_s": _alert_for(),
        "alertmanager_webhook_url_file": _text("a file path on the control machine"),
        "alertmanager_port": port,
        "grafana_port": port,
        "cluster_ray_port": port,
        "cluster_ray_node_manager_port": port,
        "cluster_ray_object_manager_port": port,
        "cluster_ray_agent_port": Rule("an integer port from 1 to 65532 (it and the next 3 are used)",
                                       lambda v: is_strict_int(v) and 1 <= v <= 65532),
        "cluster_ray_worker_ports": Rule(
            "[first, last]: two integer ports from 1 to 65535, first <= last, at least 16 apart (one per Ray worker process)",
            lambda v: isinstance(v, list) and len(v) == 2 and all(is_strict_int(p) and 1 <= p <= 65535 for p in v)
            and v[1] - v[0] >= 15,
        ),
        "vllm_dashboards_path": Rule(
            "a directory of the vLLM repository, relative, without '..' (e.g. examples/observability/dashboards/grafana)",
            lambda v: isinstance(v, str) and bool(re.fullmatch(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*", v))
            and ".." not in v.split("/"),
        ),
        "rollout_canary_group": _text("a group name of the fleet file"),
        "rollout_batch": _int_at_least(1),
        "rollout_max_failures": _int_at_least(0),
    }
    for name in RIG_PATH_KNOBS:
        table[name] = _rig_path()
    url = Rule(
        "a URL, scheme://host/path (e.g. https://mirror.lan/ubuntu)", lambda v: isinstance(v, str) and bool(_URL.match(v))
    )
    git_url = Rule("a git URL (no spaces)", lambda v: isinstance(v, str) and bool(v.strip()) and not re.search(r"\s", v))
    table.update({name: url for name in URL_KNOBS})
    # pip prints and runs with the URL: a password in it would reach the command line and the output.
    # None (the default) passes no --index-url: pip's own config on the gateway host decides.
    table["gateway_pip_index_url"] = Rule(
        "a URL without credentials, scheme://host/path (e.g. https://pypi.org/simple; a private index's "
        "credentials belong in pip's own config on the gateway host), or None for pip's own config",
        lambda v: isinstance(v, str) and bool(_URL.match(v)) and "@" not in v.split("://", 1)[-1].split("/", 1)[0],
        # the value is not echoed: it may hold a password
        lambda name, v: f"{name!r} must be a URL without credentials (user:password@ is not accepted: pip would "
        "show it on its command line and in the deploy's output; put a private index's credentials in pip's own "
        "config on the gateway host), e.g. https://pypi.org/simple, or None to use pip's own config",
    )
    table.update({name: git_url for name in _defaults() if name.endswith("_git_url")})
    return table


def rules() -> dict[str, Rule]:
    """The rules of the knobs group_data/all.py declares (a rule for a knob it no longer declares is
    dropped; undeclared_rules() names them, and a test fails on any)."""
    declared = _defaults()
    return {name: rule for name, rule in _rule_table().items() if name in declared}


def undeclared_rules() -> list[str]:
    """Knobs with a rule here that group_data/all.py does not declare (should be none)."""
    return sorted(set(_rule_table()) - set(_defaults()))


def expected_types(name: str) -> tuple[type, ...] | None:
    """The Python types a knob's value may have (from its default), None when anything goes."""
    default = _defaults()[name]
    if default is None:
        return OPTIONAL_KNOB_TYPES.get(name)
    if isinstance(default, float):
        return (int, float)
    return (type(default),)


def type_ok(value: Any, expected: tuple[type, ...]) -> bool:
    # bool is an int in Python; a YAML `true` for a number knob is still a mistake.
    if isinstance(value, bool) and bool not in expected:
        return False
    return isinstance(value, expected)


def check_knob(name: str, value: Any) -> Any:
    """Validate one knob's value: its type, then its rule. Returns the value; raises KnobError naming the
    knob, the value and what is allowed (variant_overrides' entries depend on the variant: see
    rigup.desired.recipe.check_overrides)."""
    defaults = _defaults()
    if name not in defaults:
        raise KnobError(f"unknown knob {name!r} (not declared in group_data/all.py)")
    rule = rules().get(name)
    if value is None:
        if defaults[name] is None or name in NONE_ALLOWED:
            return value  # None means "the built-in behaviour" (group_data/all.py says which)
        raise KnobError(f"{name!r} must be {rule.allowed if rule else type(defaults[name]).__name__}, got None")
    expected = expected_types(name)
    if expected is not None and not type_ok(value, expected):
        names = " or ".join(t.__name__ for t in expected)
        hint = f" (allowed: {rule.allowed})" if rule is not None else ""
        raise KnobError(f"{name!r} must be {names}, got {value!r}{hint}")
    if rule is not None and not rule.test(value):
        raise KnobError(rule.message(name, value))
    return value
