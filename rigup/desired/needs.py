"""What a host needs pinned, collected from the features that need it: each pod's image, git sources
and models (the recipe), the rig's GPU exporter image (metrics), a Grafana monitor's vLLM dashboards.

The lock file itself (rigup.desired.lock) is data below every feature: pins, needs as records, whether
a lock serves a need. This module sits above the features and asks each what it needs, so that a
feature can read the lock's types without the lock importing it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rigup.desired.catalog import load_catalog
from rigup.desired.dashboards import served_vllm_refs, vllm_lock_name
from rigup.desired.image_mirror import insecure_registries
from rigup.desired.knobs import knob
from rigup.desired.lock import GitNeed, ImageNeed, LockFile, ModelNeed, Need, need_problem
from rigup.desired.monitoring import rig_exporters
from rigup.desired.roles import is_monitor


def model_revision_wanted(model_key: str) -> str:
    """The revision the catalog asks for (a `revision:` on the model entry, else "main")."""
    spec = load_catalog()["models"].get(model_key) or {}
    return str(spec.get("revision") or "main")


def needs_for(recipe: Any, host_data: Mapping[str, Any]) -> list[Need]:
    """Everything the recipe's variant pulls from outside, as lock entries to have. The image is pinned at
    container_registry, the registry the pin is true of, even when the rig pulls it through the fleet's
    image mirror (which may not exist yet when the lock is made)."""
    registry = str(knob(host_data, "container_registry")).rstrip("/")
    insecure = insecure_registries(host_data)
    out: list[Need] = [ImageNeed(recipe.image.lock_name, recipe.image.repository, recipe.image.tag, registry,
                                 registry.split("/", 1)[0] in insecure)]
    sources = list(recipe.sources)
    upstream = getattr(recipe, "upstream_source", None)
    if upstream is not None and all(s.name != upstream.name for s in sources):
        sources.append(upstream)  # the recipe's own repository: pinned even when nothing is mounted from it
    for source in sources:
        out.append(GitNeed(source.lock_name, source.git_url, source.ref, source.full_clone))
    endpoint = str(knob(host_data, "hf_endpoint")).rstrip("/")
    for model in recipe.models:
        out.append(ModelNeed(model.lock_name, model.repo_id, model_revision_wanted(model.name), endpoint, model.gated))
    return out


def exporter_needs(host_data: Mapping[str, Any]) -> list[Need]:
    """The rig's GPU exporter image (tasks/metrics.py), pinned like a variant's image; none when the
    host runs no exporters. Apart from the variant's needs: a missing exporter pin never holds back
    the variant's release."""
    exporters = rig_exporters(host_data)
    if exporters is None:
        return []
    image = exporters.image
    insecure = insecure_registries(host_data)
    return [ImageNeed(image.lock_name, image.repository, image.tag, image.registry, image.registry in insecure)]


def dashboard_needs(host_data: Mapping[str, Any], groups: Iterable[str],
                    fleet: Iterable[tuple[str, Mapping[str, Any], Iterable[str]]]) -> list[Need]:
    """A Grafana monitor host's vLLM dashboards: vLLM's repository at each vLLM version the fleet's pods
    run (rigup.desired.dashboards); none elsewhere, or without grafana. Apart from the variants' needs,
    like the exporter's."""
    if not (is_monitor(host_data, groups) and knob(host_data, "grafana")):
        return []
    refs, _notes = served_vllm_refs(fleet)
    url = str(knob(host_data, "vllm_git_url"))
    return [GitNeed(vllm_lock_name(ref), url, ref, False) for ref in sorted(refs)]


def lock_problems(recipe: Any, host_data: Mapping[str, Any], lock: LockFile) -> list[str]:
    return [p for p in (need_problem(n, lock) for n in needs_for(recipe, host_data)) if p is not None]
