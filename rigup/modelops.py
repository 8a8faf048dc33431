"""Model files on the rig: a fact and operations around rigfetch.py, plus the fleet plan.

rigfetch.py is uploaded to {install_root}/bin/ and does the work on the rig (stdlib Python only). The
`ModelFiles` fact runs it in --check mode, which reads stamps only, so a converged rig costs a few
stat() calls and the operations call host.noop(). The manifest is built here, on the control machine,
from the lock: rigs never decide which bytes are right.

Fleet mode (knob model_fleet_source=auto): for each model, the first rig in inventory order that needs
it is its source. Sources fetch from the hub (`model_files`). Then, in one operation on every rig
(`model_fleet_share`), each source serves its verified files over HTTP (bearer token made for this run,
files read-only, only stamped files) for as long as the peers that need them are fetching, and the
peers fetch from it, verify the same SHA-256s, and fall back to the hub when the source fails. Both
sides run in the same operation because pyinfra runs an operation on all hosts at once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import FactBase, FactProcessError, OperationError, QuoteString, StringCommand, operation

from rigup.lock import LockError, ModelPin, locked_recipe, read_hf_token
from rigup.rigfetch import encode_manifest

RIGFETCH_SRC = Path(__file__).with_name("rigfetch.py")
# One token per control-machine run, shared by the source and its peers, never written to disk.
_FLEET_TOKEN = secrets.token_urlsafe(32)
FLEET_MODES = ("auto", "off")


@functools.cache
def rigfetch_sha256() -> str:
    return hashlib.sha256(RIGFETCH_SRC.read_bytes()).hexdigest()


def script_path(install_root: str) -> str:
    return f"{install_root.rstrip('/')}/bin/rigfetch.py"


class ModelFiles(FactBase[dict[str, Any]]):
    """
    What rigfetch --check says about a manifest: which files need hashing or downloading.

    ``script`` is ``"stale"`` when the uploaded rigfetch.py is missing or not the expected version
    (everything then counts as work).

    .. code:: python

        {
            "script": "ok",
            "files": 9, "ok": 8,
            "work": [{"path": "/opt/rigup/models/x/model-00001.safetensors", "action": "fetch",
                      "size": 123, "part_size": 0}],
            "prune": [],
            "download_bytes": 123, "hash_bytes": 0,
        }
    """

    def command(self, script: str, script_sha256: str, manifest_b64: str, reverify: bool = False) -> StringCommand:
        script_q = QuoteString(script)
        check = ["python3", script_q, "--check", "--manifest-b64", QuoteString(manifest_b64)]
        if reverify:
            check.append("--reverify")
        return StringCommand(
            "if command -v python3 >/dev/null 2>&1 && [ -f",
            script_q,
            "] && [ \"$(sha256sum <",
            script_q,
            ")\" =",
            QuoteString(f"{script_sha256}  -"),
            "]; then",
            *check,
            "; else echo '{\"script\": \"stale\"}'; fi",
        )

    def process(self, output: list[str]) -> dict[str, Any]:
        for line in reversed(output):
            line = line.strip()
            if line.startswith("{"):
                try:
                    data = json.loads(line)
                except ValueError:
                    break
                if data.get("script") == "stale":
                    return {"script": "stale", "files": None, "ok": 0, "work": [], "prune": []}
                data["script"] = "ok"
                return data
        raise FactProcessError(f"rigfetch --check printed no JSON: {output[-3:]!r}")


def _needs_work(status: Mapping[str, Any], with_prune: bool = True) -> bool:
    if status.get("script") == "stale":
        return True
    if status.get("work"):
        return True
    return bool(with_prune and status.get("prune"))


def _secrets_line(hf_token_file: str | None, fleet: bool) -> str:
    try:
        token = read_hf_token(hf_token_file)
    except LockError as exc:
        raise OperationError(str(exc)) from None
    values = {"hf_token": token or ""}
    if fleet:
        values["fleet_token"] = _FLEET_TOKEN
    return json.dumps(values)


def _rigfetch(script: str, manifest_b64: str, options: list[Any], stdin: str) -> StringCommand:
    # Secrets travel on stdin: never on a command line, in a log or in a file on the rig.
    return StringCommand(
        "python3",
        QuoteString(script),
        "--manifest-b64",
        QuoteString(manifest_b64),
        *options,
        "--secrets-stdin",
        _stdin=stdin,
    )


def _common_options(retries: int, reverify: bool) -> list[Any]:
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 1:
        raise OperationError(f"model_download_retries must be a positive integer, got {retries!r}")
    options: list[Any] = ["--retries", str(retries)]
    if reverify:
        options.append("--reverify")
    return options


@operation()
def model_files(
    manifest: dict[str, Any],
    script: str,
    reverify: bool = False,
    retries: int = 3,
    hf_token_file: str | None = None,
):
    """
    Make every file of a rigfetch manifest present and verified against its locked SHA-256.

    + manifest: rigfetch manifest (see rigup/rigfetch.py), built from the lock by ``plan_models``
    + script: path of the uploaded rigfetch.py on the rig
    + reverify: hash every file again instead of trusting verified stamps
    + retries: attempts per file on a hash mismatch before the host fails
    + hf_token_file: control-machine 0600 file with the Hugging Face token (env HF_TOKEN wins)

    A rig whose stamps all match the manifest is a no-op (nothing is read or hashed).

    **Example:**

    .. code:: python

        model_files(
            name="Fetch locked model files from the hub",
            manifest=plan.hub_manifest,
            script="/opt/rigup/bin/rigfetch.py",
        )
    """
    if not manifest["models"]:
        host.noop("no model is fetched from the hub on this rig in this step")
        return
    b64 = encode_manifest(manifest)
    status = host.get_fact(ModelFiles, script=script, script_sha256=rigfetch_sha256(), manifest_b64=b64, reverify=reverify)
    if not _needs_work(status):
        host.noop(f"{status['ok']} model files match the lock (verified stamps)")
        return
    options = _common_options(retries, reverify)
    yield _rigfetch(script, b64, options, _secrets_line(hf_token_file, fleet=False))


@operation()
def model_fleet_share(
    fetch_manifest: dict[str, Any],
    serve_manifest: dict[str, Any],
    peers: list[tuple[Any, dict[str, Any]]],
    sources: dict[str, Any],
    script: str,
    listen_port: int = 8765,
    reverify: bool = False,
    retries: int = 3,
    hf_token_file: str | None = None,
):
    """
    Copy model files between rigs: serve what this rig is the source of, fetch what another rig is.

    + fetch_manifest: models this rig copies from other rigs (``peer_url`` set; the hub is the fallback)
    + serve_manifest: models this rig is the source of and serves to peers
    + peers: ``(peer host, manifest of what that peer fetches from this rig)`` pairs
    + sources: model name -> source host, for the models in ``fetch_manifest``
    + script: path of the uploaded rigfetch.py on the rig
    + listen_port: TCP port this rig serves on (knob model_fleet_port)
    + reverify, retries, hf_token_file: as for ``model_files``

    Serving happens only while at least one peer needs files from this rig (their ModelFiles facts
    are read at execution); with nothing to copy either way this is a no-op.

    **Example:**

    .. code:: python

        model_fleet_share(
            name="Copy model files between rigs (fleet mode)",
            fetch_manifest=plan.fetch_manifest, serve_manifest=plan.serve_manifest,
            peers=plan.peers, sources=plan.sources, script="/opt/rigup/bin/rigfetch.py",
        )
    """
    from pyinfra import state

    sha = rigfetch_sha256()
    fetch = dict(fetch_manifest)
    fetch_work = False
    if fetch["models"]:
        # A source that dropped out of this run cannot serve: go to the hub directly instead of waiting.
        models = []
        for model in fetch["models"]:
            source = sources.get(model["name"])
            if source is not None and source not in state.active_hosts:
                model = {**model, "peer_url": None}
            models.append(model)
        fetch["models"] = models
        status = host.get_fact(
            ModelFiles, script=script, script_sha256=sha, manifest_b64=encode_manifest(fetch), reverify=reverify
        )
        fetch_work = _needs_work(status)

    expected = 0
    if serve_manifest["models"]:
        for peer, peer_manifest in peers:
            if peer not in state.active_hosts:
                continue
            peer_status = peer.get_fact(
                ModelFiles,
                script=script_path(str(peer.data.get("install_root"))),
                script_sha256=sha,
                manifest_b64=encode_manifest(peer_manifest),
                reverify=bool(peer.data.get("model_reverify", False)),
                _sudo=bool(peer.data.get("_sudo", False)),
            )
            # Count the peers that will ask for files; removals alone do not need this rig.
            if _needs_work(peer_status, with_prune=False):
                expected += 1

    if not fetch_work and expected == 0:
        host.noop("no model files to copy between rigs")
        return

    options = _common_options(retries, reverify)
    stdin = _secrets_line(hf_token_file, fleet=True)
    serve_options: list[Any] = [
        "--listen",
        QuoteString(f"0.0.0.0:{int(listen_port)}"),
        "--expect-peers",
        str(expected),
    ]
    if fetch_work and expected:
        yield _rigfetch(
            script,
            encode_manifest(fetch),
            [*options, "--serve-manifest-b64", QuoteString(encode_manifest(serve_manifest)), *serve_options],
            stdin,
        )
    elif fetch_work:
        yield _rigfetch(script, encode_manifest(fetch), options, stdin)
    else:
        yield _rigfetch(script, encode_manifest(serve_manifest), ["--serve", *serve_options], stdin)


# ------------------------------------------------------------------------------------------
# planning (control machine)


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
    address = source.data.get("model_fleet_address") or source.data.get("ssh_hostname") or source.name
    address = str(address)
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


@dataclass
class _HostInfo:
    host: Any
    recipe: Any
    lock: Any
    data: dict[str, Any]
    fleet: bool


_PLANS: dict[int, tuple[Any, dict[str, ModelPlan]]] = {}


def plan_models(state: Any, current: Any) -> ModelPlan:
    """The model plan of `current`, computed once per run for every activated host.

    Raises LockError when any rig's lock entries are missing or stale.
    """
    cached = _PLANS.get(id(state))
    if cached is None or cached[0] is not state:
        cached = (state, _plan_all(state))
        _PLANS[id(state)] = cached
    plans = cached[1]
    if current.name not in plans:
        # Not activated (e.g. connected later): plan it alone against the hub.
        return _plan_all(state, only=current)[current.name]
    return plans[current.name]


def _plan_all(state: Any, only: Any = None) -> dict[str, ModelPlan]:
    hosts = [only] if only is not None else [h for h in state.inventory if h in state.activated_hosts]
    infos: list[_HostInfo] = []
    for h in hosts:
        data = h.data.dict()
        recipe, lock = locked_recipe(data, h.name)
        mode = data.get("model_fleet_source", "auto")
        if mode not in FLEET_MODES:
            raise LockError(f"{h.name}: model_fleet_source must be one of {', '.join(FLEET_MODES)}, got {mode!r}")
        infos.append(_HostInfo(h, recipe, lock, data, mode == "auto"))

    source_of: dict[str, _HostInfo] = {}
    for info in infos:
        if info.fleet:
            for model in info.recipe.models:
                source_of.setdefault(model.lock_name, info)

    plans: dict[str, ModelPlan] = {}
    for info in infos:
        state_dir = info.recipe.paths.state_dir
        reserve = int(float(info.data.get("preflight_disk_margin_gb") or 0) * 1e9)
        endpoint = str(info.data.get("hf_endpoint") or "https://huggingface.co")
        hub, fetch, serve = [], [], []
        sources: dict[str, Any] = {}
        peers: list[tuple[Any, dict[str, Any]]] = []
        for model in info.recipe.models:
            pin = info.lock.models[model.lock_name]
            source = source_of.get(model.lock_name)
            if not info.fleet or source is None or source is info:
                hub.append(model_entry(model, pin, endpoint))
                continue
            port = int(source.data.get("model_fleet_port") or 8765)
            peer_url = f"http://{_address(source.host)}:{port}/{model.dir_name}/"
            fetch.append(model_entry(model, pin, endpoint, peer_url))
            sources[model.dir_name] = source.host
        if info.fleet:
            for model in info.recipe.models:
                if source_of.get(model.lock_name) is not info:
                    continue
                takers = [
                    other
                    for other in infos
                    if other is not info and other.fleet and any(m.lock_name == model.lock_name for m in other.recipe.models)
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
                        str(other.data.get("hf_endpoint") or "https://huggingface.co"),
                        f"http://{_address(info.host)}:{int(info.data.get('model_fleet_port') or 8765)}/{m.dir_name}/",
                    )
                    for m in other.recipe.models
                    if m.dir_name in served and source_of.get(m.lock_name) is info
                ]
                if wanted:
                    other_reserve = int(float(other.data.get("preflight_disk_margin_gb") or 0) * 1e9)
                    peers.append((other.host, _manifest(other.recipe.paths.state_dir, other_reserve, wanted)))
        plans[info.host.name] = ModelPlan(
            script=script_path(info.recipe.paths.install_root),
            hub_manifest=_manifest(state_dir, reserve, hub),
            fetch_manifest=_manifest(state_dir, reserve, fetch),
            serve_manifest=_manifest(state_dir, reserve, serve),
            peers=tuple(peers),
            sources=sources,
            listen_port=int(info.data.get("model_fleet_port") or 8765),
        )
    return plans


__all__ = [
    "ModelFiles",
    "ModelPlan",
    "RIGFETCH_SRC",
    "model_entry",
    "model_files",
    "model_fleet_share",
    "plan_models",
    "rigfetch_sha256",
    "script_path",
]
