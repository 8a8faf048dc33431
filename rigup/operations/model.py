"""Model operations: rigfetch.py (rigup/rig/rigfetch.py) uploaded to {install_root}/bin/ fetches and
verifies the locked files on the rig, from the hub or from a fleet peer that already has them."""

from __future__ import annotations

import functools
import hashlib
import json
import secrets
from typing import Any

from pyinfra import host, state
from pyinfra.api import OperationError, QuoteString, StringCommand, operation

from rigup.desired.knobs import knob
from rigup.desired.models import script_path
from rigup.desired.secrets import SecretError, read_hf_token
from rigup.facts.model import ModelFiles, model_files_need_work
from rigup.operations.live_output import streamed
from rigup.rig import RIGFETCH_SCRIPT
from rigup.rig.rigfetch import encode_manifest, human_bytes
from rigup.runstate import account

RIGFETCH_SRC = RIGFETCH_SCRIPT


# One token per control-machine run, shared by the source and its peers, never written to disk.
_FLEET_TOKEN = secrets.token_urlsafe(32)


@functools.cache
def rigfetch_sha256() -> str:
    return hashlib.sha256(RIGFETCH_SRC.read_bytes()).hexdigest()


def _secrets_line(hf_token_file: str | None, fleet: bool) -> str:
    try:
        token = read_hf_token(hf_token_file)
    except SecretError as exc:
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


def _fetched(host: Any, ok: bool, output: Any, seconds: float) -> None:
    """The converge's account of a rigfetch run, from the JSON report it prints last on stdout."""
    report: dict[str, Any] = {}
    for line in reversed(output.stdout_lines):
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if isinstance(report, dict) and "bytes_downloaded" in report:
            break
        report = {}
    if not ok or not report:
        account(host, f"model files: rigfetch failed after {seconds:.0f} s")
        return
    account(
        host,
        f"model files: {human_bytes(report['bytes_downloaded'])} downloaded "
        f"({human_bytes(report['bytes_from_peer'])} from a fleet peer), "
        f"{human_bytes(report['bytes_hashed'])} hashed, verified in {seconds:.0f} s",
    )


def _served(host: Any, ok: bool, output: Any, seconds: float) -> None:
    account(host, f"model files: served to fleet peers for {seconds:.0f} s" if ok else "model files: serving peers failed")


def _common_options(retries: int, reverify: bool) -> list[Any]:
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 1:
        raise OperationError(f"model_download_retries must be a positive integer, got {retries!r}")
    options: list[Any] = ["--retries", str(retries), "--terse"]  # a deploy streams the progress lines only
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

    + manifest: rigfetch manifest (see rigup/rig/rigfetch.py), built from the lock by ``plan_models``
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
    if not model_files_need_work(status):
        host.noop(f"{status['ok']} model files match the lock (verified stamps)")
        return
    options = _common_options(retries, reverify)
    # streamed: rigfetch's progress line (bytes done/total, rate, ETA) every few seconds, per host
    yield streamed(_rigfetch(script, b64, options, _secrets_line(hf_token_file, fleet=False)), _fetched)


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
        fetch_work = model_files_need_work(status)

    expected = 0
    if serve_manifest["models"]:
        for peer, peer_manifest in peers:
            if peer not in state.active_hosts:
                continue
            peer_status = peer.get_fact(
                ModelFiles,
                script=script_path(str(knob(peer.data, "install_root"))),
                script_sha256=sha,
                manifest_b64=encode_manifest(peer_manifest),
                reverify=bool(knob(peer.data, "model_reverify")),
                _sudo=bool(knob(peer.data, "_sudo")),
            )
            # Count the peers that will ask for files; removals alone do not need this rig.
            if model_files_need_work(peer_status, with_prune=False):
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
        yield streamed(
            _rigfetch(
                script,
                encode_manifest(fetch),
                [*options, "--serve-manifest-b64", QuoteString(encode_manifest(serve_manifest)), *serve_options],
                stdin,
            ),
            _fetched,
        )
    elif fetch_work:
        yield streamed(_rigfetch(script, encode_manifest(fetch), options, stdin), _fetched)
    else:
        yield streamed(_rigfetch(script, encode_manifest(serve_manifest), ["--serve", "--terse", *serve_options], stdin), _served)

