"""The models plan: for each host, the locked files to fetch and the manifest rigfetch reads, and in fleet
mode, for each model, the rigs that hold it: the operation orders them into a chain at execution time
(rigs that already have the files first), the head reads the hub and each other rig its nearest upstream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rigup.desired.knobs import MODEL_FLEET_MODES, knob, url_host
from rigup.desired.lock import LockError, ModelPin
from rigup.desired.plan import host_plans


def script_path(install_root: str) -> str:
    return f"{install_root.rstrip('/')}/bin/rigfetch.py"  # where rigfetch.py is uploaded on the rig


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
    reachable = name != "@local" or knob(data, "model_fleet_address") is not None
    return knob(data, "model_fleet_source") == "auto" and reachable


@dataclass
class _HostInfo:
    host: Any
    recipe: Any  # the first pod's (paths are the host's)
    lock: Any
    data: dict[str, Any]
    fleet: bool
    models: tuple[Any, ...] = ()  # every pod's models, each once


_PLANS: dict[int, tuple[Any, dict[str, ModelPlan], dict[str, str]]] = {}


def plan_models(state: Any, current: Any) -> ModelPlan:
    """The model plan of `current`, computed once per run for every activated host.

    Raises LockError when `current` has no usable lock (missing file, or entries missing or stale:
    the message is the plan's lock_problem). Rigs without a usable lock are left out of the fleet
    plan (they neither serve nor fetch from peers); a real run has stopped at their sources by then.
    """
    cached = _PLANS.get(id(state))
    if cached is None or cached[0] is not state:
        cached = (state, *_plan_all(state))
        _PLANS[id(state)] = cached
    _, plans, problems = cached
    if current.name not in plans and current.name not in problems:
        # Not activated (e.g. connected later): plan it alone against the hub.
        plans, problems = _plan_all(state, only=current)
    if current.name in problems:
        raise LockError(problems[current.name])
    return plans[current.name]


def _plan_all(state: Any, only: Any = None) -> tuple[dict[str, ModelPlan], dict[str, str]]:
    hosts = [only] if only is not None else [h for h in state.inventory if h in state.activated_hosts]
    hosts = [h for h in hosts if knob(h.data, "serves_variant")]  # a gateway-only host holds no model
    infos: list[_HostInfo] = []
    problems: dict[str, str] = {}  # host name -> why it has no usable lock
    for h in hosts:
        data = h.data.dict()
        pod_plans = host_plans(data, h.name, read_secrets=False, require_lock=False)
        plan = next((p for p in pod_plans if p.lock is None), pod_plans[0])  # one without a lock speaks for the host
        recipe, lock = plan.recipe, plan.lock
        models = tuple({m.lock_name: m for p in pod_plans for m in p.recipe.models}.values())
        mode = knob(data, "model_fleet_source")
        if mode not in MODEL_FLEET_MODES:
            raise LockError(f"{h.name}: model_fleet_source must be one of {', '.join(MODEL_FLEET_MODES)}, got {mode!r}")
        if lock is None:
            problems[h.name] = plan.lock_problem or f"{h.name}: no usable lock file"
            continue
        infos.append(_HostInfo(h, recipe, lock, data, in_fleet_chains(h.name, data), models))

    members: dict[str, ChainMember] = {}
    for info in infos:
        members[info.host.name] = ChainMember(
            host=info.host,
            base_url=fleet_base_url(info.host.name, info.data),
            script=script_path(info.recipe.paths.install_root),
            manifest=_rig_manifest(info),
            reverify=bool(knob(info.data, "model_reverify")),
            sudo=bool(knob(info.data, "_sudo")),
        )
    plans: dict[str, ModelPlan] = {}
    for info in infos:
        chains: dict[str, tuple[ChainMember, ...]] = {}
        if info.fleet:
            for model in info.models:
                chains[model.dir_name] = tuple(
                    members[other.host.name] for other in infos if other.fleet and _same_pin(other, info, model.lock_name)
                )
        member = members[info.host.name]
        plans[info.host.name] = ModelPlan(
            script=member.script,
            manifest=member.manifest,
            chains=chains,
            listen_port=int(knob(info.data, "model_fleet_port")),
        )
    return plans, problems
