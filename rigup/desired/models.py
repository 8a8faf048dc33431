"""The models plan: for each host, the locked files to fetch, where from (the hub or a fleet peer), and the manifest rigfetch reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rigup.desired.knobs import MODEL_FLEET_MODES, knob
from rigup.desired.lock import LockError, ModelPin
from rigup.desired.plan import host_plans


def script_path(install_root: str) -> str:
    return f"{install_root.rstrip('/')}/bin/rigfetch.py"  # where rigfetch.py is uploaded on the rig


@dataclass(frozen=True)
class ModelPlan:
    """What one rig does in the model task."""

    script: str
    hub_manifest: dict[str, Any]
    fetch_manifest: dict[str, Any]
    serve_manifest: dict[str, Any]
    peers: tuple[tuple[Any, dict[str, Any]], ...] = ()
    sources: dict[str, Any] = field(default_factory=dict)
    listen_port: int = 8765


def _manifest(state_dir: str, reserve_bytes: int, models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": 1, "state_dir": state_dir, "reserve_bytes": reserve_bytes, "models": models}


def model_entry(model: Any, pin: ModelPin, endpoint: str, peer_url: str | None = None) -> dict[str, Any]:
    """One manifest model: the locked files of `pin`, landing in the recipe's model dir."""
    return {
        "name": model.dir_name,
        "dir": model.path,
        "hub_url": f"{endpoint.rstrip('/')}/{model.repo_id}/resolve/{pin.commit}/",
        "peer_url": peer_url,
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in pin.files],
    }


def _address(source: Any) -> str:
    address = knob(source.data, "model_fleet_address") or source.data.get("ssh_hostname") or source.name
    address = str(address)
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


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
        # pyinfra's @local has no address other rigs can reach unless model_fleet_address names one
        reachable = h.name != "@local" or knob(data, "model_fleet_address") is not None
        infos.append(_HostInfo(h, recipe, lock, data, mode == "auto" and reachable, models))

    source_of: dict[str, _HostInfo] = {}
    for info in infos:
        if info.fleet:
            for model in info.models:
                source_of.setdefault(model.lock_name, info)

    plans: dict[str, ModelPlan] = {}
    for info in infos:
        state_dir = info.recipe.paths.state_dir
        reserve = int(float(knob(info.data, "preflight_disk_margin_gb")) * 1e9)
        endpoint = str(knob(info.data, "hf_endpoint"))
        hub, fetch, serve = [], [], []
        sources: dict[str, Any] = {}
        peers: list[tuple[Any, dict[str, Any]]] = []
        for model in info.models:
            pin = info.lock.models[model.lock_name]
            source = source_of.get(model.lock_name)
            if not info.fleet or source is None or source is info:
                hub.append(model_entry(model, pin, endpoint))
                continue
            port = int(knob(source.data, "model_fleet_port"))
            peer_url = f"http://{_address(source.host)}:{port}/{model.dir_name}/"
            fetch.append(model_entry(model, pin, endpoint, peer_url))
            sources[model.dir_name] = source.host
        if info.fleet:
            for model in info.models:
                if source_of.get(model.lock_name) is not info:
                    continue
                takers = [
                    other
                    for other in infos
                    if other is not info and other.fleet and any(m.lock_name == model.lock_name for m in other.models)
                ]
                if takers:
                    serve.append(model_entry(model, info.lock.models[model.lock_name], endpoint))
            served = {m["name"] for m in serve}
            for other in infos:
                if other is info or not other.fleet:
                    continue
                wanted = [
                    model_entry(
                        m,
                        other.lock.models[m.lock_name],
                        str(knob(other.data, "hf_endpoint")),
                        f"http://{_address(info.host)}:{int(info.data.get('model_fleet_port') or 8765)}/{m.dir_name}/",
                    )
                    for m in other.models
                    if m.dir_name in served and source_of.get(m.lock_name) is info
                ]
                if wanted:
                    other_reserve = int(float(knob(other.data, "preflight_disk_margin_gb")) * 1e9)
                    peers.append((other.host, _manifest(other.recipe.paths.state_dir, other_reserve, wanted)))
        plans[info.host.name] = ModelPlan(
            script=script_path(info.recipe.paths.install_root),
            hub_manifest=_manifest(state_dir, reserve, hub),
            fetch_manifest=_manifest(state_dir, reserve, fetch),
            serve_manifest=_manifest(state_dir, reserve, serve),
            peers=tuple(peers),
            sources=sources,
            listen_port=int(knob(info.data, "model_fleet_port")),
        )
    return plans, problems

