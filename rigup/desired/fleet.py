"""The user's fleet file (rigs.yaml): groups, hosts, SSH settings and per-host knob overrides.

Every key is checked against the knobs that group_data/all.py declares, so a typo fails with the
file, the host and the key instead of being silently ignored by pyinfra.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rigup import WORK_DIR
from rigup.desired.knobs import load_defaults

FLEET_ENV = "RIGUP_RIGS"
DEFAULT_FLEET_FILE = WORK_DIR / "rigs.yaml"

# Connection settings pyinfra's SSH connector reads from host data. Passwords are not accepted:
# they would sit in a plain file (use keys and passwordless sudo).
SSH_KEYS = frozenset(
    {
        "ssh_hostname",
        "ssh_port",
        "ssh_user",
        "ssh_key",
        "ssh_known_hosts_file",
        "ssh_strict_host_key_checking",
        "ssh_config_file",
        "ssh_connect_retries",
    }
)
PYINFRA_KEYS = frozenset({"_sudo"})

# Types of knobs whose default is None (the default's own type says nothing about them).
OPTIONAL_KNOB_TYPES: dict[str, tuple[type, ...]] = {
    "gpu_count": (int,),
    "gpu_power_cap_watts": (int,),
    "hf_token_file": (str,),
    "serving_api_key_file": (str,),
    "serving_health_timeout_s": (int, float),
    "model_fleet_address": (str,),
}
SSH_KEY_TYPES: dict[str, tuple[type, ...]] = {
    "ssh_port": (int,),
    "ssh_connect_retries": (int,),
}

GROUP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TOP_LEVEL_KEYS = frozenset({"data", "groups"})
GROUP_KEYS = frozenset({"data", "hosts"})


class FleetError(ValueError):
    """A fleet file that cannot be used; the message names the file, the host and the key."""


@dataclass(frozen=True)
class FleetHost:
    name: str
    group: str
    data: dict[str, Any]  # fleet-wide data, then group data, then the host's own keys


@dataclass(frozen=True)
class Fleet:
    path: Path
    groups: dict[str, list[FleetHost]] = field(default_factory=dict)

    @property
    def hosts(self) -> list[FleetHost]:
        return [host for members in self.groups.values() for host in members]

    def host(self, name: str) -> FleetHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise FleetError(f"{self.path}: no host named {name!r}")

    def pyinfra_groups(self) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        """Groups in the shape pyinfra's inventory files use: name -> [(host, host data)]."""
        return {
            group: [(host.name, dict(host.data)) for host in members]
            for group, members in self.groups.items()
        }

    def resolved_data(self, name: str) -> dict[str, Any]:
        """All knobs for one host: group_data/all.py defaults overlaid with the fleet's values."""
        return {**load_defaults(), **self.host(name).data}


def fleet_path() -> Path:
    """The fleet file to read: $RIGUP_RIGS, else rigs.yaml next to inventory.py."""
    configured = os.environ.get(FLEET_ENV)
    return Path(configured).expanduser().resolve() if configured else DEFAULT_FLEET_FILE


def load_fleet(path: Path | str | None = None) -> Fleet:
    path = Path(path) if path is not None else fleet_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        hint = f" (set {FLEET_ENV} or copy rigs.example.yaml to {DEFAULT_FLEET_FILE.name})"
        raise FleetError(f"{path}: fleet file not found{hint}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FleetError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(document, dict):
        raise FleetError(f"{path}: expected a mapping with 'groups' at the top level")
    _reject_unknown(path, "top level", document, TOP_LEVEL_KEYS)

    knobs = load_defaults()
    fleet_data = _checked_data(path, "data", document.get("data"), knobs)
    raw_groups = document.get("groups")
    if not isinstance(raw_groups, dict) or not raw_groups:
        raise FleetError(f"{path}: 'groups' must map at least one group name to its hosts")

    groups: dict[str, list[FleetHost]] = {}
    seen_hosts: dict[str, str] = {}
    for group_name, group in raw_groups.items():
        where = f"group {group_name!r}"
        if not isinstance(group_name, str) or not GROUP_NAME.match(group_name) or group_name == "all":
            raise FleetError(f"{path}: {where}: group names are identifiers other than 'all'")
        if not isinstance(group, dict):
            raise FleetError(f"{path}: {where}: expected a mapping with 'hosts'")
        _reject_unknown(path, where, group, GROUP_KEYS)
        group_data = _checked_data(path, f"{where} data", group.get("data"), knobs)
        hosts = group.get("hosts")
        if not isinstance(hosts, dict) or not hosts:
            raise FleetError(f"{path}: {where}: 'hosts' must map host names to their settings")
        members = []
        for host_name, host_values in hosts.items():
            if not isinstance(host_name, str) or not host_name:
                raise FleetError(f"{path}: {where}: host names must be non-empty strings")
            if host_name in seen_hosts:
                # pyinfra merges a host listed twice unpredictably (pyinfra#1756): refuse it.
                raise FleetError(
                    f"{path}: host {host_name!r} is listed in groups {seen_hosts[host_name]!r} "
                    f"and {group_name!r}; list each host once"
                )
            seen_hosts[host_name] = group_name
            own = _checked_data(path, f"host {host_name!r}", host_values, knobs, allow_ssh=True)
            members.append(FleetHost(host_name, group_name, {**fleet_data, **group_data, **own}))
        groups[group_name] = members
    return Fleet(path=path, groups=groups)


def _reject_unknown(path: Path, where: str, mapping: dict, allowed: frozenset[str]) -> None:
    for key in mapping:
        if key not in allowed:
            raise FleetError(f"{path}: {where}: unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")


def _checked_data(
    path: Path, where: str, values: Any, knobs: dict[str, Any], allow_ssh: bool = False
) -> dict[str, Any]:
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise FleetError(f"{path}: {where}: expected a mapping of settings, got {type(values).__name__}")
    for key, value in values.items():
        if key in knobs:
            _check_knob_type(path, where, key, value, knobs[key])
        elif key in PYINFRA_KEYS:
            _check_type(path, where, key, value, (bool,))
        elif key in SSH_KEYS:
            if not allow_ssh:
                raise FleetError(f"{path}: {where}: {key!r} is a per-host SSH setting; set it on the host")
            _check_type(path, where, key, value, SSH_KEY_TYPES.get(key, (str,)))
        else:
            raise FleetError(
                f"{path}: {where}: unknown key {key!r}: not a knob in group_data/all.py nor an SSH setting"
            )
    if "variant" in values:
        _check_variant(path, where, values["variant"])
    return dict(values)


def _check_knob_type(path: Path, where: str, key: str, value: Any, default: Any) -> None:
    if value is None:
        return  # None always means "use the built-in behaviour" for optional knobs
    if default is None:
        expected = OPTIONAL_KNOB_TYPES.get(key)
        if expected is not None:
            _check_type(path, where, key, value, expected)
        return
    expected_type: tuple[type, ...] = (type(default),)
    if isinstance(default, float):
        expected_type = (int, float)
    _check_type(path, where, key, value, expected_type)


def _check_type(path: Path, where: str, key: str, value: Any, expected: tuple[type, ...]) -> None:
    # bool is an int in Python; a YAML `true` for a number knob is still a mistake.
    if isinstance(value, bool) and bool not in expected:
        ok = False
    else:
        ok = isinstance(value, expected)
    if not ok:
        names = " or ".join(t.__name__ for t in expected)
        raise FleetError(f"{path}: {where}: {key!r} must be {names}, got {value!r}")


def _check_variant(path: Path, where: str, variant: Any) -> None:
    from rigup.desired.catalog import variant_names  # the catalog is only needed when a variant is set

    known = variant_names()
    if variant not in known:
        raise FleetError(f"{path}: {where}: 'variant' {variant!r} is not in the catalog (known: {', '.join(known)})")
