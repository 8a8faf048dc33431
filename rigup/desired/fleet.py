"""The user's fleet file (rigs.yaml): groups, hosts, SSH settings and per-host knob overrides.

Every key is checked against the knobs that group_data/all.py declares, and every value against what
that knob accepts (rigup.desired.knobs.check_knob; variant_overrides against the host's variant,
rigup.desired.recipe.check_overrides), so a typo or a bad value fails here, before anything connects,
with one message naming the file, the host (or `data` / the group), the key, the value and what is
allowed, instead of being silently ignored by pyinfra or failing mid-deploy.

A host named `@local` is pyinfra's local connector (the machine rigup runs on); unless the fleet file
sets `_sudo` for it, it gets `_sudo: true` only when the current user is not root.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rigup.desired.cluster import Cluster, ClusterError, cluster_knob
from rigup.desired.cluster_entries import parse_clusters
from rigup.desired.fleet_file import DEFAULT_FLEET_FILE, FLEET_ENV, fleet_path
from rigup.desired.image_mirror import MirrorError, resolve_mirrors
from rigup.desired.knobs import OPTIONAL_KNOB_TYPES as OPTIONAL_KNOB_TYPES  # moved to knobs; kept importable here
from rigup.desired.knobs import KnobError, check_knob, load_defaults, type_ok
from rigup.desired.pods import PodError, host_pods
from rigup.desired.recipe import RecipeError, check_overrides
from rigup.desired.roles import LOCAL_HOST
from rigup.desired.trust import TrustError, fleet_ca_bundle, use_fleet_bundle

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

SSH_KEY_TYPES: dict[str, tuple[type, ...]] = {
    "ssh_port": (int,),
    "ssh_connect_retries": (int,),
}
# What the numeric SSH settings accept beyond their type: (allowed, test).
SSH_KEY_RANGES: dict[str, tuple[str, Any]] = {
    "ssh_port": ("an integer port from 1 to 65535", lambda v: 1 <= v <= 65535),
    "ssh_connect_retries": ("an integer of at least 0", lambda v: v >= 0),
}


GROUP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
TOP_LEVEL_KEYS = frozenset({"data", "groups", "clusters"})
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
    clusters: list[Cluster] = field(default_factory=list)

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


# Where a message places a value given on the command line (`rigup doctor --data KEY=VALUE`).
COMMAND_LINE_DATA = "--data"


def load_fleet(path: Path | str | None = None, data: Mapping[str, Any] | None = None) -> Fleet:
    """The fleet file, every value checked before anything connects. `data`: a command's `--data`
    values, set on every host over the file's own (as pyinfra's --data) and checked exactly as the
    file's values are, variant_overrides against each host's own variant."""
    path = Path(path) if path is not None else fleet_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        hint = f" (set {FLEET_ENV} or copy rigs.example.yaml to {DEFAULT_FLEET_FILE.name})"
        raise FleetError(f"{path}: fleet file not found{hint}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise FleetError(f"{path}: not valid YAML{where}: {problem}") from None  # one line
    if not isinstance(document, dict):
        raise FleetError(f"{path}: expected a mapping with 'groups' at the top level")
    _reject_unknown(path, "top level", document, TOP_LEVEL_KEYS)

    knobs = load_defaults()
    fleet_data = _checked_data(path, "data", document.get("data"), knobs)
    command_data = _checked_data(path, COMMAND_LINE_DATA, dict(data) if data else None, knobs, allow_ssh=True)
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
            sections = (("data", fleet_data), (f"{where} data", group_data), (f"host {host_name!r}", own),
                        (COMMAND_LINE_DATA, command_data))
            host_data = {**fleet_data, **group_data, **own, **command_data}
            _check_host_overrides(path, host_name, host_data, sections, knobs)
            if host_name == LOCAL_HOST and "_sudo" not in host_data:
                host_data["_sudo"] = local_sudo()
            members.append(FleetHost(host_name, group_name, host_data))
        groups[group_name] = members
    clusters = _clusters(path, document.get("clusters"), groups)
    try:
        resolve_mirrors(path, {host.name: host.data for members in groups.values() for host in members})
    except MirrorError as exc:
        raise FleetError(str(exc)) from None
    try:  # the control machine's HTTPS clients (rigup lock, the upstream git cache) check against it from now on
        use_fleet_bundle(fleet_ca_bundle((host.data.get("ca_bundle") for members in groups.values() for host in members),
                                         path.parent, system=False))
    except TrustError as exc:
        raise FleetError(f"{path}: {exc}") from None
    return Fleet(path=path, groups=groups, clusters=clusters)


def _clusters(path: Path, listed: Any, groups: dict[str, list[FleetHost]]) -> list[Cluster]:
    """The fleet file's `clusters` (rigup.desired.cluster.parse_clusters), each member's data given the
    `cluster` knob: its entry and node rank. A member serves its cluster only: `pods` on it is refused."""
    hosts = {host.name: host for members in groups.values() for host in members}
    try:
        clusters = parse_clusters(listed, list(hosts))
    except ClusterError as exc:
        raise FleetError(f"{path}: {exc}") from None
    for cluster in clusters:
        for rank, name in enumerate(cluster.hosts):
            data = hosts[name].data
            if data.get("pods"):
                raise FleetError(f"{path}: host {name!r}: 'pods' is set, but the host is a member of {cluster.where}: "
                                 "a cluster member serves its cluster only (drop its pods, or the host from the cluster)")
            data["cluster"] = cluster_knob(cluster, rank)
    return clusters


def local_sudo() -> bool:
    """`_sudo` for the @local host: run through sudo unless rigup already runs as root."""
    return os.geteuid() != 0


def _check_host_overrides(
    path: Path, host_name: str, data: dict[str, Any], sections: tuple[tuple[str, dict[str, Any]], ...], knobs: dict[str, Any]
) -> None:
    """variant_overrides depend on the variant (its tensor parallel sizes, its model's context): check
    the host's merged pair with the one rule resolve() applies."""
    overrides = data.get("variant_overrides")
    pods = data.get("pods")
    if pods:
        origin = next(where for where, values in reversed(sections) if "pods" in values)
        if overrides:
            set_in = next(where for where, values in reversed(sections) if "variant_overrides" in values)
            raise FleetError(f"{path}: host {host_name!r}: 'variant_overrides' (set in {set_in}) beside 'pods' (set "
                             f"in {origin}): with pods, each pod takes its own variant_overrides")
        try:
            listed = host_pods(pods, None, {})
        except PodError as exc:  # the pods knob's own check has passed: this is the catalog's word
            raise FleetError(f"{path}: host {host_name!r} (pods set in {origin}): {exc}") from None
        for index, pod in enumerate(listed):
            try:
                check_overrides(pod.variant, pod.overrides)
            except RecipeError as exc:
                raise FleetError(f"{path}: host {host_name!r}: pods[{index}] ({pod.name}, set in {origin}): "
                                 f"variant_overrides: {exc}") from None
        return
    if not overrides:
        return
    variant = data.get("variant", knobs["variant"])
    try:
        check_overrides(variant, overrides)
    except RecipeError as exc:
        origin = next(where for where, values in reversed(sections) if "variant_overrides" in values)
        notes = [] if f"variant {variant!r}" in str(exc) else [f"variant {variant!r}"]
        if origin != f"host {host_name!r}":
            notes.append(f"variant_overrides set in {origin}")
        context = f" ({'; '.join(notes)})" if notes else ""
        raise FleetError(f"{path}: host {host_name!r}{context}: {exc}") from None


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
            try:
                check_knob(key, value)
            except KnobError as exc:
                raise FleetError(f"{path}: {where}: {exc}") from None
        elif key in PYINFRA_KEYS:
            _check_type(path, where, key, value, (bool,))
        elif key in SSH_KEYS:
            if not allow_ssh:
                raise FleetError(f"{path}: {where}: {key!r} is a per-host SSH setting; set it on the host")
            _check_type(path, where, key, value, SSH_KEY_TYPES.get(key, (str,)))
            if key in SSH_KEY_RANGES and not SSH_KEY_RANGES[key][1](value):
                raise FleetError(f"{path}: {where}: {key!r} must be {SSH_KEY_RANGES[key][0]}, got {value!r}")
        else:
            raise FleetError(f"{path}: {where}: {_unknown_key(key, knobs, allow_ssh)}")
    return dict(values)


def _unknown_key(key: Any, knobs: dict[str, Any], allow_ssh: bool) -> str:
    others = sorted(PYINFRA_KEYS | (SSH_KEYS if allow_ssh else frozenset()))
    close = difflib.get_close_matches(str(key), [*knobs, *SSH_KEYS, *PYINFRA_KEYS], n=3, cutoff=0.75)
    hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
    what = "a knob declared in group_data/all.py nor an SSH setting" if allow_ssh else "a knob declared in group_data/all.py"
    return f"unknown key {key!r}{hint}: not {what}; allowed here: those knobs, {', '.join(others)}"


def _check_type(path: Path, where: str, key: str, value: Any, expected: tuple[type, ...]) -> None:
    if not type_ok(value, expected):
        names = " or ".join(t.__name__ for t in expected)
        raise FleetError(f"{path}: {where}: {key!r} must be {names}, got {value!r}")
