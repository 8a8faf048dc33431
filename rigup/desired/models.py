"""The models plan: for each host, the locked files to fetch and the manifest rigfetch reads, and in fleet
mode, for each model, the rigs that hold it: the operation orders them into a chain at execution time
(rigs that already have the files first), the head reads the hub and each other rig its nearest upstream."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rigup.desired.knobs import MODEL_FLEET_MODES, knob, url_host
from rigup.desired.lock import LockFile, ModelPin
from rigup.desired.roles import is_local
from rigup.layout import RigLayout


@dataclass(frozen=True)
class ChainMember:
    """A rig holding a model in fleet mode, as the other rigs of that model's chain see it."""

    host: Any
    base_url: str  # its fleet server, e.g. http://10.0.0.11:8765/
    script: str
    manifest: dict[str, Any]  # its own manifest (no upstreams): what its ModelFiles fact checks
    reverify: bool
    sudo: bool


@dataclass(frozen=True)
class ModelPlan:
    """What one rig does in the model task."""

    script: str
    manifest: dict[str, Any]  # every model of the rig, hub URLs only: its ModelFiles fact checks this
    chains: dict[str, tuple[ChainMember, ...]] = field(default_factory=dict)  # model name -> fleet members holding it
    listen_port: int = 8765


def _manifest(state_dir: str, reserve_bytes: int, models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": 1, "state_dir": state_dir, "reserve_bytes": reserve_bytes, "models": models}


def model_entry(model: Any, pin: ModelPin, endpoint: str) -> dict[str, Any]:
    """One manifest model: the locked files of `pin`, landing in the recipe's model dir."""
    return {
        "name": model.dir_name,
        "dir": model.path,
        "hub_url": f"{endpoint.rstrip('/')}/{model.repo_id}/resolve/{pin.commit}/",
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in pin.files],
    }


def _rig_manifest(info: _HostInfo) -> dict[str, Any]:
    endpoint = str(knob(info.data, "hf_endpoint"))
    reserve = int(float(knob(info.data, "preflight_disk_margin_gb")) * 1e9)
    models = [model_entry(m, info.lock.models[m.lock_name], endpoint) for m in info.models]
    return _manifest(info.recipe.paths.state_dir, reserve, models)


def _same_pin(one: _HostInfo, other: _HostInfo, lock_name: str) -> bool:
    """Whether both rigs want the same files of a model (rigs with different locks form different chains)."""
    return any(m.lock_name == lock_name for m in one.models) and one.lock.models.get(lock_name) == other.lock.models.get(
        lock_name
    )


def fleet_base_url(name: str, data: Any) -> str:
    """http://address:model_fleet_port/ where a rig serves its chain peers (model files and image blobs):
    model_fleet_address, else its ssh_hostname, else its name."""
    address = knob(data, "model_fleet_address") or data.get("ssh_hostname") or name
    return f"http://{url_host(str(address))}:{int(knob(data, 'model_fleet_port'))}/"


def in_fleet_chains(name: str, data: Any) -> bool:
    """Whether a rig takes part in the fleet's chains: model_fleet_source auto, and an address peers can
    reach (pyinfra's @local has none unless model_fleet_address names one)."""
    reachable = not is_local(name) or knob(data, "model_fleet_address") is not None
    return knob(data, "model_fleet_source") == "auto" and reachable


@dataclass
class _HostInfo:
    name: str
    handle: Any  # pyinfra's Host in the deploy
    active: bool
    recipe: Any  # the first pod's (paths are the host's)
    lock: LockFile
    data: dict[str, Any]
    fleet: bool
    models: tuple[Any, ...] = ()  # every pod's models, each once


def plan_models(hosts: Iterable[tuple[str, Mapping[str, Any], Any, bool, Sequence[Any]]]) -> tuple[dict[str, ModelPlan], dict[str, str]]:
    """The model plan of every rig, planned together (rigup.desired.fleet_plan, once per run).

    `hosts`: (name, data, handle, active, pod plans) of each rig, its pod plans previews
    (rigup.desired.plan.host_plans with require_lock=False); the handle is what a chain member carries to
    execution (pyinfra's Host in the deploy), and only active rigs (this run's) form chains with others.
    Returns the plans by rig, and for each rig without a usable lock (missing file, entries missing or
    stale: the plan's lock_problem) or with a bad model_fleet_source, why: such a rig neither serves nor
    fetches from peers (a real run has stopped at its sources by then)."""
    infos: list[_HostInfo] = []
    problems: dict[str, str] = {}  # host name -> why it has no model plan
    for name, data, handle, active, pod_plans in hosts:
        plan = next((p for p in pod_plans if p.lock is None), pod_plans[0])  # one without a lock speaks for the host
        recipe, lock = plan.recipe, plan.lock
        models = tuple({m.lock_name: m for p in pod_plans for m in p.recipe.models}.values())
        mode = knob(data, "model_fleet_source")
        if mode not in MODEL_FLEET_MODES:
            problems[name] = f"{name}: model_fleet_source must be one of {', '.join(MODEL_FLEET_MODES)}, got {mode!r}"
            continue
        if lock is None:
            problems[name] = plan.lock_problem or f"{name}: no usable lock file"
            continue
        infos.append(_HostInfo(name, handle, active, recipe, lock, dict(data), in_fleet_chains(name, data), models))

    members: dict[str, ChainMember] = {}
    for info in infos:
        members[info.name] = ChainMember(
            host=info.handle,
            base_url=fleet_base_url(info.name, info.data),
            script=RigLayout(info.recipe.paths.install_root).rigfetch,
            manifest=_rig_manifest(info),
            reverify=bool(knob(info.data, "model_reverify")),
            sudo=bool(knob(info.data, "_sudo")),
        )
    plans: dict[str, ModelPlan] = {}
    for info in infos:
        chains: dict[str, tuple[ChainMember, ...]] = {}
        if info.fleet:
            # an inactive rig (not connected in this run) is a chain of its own, against the hub
            peers = [other for other in infos if other.active and other.fleet] if info.active else [info]
            for model in info.models:
                chains[model.dir_name] = tuple(
                    members[other.name] for other in peers if _same_pin(other, info, model.lock_name)
                )
        member = members[info.name]
        plans[info.name] = ModelPlan(
            script=member.script,
            manifest=member.manifest,
            chains=chains,
            listen_port=int(knob(info.data, "model_fleet_port")),
        )
    return plans, problems
