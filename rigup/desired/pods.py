"""Pods: the serving endpoints of one host, each a variant on GPUs of its own.

A host serves one variant on its first GPUs (`variant:`, the simple form), or several pods (`pods:`):

    pods:
      - {name: left, variant: dual, gpus: [0, 1], port: 8020}
      - {name: right, variant: dual, gpus: [2, 3], port: 8021}

Each pod has its own directory (`{install_root}/variants/<pod>`), unit (`rigup-<pod>.service`),
compose project and container (`rigup-<pod>`), generations, health gate and provenance record
(`{install_root}/state/pods/<pod>/provenance.json`), and a device reservation of exactly its GPUs.
Without `pods` the host's one pod is named after its variant and everything stays where it was.

`host_pods(pods, variant, variant_overrides)` gives a host's pods from those three knobs (raising
PodError on bad entries, naming the entry and key; rigup.desired.plan.pods_of reads them from host
data); `pod_data(host_data, pod)` the knobs a pod's recipe resolves from.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rigup.desired.catalog import closest_variants, load_catalog

POD_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
POD_KEYS = ("name", "variant", "gpus", "port", "variant_overrides")
# rigup's other units: rigup-gateway.service (the fleet gateway), rigup-gpu-power.service (power cap at boot)
RESERVED_NAMES = frozenset({"gateway", "gpu-power"})


class PodError(ValueError):
    """A `pods` entry rigup cannot use; the message names the entry, the key and what is allowed."""


@dataclass(frozen=True)
class Pod:
    name: str  # directory, unit, compose project and container suffix
    variant: str
    gpus: tuple[int, ...] | None  # GPU indices it owns; None: the host's first GPUs (the simple form)
    overrides: Mapping[str, Any]  # variant_overrides of this pod (a `port` entry included)
    listed: bool  # from the pods knob (its own state directory and release fields) or the simple form
    cluster: Mapping[str, Any] | None = None  # the host's `cluster` knob: this pod is its share of a cluster

    @property
    def unit(self) -> str:
        return f"rigup-{self.name}.service"

    def target(self, host: str) -> str:
        """How the CLI names it: "<host>/<pod>" for a listed pod, the host's name in the simple form."""
        return f"{host}/{self.name}" if self.listed else host

    def label(self) -> str:
        """How messages name it: "pod left (dual)" or, in the simple form, "variant dual"."""
        return f"pod {self.name} ({self.variant})" if self.listed else f"variant {self.variant}"


def _entry_name(index: int, entry: Any) -> str:
    name = entry.get("name") if isinstance(entry, Mapping) else None
    return f"pods[{index}]" + (f" ({name})" if isinstance(name, str) else "")


def _gpu_indices(where: str, value: Any) -> tuple[int, ...] | int:
    if isinstance(value, bool) or value is None:
        raise PodError(f"{where}: 'gpus' must be a list of GPU indices (e.g. [0, 1]) or a count (e.g. 2), got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise PodError(f"{where}: 'gpus' count must be at least 1, got {value}")
        return value
    if not isinstance(value, list) or not value or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise PodError(f"{where}: 'gpus' must be a list of GPU indices (e.g. [0, 1]) or a count (e.g. 2), got {value!r}")
    if len(set(value)) != len(value):
        raise PodError(f"{where}: 'gpus' lists a GPU twice: {value}")
    return tuple(value)


def host_pods(listed: Any, variant: Any, variant_overrides: Any) -> list[Pod]:
    """The host's pods, in the order listed: the pods knob's entries, else one pod named after `variant`.

    A pod given a GPU count takes the lowest indices no listed pod names, in order. Raises PodError on
    an entry that is not a mapping, an unknown or missing key, a bad name, a name or GPU used twice, or
    a port given both as `port` and in `variant_overrides`."""
    if not listed:
        return [Pod(str(variant), str(variant), None, variant_overrides or {}, False)]
    if not isinstance(listed, list):
        raise PodError(f"pods must be a list of {{name, variant, gpus, port, variant_overrides}} entries, got {listed!r}")
    if variant_overrides:
        raise PodError("variant_overrides is set beside pods: with pods, each pod takes its own variant_overrides")
    catalog = load_catalog()["variants"]
    variants = tuple(catalog)
    entries: list[tuple[str, str, tuple[int, ...] | int, dict[str, Any]]] = []
    names: set[str] = set()
    for index, entry in enumerate(listed):
        where = _entry_name(index, entry)
        if not isinstance(entry, Mapping):
            raise PodError(f"{where} must be a mapping with keys {', '.join(POD_KEYS)}, got {entry!r}")
        unknown = sorted(set(entry) - set(POD_KEYS))
        if unknown:
            raise PodError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; allowed: {', '.join(POD_KEYS)}")
        for key in ("name", "variant", "gpus"):
            if key not in entry:
                raise PodError(f"{where}: {key!r} is required (keys: {', '.join(POD_KEYS)})")
        name = entry["name"]
        if not isinstance(name, str) or not POD_NAME.match(name) or name in RESERVED_NAMES:
            raise PodError(f"{where}: 'name' must be lowercase letters, digits and '-' (up to 40, not "
                           f"{', '.join(sorted(RESERVED_NAMES))}): it names the unit rigup-<name>.service, got {name!r}")
        if name in names:
            raise PodError(f"{where}: pod name {name!r} is used twice")
        names.add(name)
        if entry["variant"] not in variants:
            raise PodError(f"{where}: 'variant' {entry['variant']!r} is not in the catalog ({closest_variants(entry['variant'])})")
        overrides = entry.get("variant_overrides") or {}
        if not isinstance(overrides, Mapping):
            raise PodError(f"{where}: 'variant_overrides' must be a mapping, got {overrides!r}")
        overrides = dict(overrides)
        if "port" in entry:
            port = entry["port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise PodError(f"{where}: 'port' must be an integer port from 1 to 65535, got {port!r}")
            if "port" in overrides:
                raise PodError(f"{where}: the port is given twice ('port' and variant_overrides['port']): keep one")
            overrides["port"] = port
        entries.append((name, str(entry["variant"]), _gpu_indices(where, entry["gpus"]), overrides))

    taken: dict[int, str] = {}
    for name, _, gpus, _ in entries:
        for gpu in gpus if isinstance(gpus, tuple) else ():
            if gpu in taken:
                raise PodError(f"pods: GPU {gpu} is given to both {taken[gpu]} and {name}")
            taken[gpu] = name
    pods = []
    for name, variant, gpus, overrides in entries:
        if isinstance(gpus, int):  # a count: the lowest free indices
            free = [i for i in range(len(taken) + gpus) if i not in taken][:gpus]
            for gpu in free:
                taken[gpu] = name
            gpus = tuple(free)
        pods.append(Pod(name, variant, gpus, overrides, True))
    # Ports the catalog knows (a variant's own, or the pod's): two pods of one variant need a port each.
    known = [(pod, pod.overrides.get("port", catalog[pod.variant].get("port"))) for pod in pods]
    clashes = ports_used_twice([(pod, port) for pod, port in known if isinstance(port, int)])
    if clashes:
        raise PodError(f"pods: {clashes[0]}: give each pod its own 'port'")
    return pods


def pods_problem(value: Any) -> str | None:
    """Why a value of the pods knob cannot be used, or None (the fleet file check)."""
    try:
        host_pods(value, None, {})
    except PodError as exc:
        return str(exc)
    return None


def pod_data(host_data: Mapping[str, Any], pod: Pod) -> dict[str, Any]:
    """The knobs `pod`'s recipe resolves from: the host's, with the pod's variant and overrides."""
    data = dict(host_data)
    if not pod.listed:
        return data  # the simple form: the host's own variant and variant_overrides
    data["variant"] = pod.variant
    data["variant_overrides"] = dict(pod.overrides)
    return data


def ports_used_twice(pods_ports: list[tuple[Pod, int]]) -> list[str]:
    """Problems of host ports that two pods publish: 'port 8020: pod a (dual) and pod b (dual)'."""
    seen: dict[int, Pod] = {}
    problems = []
    for pod, port in pods_ports:
        if port in seen:
            problems.append(f"port {port} is published by both {seen[port].label()} and {pod.label()}")
        else:
            seen[port] = pod
    return problems
