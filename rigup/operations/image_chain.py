"""The fleet's image chain: before any rig pulls, the blobs of every pinned image move along a chain of the
fleet's registry hosts (the mirror first, then the relays), each blob read from upstream once and every
link carrying it once, as the model files do (rigfetch). Each host lands them in its registry's staging
directory; the image helper (rigup/rig/imagemirror.py warm) then links them into the registry.

What each host holds and needs is known only at execution: its image helper's check (the pins' blobs,
from its cache or upstream's manifests) and rigfetch's check of the staging, both facts read once per run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pyinfra import host, state
from pyinfra.api import OperationError, QuoteString, StringCommand, operation

from rigup.desired.fleet_plan import FleetPlan
from rigup.desired.knobs import knob
from rigup.desired.models import ChainMember, fleet_base_url, in_fleet_chains
from rigup.facts.docker import ImageMirrorCache
from rigup.layout import RigLayout
from rigup.operations.model import FLEET_TOKEN, chain_fetch, chain_status, rigfetch_options
from rigup.rig.imagemirror import pin_name


@dataclass(frozen=True)
class ImageChainMember:
    """A host running a registry of the fleet's images, as the other members of the chain see it."""

    host: Any
    base_url: str | None  # its chain server, http://address:model_fleet_port/; None: it reads its upstream alone
    rigfetch: str  # rigfetch.py on the host
    helper: str  # rigup-image-mirror on the host
    keep_file: str
    upstream: str  # its registry's upstream: the mirror's is container_registry's, a relay's the mirror
    staging: str
    state_dir: str  # rigfetch's stamps and log for the image blobs
    reserve_bytes: int
    sudo: bool
    is_mirror: bool


def image_chain_members(fleet: FleetPlan, keep_file: str) -> tuple[ImageChainMember, ...]:
    """Every host of the run's FleetPlan that runs a registry of the fleet's images (the mirror, the relays)
    with pins to keep, mirror hosts first (FleetPlan.image_chain); the operation keeps those in the run."""
    members = []
    for planned in fleet.image_chain():
        name, data, role = planned.name, planned.data, planned.registry
        assert role is not None  # image_chain holds registry hosts only
        layout = RigLayout(str(knob(data, "install_root")))
        members.append(ImageChainMember(
            host=planned.entry.handle,
            base_url=fleet_base_url(name, data) if in_fleet_chains(name, data) else None,
            rigfetch=layout.rigfetch,
            helper=layout.image_mirror_helper,
            keep_file=keep_file,
            upstream=role.upstream,
            staging=role.staging,
            state_dir=layout.image_state_dir,
            reserve_bytes=int(float(knob(data, "preflight_disk_margin_gb")) * 1e9),
            sudo=bool(knob(data, "_sudo")),
            is_mirror=not role.is_relay,
        ))
    return tuple(members)


def _cache(member: ImageChainMember) -> dict[str, Any] | None:
    return member.host.get_fact(ImageMirrorCache, script=member.helper, keep_file=member.keep_file, _sudo=member.sudo)


def chain_manifest(member: ImageChainMember, cache: dict[str, Any]) -> dict[str, Any]:
    """rigfetch's manifest of the member's staging: one model per pin the helper could list, named and
    placed by the pin (the same on every member), read from its registry's upstream as a registry client
    (hub_auth "registry"). A blob listed twice in one image is fetched once."""
    models = []
    for ref, pin in sorted((cache.get("pins") or {}).items()):
        if "blobs" not in pin:
            continue
        seen: dict[str, int] = {}
        for digest, size in pin["blobs"]:
            seen.setdefault(digest, int(size))
        name = pin_name(ref)
        models.append({
            "name": name,
            "dir": f"{member.staging.rstrip('/')}/{name}",
            "hub_url": f"{member.upstream.rstrip('/')}/v2/{pin['repository']}/blobs/",
            "hub_auth": "registry",
            "files": [{"path": d, "size": size, "sha256": d.split(":", 1)[1]} for d, size in seen.items()],
        })
    return {"version": 1, "state_dir": member.state_dir, "reserve_bytes": member.reserve_bytes, "models": models}


def _as_chain_member(member: ImageChainMember, cache: dict[str, Any]) -> ChainMember:
    return ChainMember(host=member.host, base_url=member.base_url or "", script=member.rigfetch,
                       manifest=chain_manifest(member, cache), reverify=False, sudo=member.sudo)


@operation()
def image_blobs_staged(members: tuple[ImageChainMember, ...], listen_port: int = 8765, retries: int = 3):
    """
    Stage the blobs of every image this host's registry keeps, verified, along the fleet's image chain:
    per pin, the members holding its blobs first, then the mirror, then the relays; the head reads its
    registry's upstream (the mirror host: container_registry, as a registry client; a relay: the mirror),
    every other member its nearest live upstream, forwarding verified pieces while they arrive.

    + members: every host of the run with a registry of the fleet's images (``image_chain_members``)
    + listen_port: TCP port this host serves its chain peers on (knob model_fleet_port)
    + retries: attempts per blob on a hash mismatch before the host fails (model_download_retries)

    Before rigfetch, the helper's ``stage`` removes staging of pins gone and links blobs the cache holds
    already (hashed, not fetched). A host whose staging holds every pinned blob and who serves nobody is a
    no-op. Secrets: the run's fleet token only (on stdin); never the HF token.
    """
    me = next((m for m in members if m.host.name == host.name), None)
    if me is None:
        host.noop("this host runs no registry of the fleet's images")
        return
    if me.base_url is None:  # each registry fills from its upstream at warm, the mirror's first
        host.noop("the fleet chain is off here (model_fleet_source: off, or no address peers reach)")
        return
    cache = _cache(me)
    if cache is None:  # only a --dry run gets here before the helper and its keep file are uploaded
        host.noop("the image chain's work is known once the image helper is on the host (a real run uploads it first)")
        return
    failed = {ref: pin["error"] for ref, pin in (cache.get("pins") or {}).items() if "error" in pin}
    if failed:
        raise OperationError("; ".join(f"{ref}: {why}" for ref, why in sorted(failed.items())))
    mine = _as_chain_member(me, cache)
    linked = [mine if m is me else _as_chain_member(m, c) for m in members
              if m.host in state.active_hosts and m.base_url and (c := _cache(m)) is not None]
    chains = {  # a pin's chain: the members that keep it, in members' order (the mirror first)
        model["name"]: tuple(c for c in linked if any(x["name"] == model["name"] for x in c.manifest["models"]))
        for model in mine.manifest["models"]
    }
    commands = chain_fetch(chain_status(mine), mine.manifest, me.rigfetch, chains, listen_port, rigfetch_options(retries, False),
                           lambda: json.dumps({"fleet_token": FLEET_TOKEN}), "image blobs")
    stale = cache.get("stale_staging") or []
    if commands is None and not stale:
        host.noop(f"the staging holds every blob of the {len(mine.manifest['models'])} pinned images")
        return
    yield StringCommand("python3", QuoteString(me.helper), "stage", QuoteString(me.keep_file))
    yield from commands or ()
