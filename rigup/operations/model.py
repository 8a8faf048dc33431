"""Model operations: rigfetch.py uploaded to {install_root}/bin/ (the rigup/rig/rigfetch package as one
zipapp, rigup.rig.onefile) fetches and verifies the locked files on the rig, from the hub or, in fleet
mode, along a chain of rigs that forward each verified piece as it arrives."""

from __future__ import annotations

import functools
import io
import json
import secrets
from collections.abc import Callable
from typing import Any

from pyinfra import host, state
from pyinfra.api import OperationError, QuoteString, StringCommand, operation

from rigup.desired.models import ChainMember
from rigup.desired.secrets import SecretError, read_hf_token
from rigup.facts.model import ModelFiles, model_files_need_work
from rigup.operations.live_output import streamed
from rigup.rig.onefile import rigfetch_sha256, rigfetch_zipapp
from rigup.rig.rigfetch.log import human_bytes
from rigup.rig.rigfetch.manifest import encode_manifest
from rigup.runstate import account

SERVE_IDLE_S = 30  # a serving rig stops after this long without a request from any peer

# One token per control-machine run, shared by the source and its peers, never written to disk.
FLEET_TOKEN = secrets.token_urlsafe(32)


def rigfetch_upload() -> io.BytesIO:
    """What files.put uploads as rigfetch.py: the zipapp, the same bytes for the same sources (a fresh reader
    each call: files.put reads it to the end)."""
    return io.BytesIO(rigfetch_zipapp())


def _secrets_line(hf_token_file: str | None, fleet: bool) -> str:
    try:
        token = read_hf_token(hf_token_file)
    except SecretError as exc:
        raise OperationError(str(exc)) from None
    values = {"hf_token": token or ""}
    if fleet:
        values["fleet_token"] = FLEET_TOKEN
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


def _fetched(host: Any, ok: bool, output: Any, seconds: float, what: str = "model files") -> None:
    """The converge's account of a rigfetch run, from the JSON lines it prints last on stdout."""
    report: dict[str, Any] = {}
    served: dict[str, Any] = {}
    for line in output.stdout_lines:
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and "bytes_downloaded" in data:
            report = data
        elif isinstance(data, dict) and isinstance(data.get("serve"), dict):
            served = data["serve"]
    if not ok or not report:
        account(host, f"{what}: rigfetch failed after {seconds:.0f} s")
        return
    line = (
        f"{what}: {human_bytes(report['bytes_downloaded'])} downloaded "
        f"({human_bytes(report['bytes_from_hub'])} from the hub, {human_bytes(report['bytes_from_peer'])} from fleet peers), "
        f"{human_bytes(report['bytes_hashed'])} hashed, verified in {seconds:.0f} s"
    )
    if report.get("pieces_rejected"):
        line += f"; {report['pieces_rejected']} pieces rejected, {report['peers_dropped']} peers dropped"
    if served:
        line += f"; served {human_bytes(served.get('bytes_served', 0))} to {served.get('peers_done', 0)} fleet peers"
    account(host, line)


def rigfetch_options(retries: int, reverify: bool) -> list[Any]:
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 1:
        raise OperationError(f"model_download_retries must be a positive integer, got {retries!r}")
    options: list[Any] = ["--retries", str(retries), "--terse"]  # a deploy streams the progress lines only
    if reverify:
        options.append("--reverify")
    return options


def chain_status(member: ChainMember) -> dict[str, Any]:
    """A chain member's ModelFiles fact, asked the same way by every rig (read once per run)."""
    return member.host.get_fact(
        ModelFiles,
        script=member.script,
        script_sha256=rigfetch_sha256(),
        manifest_b64=encode_manifest(member.manifest),
        reverify=member.reverify,
        _sudo=member.sudo,
    )


def _needs(member: ChainMember, model: str) -> bool:
    """Whether the member has files of `model` to fetch or hash (removals alone need no peer)."""
    status = chain_status(member)
    if status.get("script") == "stale":
        return True
    entry = next(m for m in member.manifest["models"] if m["name"] == model)
    prefix = entry["dir"].rstrip("/") + "/"
    return any(str(w.get("path", "")).startswith(prefix) for w in status.get("work") or ())


def _chain_order(chain: tuple[ChainMember, ...], model: str) -> list[tuple[ChainMember, bool]]:
    """A model's chain for this run, as (member, needs files) pairs: the members still in the run, those
    that hold the files already first (they serve from disk), then the others in inventory order. Every
    member computes the same order from the same facts."""
    live = [(m, _needs(m, model)) for m in chain if m.host in state.active_hosts]
    return [pair for pair in live if not pair[1]] + [pair for pair in live if pair[1]]


@operation()
def model_files(
    manifest: dict[str, Any],
    script: str,
    chains: dict[str, tuple[ChainMember, ...]] | None = None,
    listen_port: int = 8765,
    reverify: bool = False,
    retries: int = 3,
    hf_token_file: str | None = None,
):
    """
    Make every file of a rigfetch manifest present and verified against its locked SHA-256; in fleet
    mode, as one chain per model across the rigs that hold it.

    + manifest: this rig's rigfetch manifest (see rigup/rig/rigfetch.py), built from the lock by ``plan_models``
    + script: path of the uploaded rigfetch.py on the rig
    + chains: model name -> the fleet members holding it (this rig among them); none: the hub only
    + listen_port: TCP port this rig serves its chain peers on (knob model_fleet_port)
    + reverify: hash every file again instead of trusting verified stamps
    + retries: attempts per file on a hash mismatch before the host fails
    + hf_token_file: control-machine 0600 file with the Hugging Face token (env HF_TOKEN wins)

    Each chain is ordered at execution, from every member's ModelFiles fact: members that already hold
    the files first, then the others. A member that needs files lists the members ahead of it as its
    upstreams (rigfetch reads the nearest live one, the head reads the hub); a member serves while
    members after it need files. A rig with nothing to fetch and nobody to serve is a no-op (nothing is
    read or hashed).

    **Example:**

    .. code:: python

        model_files(
            name="Fetch locked model files",
            manifest=plan.manifest,
            script="/opt/rigup/bin/rigfetch.py",
            chains=plan.chains,
        )
    """
    if not manifest["models"]:
        host.noop("no model is fetched on this rig")
        return
    chains = chains or {}
    me = next((m for chain in chains.values() for m in chain if m.host.name == host.name), None)
    status = (
        chain_status(me)
        if me is not None
        else host.get_fact(
            ModelFiles, script=script, script_sha256=rigfetch_sha256(), manifest_b64=encode_manifest(manifest), reverify=reverify
        )
    )
    commands = chain_fetch(status, manifest, script, chains, listen_port, rigfetch_options(retries, reverify),
                           lambda: _secrets_line(hf_token_file, bool(chains)), "model files")
    if commands is None:
        host.noop(f"{status['ok']} model files match the lock (verified stamps)")
        return
    yield from commands


def chain_fetch(status: dict[str, Any], manifest: dict[str, Any], script: str,
                chains: dict[str, tuple[ChainMember, ...]], listen_port: int, options: list[Any],
                secrets_line: Callable[[], str], what: str) -> list[Any] | None:
    """The rigfetch run of this rig, placed in each of its chains (ordered now, from every member's
    ModelFiles fact): its upstreams per model, and whom it serves. None when it has nothing to fetch,
    hash or remove, and nobody to serve. `secrets_line` is read only when there is work (a token file is
    not touched otherwise); `what` names the files in the converge's account."""
    work = model_files_need_work(status)
    models = []
    serve_to: set[str] = set()
    for model in manifest["models"]:
        chain = _chain_order(chains.get(model["name"], ()), model["name"])
        names = [m.host.name for m, _ in chain]
        if host.name not in names:
            models.append(model)
            continue
        position = names.index(host.name)
        # Members ahead of this one are its upstreams (head first); those after it that need files, its peers.
        upstreams = [m.base_url for m, _ in chain[:position]] if chain[position][1] else []
        models.append({**model, "upstreams": upstreams} if upstreams else model)
        serve_to.update(m.host.name for m, needs in chain[position + 1 :] if needs)
    if not work and not serve_to:
        return None
    options = list(options)
    if serve_to:
        # Peers stream or ask for digests all along; 30 s of silence means the ones left died (each rig
        # that dies fails its own host), so the living stop waiting for them well before rigfetch's 120 s.
        options += [
            "--listen",
            QuoteString(f"0.0.0.0:{int(listen_port)}"),
            "--expect-peers",
            str(len(serve_to)),
            "--idle-timeout",
            str(SERVE_IDLE_S),
        ]
    # streamed: rigfetch's progress line (bytes done/total, sources, rate, ETA) every few seconds, per host
    return [streamed(_rigfetch(script, encode_manifest({**manifest, "models": models}), options, secrets_line()),
                     functools.partial(_fetched, what=what))]
