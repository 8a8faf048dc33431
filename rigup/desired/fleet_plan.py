"""The fleet's plan for one run: every host's roles and plans, and what the fleet's services see of it.

`plan_fleet(entries)` is built once per run: by the deploy from pyinfra's inventory
(rigup.runstate.fleet_plan(state)), by the CLI from the fleet file (`fleet_entries(fleet)`), through
this one function. Its FleetPlan holds, for each host:
  roles            rig, gateway, monitor, image mirror or relay, cluster member (rigup.desired.roles)
  pods             the plan of each pod, as a preview (rigup.desired.plan.host_plans: no GPU topology,
                   no secrets, the lock's pins where it has them); the serving task plans again with the
                   topology it reads
  models           the model plan: its manifest and, per model, the chain of rigs holding it
  mirror_pins      the images it pulls through its image mirror; registry: its registry's role
and for the fleet: the image chain (the registry hosts, the mirror first), each gateway's routes, each
monitor's targets, the clusters' members and each member's peers, and the lock needs `rigup lock` pins. Each host is planned once, when first asked for (hosts asking at
once wait for that one plan): planning the whole fleet costs linearly in its hosts (bench/plan_fleet.py),
and a command that asks about one host plans that one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rigup.desired.cluster import cluster_of
from rigup.desired.gateway import GatewayPlan, gateway_plan
from rigup.desired.image_mirror import MirrorRole, image_ref, local_registry, pinned_through, registry_role
from rigup.desired.knobs import knob, load_defaults
from rigup.desired.lock import LockError, LockFile, Need
from rigup.desired.models import ModelPlan, plan_models
from rigup.desired.monitoring import MonitorPlan, monitor_plan
from rigup.desired.needs import dashboard_needs, exporter_needs, needs_for
from rigup.desired.pins import merged_needs
from rigup.desired.plan import HostPlan, host_plan
from rigup.desired.pods import Pod
from rigup.desired.recipe import pods_of, resolve
from rigup.desired.roles import HostRoles, cluster_membership, host_roles, named_mirrors


@dataclass(frozen=True)
class FleetEntry:
    """One host as the run sees it."""

    name: str
    data: Mapping[str, Any]  # every knob (group_data/all.py defaults under the fleet file's values)
    groups: tuple[str, ...]
    handle: Any = None  # what a chain member carries to execution: pyinfra's Host in the deploy
    active: bool = True  # in this run (pyinfra: connected); only active rigs share chains


def fleet_entries(fleet: Any) -> list[FleetEntry]:
    """The entries of a fleet file (rigup.desired.fleet.Fleet), each host in its group, with every knob
    (what Fleet.resolved_data gives, without looking each host up by name: that is linear in the fleet)."""
    defaults = load_defaults()
    return [FleetEntry(h.name, {**defaults, **h.data}, (h.group,), handle=h.name) for h in fleet.hosts]


class HostFleetPlan:
    """One host's part of the FleetPlan: what its tasks read."""

    def __init__(self, fleet: FleetPlan, entry: FleetEntry, roles: HostRoles) -> None:
        self.fleet, self.entry, self.roles = fleet, entry, roles

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def data(self) -> Mapping[str, Any]:
        return self.entry.data

    @property
    def pods(self) -> list[HostPlan]:
        """Each pod's preview plan, in the order the host lists them; [] on a host that serves nothing.
        Raises RecipeError (and CatalogError) naming the host when a pod cannot be planned."""
        return self.fleet.pods(self.name)

    @property
    def models(self) -> ModelPlan:
        """The model plan; LockError (its message the lock's problem) when the host has no usable lock."""
        return self.fleet.models(self.name)

    @property
    def mirror_pins(self) -> list[str]:
        return self.fleet.mirror_pins(self.name)

    @property
    def registry(self) -> MirrorRole | None:
        """The registry of the fleet's images the host runs (the mirror's or a relay), or None."""
        return self.fleet.registry(self.name)

    def gateway(self, read_secrets: bool = True) -> GatewayPlan | None:
        """The gateway it runs over the fleet's rigs (None: not in gateway_group)."""
        return gateway_plan(self.name, self.data, self.entry.groups, self.fleet.named_data(), read_secrets=read_secrets)

    def monitor(self, read_secrets: bool = True) -> MonitorPlan | None:
        """The Prometheus it runs over the fleet's pods, exporters and gateways (None: not in monitor_group)."""
        return monitor_plan(self.name, self.data, self.entry.groups, self.fleet.named_groups(), read_secrets=read_secrets)


class FleetPlan:
    """Every host's roles and plans for one run (see the module's docstring). Build it with plan_fleet."""

    def __init__(self, entries: Iterable[FleetEntry]) -> None:
        self.entries = tuple(entries)
        mirrors = named_mirrors(e.data for e in self.entries)
        self._hosts = {e.name: HostFleetPlan(self, e, host_roles(e.name, e.data, e.groups, mirrors)) for e in self.entries}
        # each part planned once, when first asked for (a per-run object: it goes with its run)
        self._planned: dict[tuple[str, ...], Any] = {}
        # pyinfra loads every host's task files at once, each in its own greenlet (gevent has made threading's
        # locks greenlet locks there), and planning waits on git: a host asking for a part another host is
        # planning waits for it instead of planning it again. The CLI asks from threads.
        self._locks: dict[tuple[str, ...], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _once(self, key: tuple[str, ...], make: Callable[[], Any]) -> Any:
        """make(), once per key for this plan (an error is not kept: the next ask plans again)."""
        with self._locks_guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._planned:
                self._planned[key] = make()
            return self._planned[key]

    def host(self, name: str) -> HostFleetPlan:
        try:
            return self._hosts[name]
        except KeyError:
            raise KeyError(f"{name!r} is no host of this run (hosts: {', '.join(self._hosts)})") from None

    @property
    def hosts(self) -> list[HostFleetPlan]:
        return list(self._hosts.values())

    def roles(self, name: str) -> HostRoles:
        return self.host(name).roles

    def named_data(self) -> list[tuple[str, Mapping[str, Any]]]:
        """(name, data) of every host, in order: the shape the gateway and image mirror plans read."""
        return [(e.name, e.data) for e in self.entries]

    def named_groups(self) -> list[tuple[str, Mapping[str, Any], tuple[str, ...]]]:
        """(name, data, groups) of every host, in order: the shape the monitor and dashboard plans read."""
        return [(e.name, e.data, e.groups) for e in self.entries]

    def pods(self, name: str) -> list[HostPlan]:
        host = self.host(name)
        return [self.pod(name, pod) for pod in pods_of(host.data)] if host.roles.rig else []

    def pod(self, name: str, pod: Pod) -> HostPlan:
        """One pod's preview plan (rigup.desired.plan.host_plan); an error is raised again on every call."""
        return self._once(("pod", name, pod.name), lambda: host_plan(
            dict(self.host(name).data), name, read_secrets=False, require_lock=False, pod=pod))

    def models(self, name: str) -> ModelPlan:
        # every rig's at once: a model's chain holds every rig of the run that wants it
        rigs = [h for h in self.hosts if h.roles.rig]
        plans, problems = self._once(("models",), lambda: plan_models(
            (h.name, h.data, h.entry.handle, h.entry.active, self.pods(h.name)) for h in rigs))
        if name in problems:
            raise LockError(problems[name])
        if name not in plans:
            raise LockError(f"{name}: serves no variant, so it holds no model")
        return plans[name]

    def mirror_pins(self, name: str) -> list[str]:
        """What a host pulls through its image mirror (rigup.desired.image_mirror.pinned_through): every pod's
        image as locked, and the GPU smoke image unless it names its own registry. A host without a mirror,
        a variant or a usable lock pins nothing (its own run stops at the lock)."""
        return self._once(("pins", name), lambda: self._mirror_pins(name))

    def _mirror_pins(self, name: str) -> list[str]:
        host = self.host(name)
        registry = local_registry(host.data)
        if registry is None or not host.roles.rig:
            return []
        refs = {plan.recipe.image.ref for plan in self.pods(name) if plan.lock is not None}
        refs.add(image_ref(registry, str(knob(host.data, "gpu_smoke_image"))))  # another registry's: not kept
        return sorted(pin for ref in refs if (pin := pinned_through(ref, registry)) is not None)

    def registry(self, name: str) -> MirrorRole | None:
        return self._once(("registry", name), lambda: self._registry(name))

    def _registry(self, name: str) -> MirrorRole | None:
        host = self.host(name)
        if not host.roles.image_registry:
            return None
        # the mirror keeps its clients' pins, a relay its own
        wanted = [h.name for h in self.hosts if h.roles.rig] if host.roles.image_mirror else [name]
        pins = {other: self.mirror_pins(other) for other in wanted}
        # only the mirror's role reads the fleet (its clients): a relay's is its own
        return registry_role(name, host.data, self.named_data() if host.roles.image_mirror else (), pins)

    def image_chain(self) -> list[HostFleetPlan]:
        """Every host that runs a registry of the fleet's images with pins to keep, mirror hosts first: with
        nothing staged anywhere, the mirror is the chain's head and reads upstream."""
        members = [(h, role) for h in self.hosts if (role := self.registry(h.name)) is not None and role.keep]
        return [h for h, role in sorted(members, key=lambda m: m[1].is_relay)]

    def clusters(self) -> dict[str, list[str]]:
        """Each cluster of the fleet -> its members, in the fleet's order."""
        out: dict[str, list[str]] = {}
        for h in self.hosts:
            if h.roles.cluster is not None:
                out.setdefault(h.roles.cluster, []).append(h.name)
        return out

    def cluster_peers(self, name: str) -> dict[str, str]:
        """The other members of host `name`'s cluster, in the cluster's order, each as the fleet reaches it
        (its ssh_hostname, else its name); {} for a host in no cluster."""
        member = cluster_membership(self.host(name).data)
        if member is None:
            return {}
        return {peer: str(self.host(peer).data.get("ssh_hostname") or peer)
                for peer in cluster_of(member).hosts if peer != name}

    def lock_needs(self, lock: LockFile | None = None) -> tuple[dict[str, Need], str]:
        """Every need of every host of the fleet, by lock name, plus the fleet's lock_file knob value (what
        `rigup lock` pins): each rig's pods and GPU exporter, a Grafana monitor's dashboards whether it
        serves or not. Recipes are rendered from upstream at `lock`'s pins where it has them (what mounts
        which source depends on the recipe repository's commit), else at the refs' current commits."""
        fleet = self.named_groups()

        def host_needs(h: HostFleetPlan) -> list[Need]:
            needs = dashboard_needs(h.data, h.entry.groups, fleet)
            if h.roles.rig:
                needs += [n for pod in pods_of(h.data) for n in needs_for(resolve(h.data, lock, pod=pod), h.data)]
                needs += exporter_needs(h.data)
            return needs

        needs = merged_needs((h.name, host_needs(h)) for h in self.hosts)
        lock_files = {str(knob(h.data, "lock_file")) for h in self.hosts}
        if len(lock_files) > 1:
            raise LockError(f"hosts disagree on lock_file ({sorted(lock_files)}); set it once for the fleet")
        return needs, (lock_files.pop() if lock_files else "rigs.lock.yaml")

    def plan_everything(self) -> None:
        """Plan every host now (what a converge of the whole fleet asks for): pods, models, pins, registries."""
        for h in self.hosts:
            self.pods(h.name)
            self.mirror_pins(h.name)
        self.image_chain()
        for h in self.hosts:
            if h.roles.rig:
                try:
                    self.models(h.name)
                except LockError:  # its tasks say so; the others plan on
                    pass


def plan_fleet(entries: Iterable[FleetEntry]) -> FleetPlan:
    """The fleet's plan for one run (the deploy's and the CLI's): each host planned once, when first asked for."""
    return FleetPlan(entries)
