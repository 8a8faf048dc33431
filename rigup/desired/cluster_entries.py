"""The fleet file's `clusters` entries, checked (rigup.desired.cluster has what a cluster is and does).

`parse_clusters` checks every entry against the catalog and the fleet's hosts and returns the clusters;
`variant_facts` is what the cluster rules read of a catalog variant. Apart from rigup.desired.cluster
because they read recipes (variant_overrides), while a recipe's render reads the cluster.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rigup.desired.catalog import closest_variants, load_catalog
from rigup.desired.cluster import (
    CLUSTER_KEYS,
    Cluster,
    ClusterError,
    VariantFacts,
    image_ray_version,
    positive_int,
    ray_refusal,
    refusals,
    split,
)
from rigup.desired.pods import POD_NAME, RESERVED_NAMES
from rigup.desired.recipe import RecipeError, check_overrides


def _entry_name(index: int, entry: Any) -> str:
    name = entry.get("name") if isinstance(entry, Mapping) else None
    return f"clusters[{index}]" + (f" ({name})" if isinstance(name, str) else "")


def _hosts(where: str, value: Any, known: Sequence[str]) -> tuple[str, ...]:
    shape = "a list of at least 2 host names of the fleet file, the head first (e.g. [rig-a, rig-b])"
    if not isinstance(value, list) or not all(isinstance(h, str) and h for h in value):
        raise ClusterError(f"{where}: hosts: must be {shape}, got {value!r}")
    if len(value) < 2:
        raise ClusterError(f"{where}: hosts: must be {shape}, got {value!r}: one host serves the variant as a pod")
    twice = sorted({h for h in value if value.count(h) > 1})
    if twice:
        raise ClusterError(f"{where}: hosts: {', '.join(twice)} listed twice in {value!r}; list each member once")
    unknown = [h for h in value if h not in known]
    if unknown:
        raise ClusterError(f"{where}: hosts: {', '.join(map(repr, unknown))} not a host of the fleet file "
                           f"(hosts: {', '.join(known) or 'none'})")
    return tuple(value)


IFNAME = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")  # Linux's IFNAMSIZ is 16 with the NUL


def parse_clusters(listed: Any, known_hosts: Iterable[str]) -> list[Cluster]:
    """The fleet file's `clusters`, in the order listed; [] when absent.

    Raises ClusterError (naming clusters[i] (name), the key, the value and what is allowed) on an entry that
    is not a mapping, an unknown or missing key, a bad or reserved name or one used twice, a variant the
    catalog lacks, bad variant_overrides, hosts that are not >= 2 distinct hosts of the fleet file, a host in
    two clusters, a gpus_per_host or port out of range, a split that does not fit (`split`) and anything
    vLLM cannot run across hosts (`refusals`, read from the catalog: a resolved recipe may add more)."""
    if listed is None or listed == []:
        return []
    if not isinstance(listed, list):
        raise ClusterError(f"clusters: must be a list of {{{', '.join(CLUSTER_KEYS)}}} entries, got {listed!r}")
    known = list(known_hosts)
    variants = tuple(load_catalog()["variants"])
    clusters: list[Cluster] = []
    names: dict[str, str] = {}
    members: dict[str, str] = {}
    for index, entry in enumerate(listed):
        where = _entry_name(index, entry)
        if not isinstance(entry, Mapping):
            raise ClusterError(f"{where}: must be a mapping with keys {', '.join(CLUSTER_KEYS)}, got {entry!r}")
        unknown = sorted(map(str, set(entry) - set(CLUSTER_KEYS)))
        if unknown:
            raise ClusterError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(CLUSTER_KEYS)}")
        for key in ("name", "variant", "hosts"):
            if key not in entry:
                raise ClusterError(f"{where}: {key!r} is required (keys: {', '.join(CLUSTER_KEYS)})")
        name = entry["name"]
        if not isinstance(name, str) or not POD_NAME.match(name) or name in RESERVED_NAMES:
            raise ClusterError(f"{where}: name: must be lowercase letters, digits and '-' (up to 40, not "
                               f"{', '.join(sorted(RESERVED_NAMES))}): it names the unit rigup-<name>.service on "
                               f"every member, got {name!r}")
        if name in names:
            raise ClusterError(f"{where}: name: {name!r} is already the name of {names[name]}")
        names[name] = where
        variant = entry["variant"]
        if variant not in variants:
            raise ClusterError(f"{where}: variant: {variant!r} is not in the catalog ({closest_variants(variant)})")
        hosts = _hosts(where, entry["hosts"], known)
        for host in hosts:
            if host in members:
                raise ClusterError(f"{where}: hosts: {host!r} is already a member of {members[host]}; a host "
                                   f"serves in at most one cluster")
            members[host] = where
        overrides = entry.get("variant_overrides") or {}
        if not isinstance(overrides, Mapping):
            raise ClusterError(f"{where}: variant_overrides: must be a mapping, got {overrides!r}")
        overrides = dict(overrides)
        if "port" in entry:
            port = entry["port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
                raise ClusterError(f"{where}: port: must be an integer port from 1 to 65535, got {port!r}")
            if "port" in overrides:
                raise ClusterError(f"{where}: the port is given twice ('port' and variant_overrides['port']): keep one")
            overrides["port"] = port
        try:
            facts = variant_facts(variant, overrides)
        except RecipeError as exc:
            raise ClusterError(f"{where}: variant_overrides: {exc}") from None
        refused = refusals(Cluster(name, str(variant), hosts, 1, overrides, index), facts)
        if refused:
            raise ClusterError(f"{where}: vLLM cannot serve variant {variant!r} across hosts: " + "; ".join(refused))
        old_ray = ray_refusal(Cluster(name, str(variant), hosts, 1, overrides, index), facts)
        if old_ray is not None:
            raise ClusterError(f"{where}: {old_ray}")
        if "gpus_per_host" in entry:
            gpus = entry["gpus_per_host"]
            if not positive_int(gpus):
                raise ClusterError(f"{where}: gpus_per_host: must be a positive integer (GPUs each member gives the "
                                   f"variant), got {gpus!r}")
        else:
            gpus = facts.tensor_parallel_size // len(hosts)
            if gpus < 1 or facts.tensor_parallel_size % len(hosts):
                raise ClusterError(
                    f"{where}: variant {variant!r} runs on {facts.tensor_parallel_size} GPU(s) "
                    f"(tensor_parallel_size), which {len(hosts)} hosts cannot share evenly: its GPU count must be "
                    f"gpus_per_host x {len(hosts)} hosts"
                )
        socket_interface = entry.get("socket_interface")
        if socket_interface is not None and (not isinstance(socket_interface, str)
                                             or not IFNAME.match(socket_interface)):
            raise ClusterError(f"{where}: socket_interface: must be a network interface's name (up to 15 letters, "
                               f"digits, '.', '-', '_', ':'; e.g. eth1), got {socket_interface!r}")
        cluster = Cluster(name, str(variant), hosts, gpus, overrides, index, socket_interface)
        split(cluster, facts)  # raises when the GPU count does not fit
        clusters.append(cluster)
    return clusters


def variant_facts(variant: str, overrides: Mapping[str, Any] | None = None) -> VariantFacts:
    """The catalog's facts of `variant` with `overrides` applied (RecipeError on bad overrides)."""
    values = check_overrides(variant, dict(overrides or {}))
    catalog = load_catalog()
    entry = catalog["variants"][variant]
    model = catalog["models"][entry["model"]]
    speculative = entry.get("speculative") or {}
    layers = model.get("num_hidden_layers")
    return VariantFacts(
        variant=variant,
        tensor_parallel_size=int(values["tensor_parallel_size"]),
        model=str(entry["model"]),
        image_repository=str(catalog["images"][entry["image"]]["repository"]),
        speculative_method=speculative.get("kind"),
        language_model_only=bool(entry["language_model_only"]),
        num_hidden_layers=layers if positive_int(layers) else None,
        image=str(entry["image"]),
        ray_version=image_ray_version(str(entry["image"])),
    )
