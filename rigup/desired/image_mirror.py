"""The fleet's image mirror: one host runs the distribution registry as a pull-through cache of
container_registry; every other rig that names it (image_mirror_host) runs a relay, the same registry on
127.0.0.1 proxying the mirror. Every rig pulls rigup's images from 127.0.0.1.

Why a mirror: every rig pulling a ~30 GB vLLM image from Docker Hub reads it N times over the site's
uplink (and spends N times Docker Hub's anonymous pull allowance). Through the mirror the uplink
carries it once per fleet.
Why relays: N rigs pulling from one mirror take N times one rig's time (its uplink carries every copy).
Before any pull, the image's blobs move along a chain (rigfetch, as the model files do): the mirror
host reads upstream once and every rig forwards verified pieces to the next while they arrive, into a
staging directory beside its registry's storage; the helper then links them into the registry. The
image reaches N rigs in about the time it reaches one, and each rig's pull is a loopback read.

    resolve_mirrors(path, hosts)   the fleet file's check: the named host exists, one upstream per mirror;
                                   sets the derived `image_mirror` knob on each client
    pull_registry(host_data)       the registry prefix of rigup's images on this host
    daemon_settings(host_data)     what the host's daemon.json gains (insecure-registries, registry-mirrors)
    registry_role(name, fleet)     the mirror host's role (upstream, port, bound, pins to keep), or a
                                   relay's (the mirror upstream, 127.0.0.1, its own pins only)

The registry is the OS package (`docker-registry`: Debian's and Ubuntu's build of distribution 2.8),
run by its own unit with rigup's config (a drop-in names it; the package's conffile is left alone).
It is read-only over its API (READ_ONLY: no push or delete from anyone; rigup fills its storage itself) and
anonymous towards the upstream; pulls are anonymous too, and the boundary admits only its clients.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rigup.desired.knobs import knob, url_host
from rigup.desired.roles import LOCAL_HOST, image_mirror, is_local, mirror_host
from rigup.desired.templating import render_template

CONFIG_FILE = "/etc/rigup/image-mirror.yml"
KEEP_FILE = "/etc/rigup/image-mirror-keep.json"  # the prune script's input: bound and the pins to keep
DROPIN_FILE = "/etc/systemd/system/docker-registry.service.d/rigup.conf"
UNIT = "docker-registry.service"
PACKAGE = "docker-registry"
BINARY = "/usr/bin/docker-registry"
STORAGE_DIR = "/var/lib/docker-registry"  # the package's storage directory, owned by its user
# The chain's verified blobs, {STAGING_DIR}/<pin's name>/sha256:<hex>: on the storage's file system, so the
# helper links them into the registry instead of copying
STAGING_DIR = f"{STORAGE_DIR}/rigup-staging"
RELAY_ADDRESS = "127.0.0.1"  # a relay serves its own rig only
PRUNE_NAME = "rigup-image-mirror-prune"
PRUNE_UNIT = f"{PRUNE_NAME}.service"
PRUNE_TIMER = f"{PRUNE_NAME}.timer"

# Docker Hub's names, and the endpoint its API is at (moby's registry package: DefaultNamespace "docker.io",
# IndexHostname "index.docker.io", DefaultV2Registry "https://registry-1.docker.io"). Docker applies
# `registry-mirrors` to the first two only (registry/service_v2.go lookupV2Endpoints).
DOCKER_HUB_NAMES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
MIRRORED_BY_DOCKER = frozenset({"docker.io", "index.docker.io"})
DOCKER_HUB_API = "https://registry-1.docker.io"


# Every registry of the fleet (the mirror, each relay) takes no write over its API from anyone: distribution's
# read-only mode registers no write route at all (registry/handlers/blobupload.go, manifests.go and blob.go at
# v2.8.2, 7c354a4: POST/PATCH/PUT of an upload, PUT and DELETE of a manifest, DELETE of a blob exist only `if
# !ctx.readOnly`; app.go reads storage.maintenance.readonly.enabled), so a push or delete is answered 405
# before any storage code. Proxy mode alone refused them one layer deeper (registry/proxy's Create, Put and
# Delete return ErrUnsupported, also 405) but kept the routes. rigup's own fill path is not the API: the
# helper (rigup.rig.imagemirror warm/prune) writes the storage directory, and `docker-registry garbage-collect`
# opens the storage itself (registry/root.go GCCmd), neither of which the mode touches; the proxy's own
# caching of a pull (proxyblobstore's storeLocal) writes through the storage too. No `delete` setting either:
# it only enables the API's DELETE routes, which this mode removes.
READ_ONLY = {"readonly": {"enabled": True}}


class MirrorError(ValueError):
    """A mirror setting rigup cannot use; the message names the host and the knob."""


@dataclass(frozen=True)
class MirrorRole:
    """What a host of the fleet runs: the distribution registry proxying `upstream` on `address:port`.
    The mirror host's listens on every address and keeps its clients' pins within max_bytes; a relay's
    (pins_only) listens on 127.0.0.1, proxies the mirror, and keeps its own rig's pins only."""

    upstream: str  # the proxy's remoteurl, e.g. https://registry-1.docker.io
    port: int
    max_bytes: int
    clients: tuple[str, ...]
    keep: tuple[str, ...] = field(default=())  # repository@sha256:digest pinned by a client now
    storage: str = STORAGE_DIR
    address: str = ""  # "": every address
    pins_only: bool = False
    staging: str = STAGING_DIR

    @property
    def is_relay(self) -> bool:
        return self.pins_only

    def config_text(self) -> str:
        """The registry's config: filesystem storage in the package's directory, proxy mode, read-only (see
        READ_ONLY), and the health check its unit's readiness is judged by. JSON is YAML, and needs no YAML writer."""
        config = {
            "version": 0.1,
            "log": {"fields": {"service": "rigup-image-mirror"}},
            "storage": {
                "filesystem": {"rootdirectory": self.storage},
                "cache": {"blobdescriptor": "inmemory"},
                "maintenance": READ_ONLY,
            },
            "http": {"addr": f"{self.address}:{self.port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
            "proxy": {"remoteurl": self.upstream},
            "health": {"storagedriver": {"enabled": True, "interval": "10s", "threshold": 3}},
        }
        return json.dumps(config, indent=2, sort_keys=True) + "\n"

    def keep_text(self) -> str:
        doc = {"storage": self.storage, "config": CONFIG_FILE, "unit": UNIT, "binary": BINARY, "port": self.port,
               "upstream": self.upstream, "staging": self.staging, "pins_only": self.pins_only,
               "max_bytes": self.max_bytes, "keep": list(self.keep)}
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def dropin_text() -> str:
    return render_template("docker-registry-rigup.conf.j2", binary=BINARY, config_file=CONFIG_FILE)


def prune_unit_text(script: str) -> str:
    return render_template("rigup-image-mirror-prune.service.j2", script=script, keep_file=KEEP_FILE)


def prune_timer_text() -> str:
    return render_template("rigup-image-mirror-prune.timer.j2")


def insecure_registries(host_data: Mapping[str, Any]) -> set[str]:
    """host[:port] of every registry Docker is told to reach over plain HTTP (docker_insecure_registries)."""
    return {str(r).split("://", 1)[-1].rstrip("/") for r in knob(host_data, "docker_insecure_registries") or ()}


def image_ref(registry: str, image: str) -> str:
    """Prefix `image` with `registry` unless it already names one (first part has "." or ":")."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"{registry.rstrip('/')}/{image}"


def registry_host(container_registry: str) -> str:
    return container_registry.rstrip("/").split("/", 1)[0]


def upstream_url(host_data: Mapping[str, Any]) -> str:
    """The proxy's remoteurl for the host's container_registry: Docker Hub's API endpoint for Docker Hub
    names; plain HTTP for a registry the host lists as insecure (as Docker itself would reach it), else HTTPS."""
    name = registry_host(str(knob(host_data, "container_registry")))
    if name in DOCKER_HUB_NAMES:
        return DOCKER_HUB_API
    return f"{'http' if name in insecure_registries(host_data) else 'https'}://{name}"


def resolve_mirrors(path: Any, hosts: Mapping[str, dict[str, Any]]) -> None:
    """The fleet file's check of image_mirror_host, run once every host's data is merged. Each client
    gets the derived `image_mirror` knob: {host, address, port} of its mirror (the mirror host's own
    image_mirror_port and ssh_hostname). Raises MirrorError naming the file, the host and the knob."""
    upstreams: dict[str, tuple[str, str]] = {}  # mirror -> (upstream, first client)
    for name, data in hosts.items():
        mirror = data.get("image_mirror_host")
        if mirror is None:
            continue
        if mirror not in hosts:
            raise MirrorError(f"{path}: host {name!r}: image_mirror_host {mirror!r} is not a host of this fleet "
                              f"(hosts: {', '.join(sorted(hosts))})")
        if is_local(mirror):
            raise MirrorError(f"{path}: host {name!r}: image_mirror_host {LOCAL_HOST!r} has no address the rigs can "
                              "reach; name the host by its SSH entry")
        registry = str(knob(data, "container_registry"))
        if "/" in registry.rstrip("/"):
            raise MirrorError(f"{path}: host {name!r}: image_mirror_host needs container_registry to be a registry "
                              f"host (host[:port]), got {registry!r}: a pull-through mirror proxies a whole registry")
        upstream = upstream_url(data)
        seen = upstreams.setdefault(mirror, (upstream, name))
        if seen[0] != upstream:
            raise MirrorError(f"{path}: host {name!r}: its mirror {mirror!r} would proxy {upstream}, but host "
                              f"{seen[1]!r} has it proxy {seen[0]}: one mirror serves one container_registry")
        own = hosts[mirror]
        data["image_mirror"] = {
            "host": mirror,
            "address": str(own.get("ssh_hostname") or mirror),
            "port": int(knob(own, "image_mirror_port")),
        }


def mirror_url(host_data: Mapping[str, Any]) -> str | None:
    """http://address:port of the mirror this host pulls through (a relay's upstream); None without one."""
    mirror = image_mirror(host_data)
    if mirror is None:
        return None
    return f"http://{url_host(str(mirror['address']))}:{int(mirror['port'])}"


def local_registry(host_data: Mapping[str, Any]) -> str | None:
    """`127.0.0.1:port` of the registry on this host that its pulls go to (the mirror's own, or the relay);
    None without a mirror."""
    if image_mirror(host_data) is None:
        return None
    return f"{RELAY_ADDRESS}:{int(knob(host_data, 'image_mirror_port'))}"


def pull_registry(host_data: Mapping[str, Any]) -> str:
    """The registry prefix of rigup's images on this host: its local registry (the mirror's, or the relay
    of it), else container_registry."""
    return local_registry(host_data) or str(knob(host_data, "container_registry"))


def daemon_settings(host_data: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(insecure-registries, registry-mirrors) this host's daemon.json must list. The local registry speaks
    plain HTTP on 127.0.0.1, which Docker allows without listing it (moby registry/config.go: 127.0.0.0/8 is
    always an insecure registry). When the mirror proxies Docker Hub the local registry is also a
    registry-mirrors entry, the only registry that setting applies to: the user's own Docker Hub pulls on
    the rig go through it too (and fall back to Docker Hub when it is down)."""
    insecure = list(knob(host_data, "docker_insecure_registries") or [])
    local = local_registry(host_data)
    if local is None:
        return insecure, []
    hub = registry_host(str(knob(host_data, "container_registry"))) in MIRRORED_BY_DOCKER
    return insecure, [f"http://{local}"] if hub else []


def registry_role(name: str, host_data: Mapping[str, Any], fleet: Iterable[tuple[str, Mapping[str, Any]]],
                  pins: Mapping[str, Iterable[str]] | None = None) -> MirrorRole | None:
    """The host's registry: the mirror's when a host names it, else a relay when it names a mirror, else
    None. `fleet` is (name, data) of every host; `pins` maps a host to the images it pins through its
    mirror (repository@digest or repository:tag), what pruning keeps."""
    fleet = list(fleet)
    mirror = mirror_role(name, host_data, fleet, pins)
    upstream = mirror_url(host_data)
    if mirror is not None or upstream is None:
        return mirror
    return MirrorRole(upstream=upstream, port=int(knob(host_data, "image_mirror_port")), max_bytes=0, clients=(),
                      keep=tuple(sorted(set((pins or {}).get(name, ())))), address=RELAY_ADDRESS, pins_only=True)


def mirror_role(name: str, host_data: Mapping[str, Any], fleet: Iterable[tuple[str, Mapping[str, Any]]],
                pins: Mapping[str, Iterable[str]] | None = None) -> MirrorRole | None:
    """The mirror host's role; None when no host names it. `fleet` is (name, data) of every host; `pins`
    maps a client to the images it pins through the mirror (repository@digest), what pruning keeps."""
    clients = [(other, data) for other, data in fleet if mirror_host(data) == name]
    if not clients:
        return None
    upstream = upstream_url(clients[0][1])
    keep = sorted({ref for other, _ in clients for ref in (pins or {}).get(other, ())})
    max_bytes = int(float(knob(host_data, "image_mirror_max_gb")) * 1e9)
    return MirrorRole(upstream=upstream, port=int(knob(host_data, "image_mirror_port")), max_bytes=max_bytes,
                      clients=tuple(other for other, _ in clients), keep=tuple(keep))


def pinned_through(ref: str, registry: str) -> str | None:
    """What the mirror keeps for an image reference pulled through `registry` (the mirror):
    `repository@sha256:...` when it names a digest, else `repository:tag` (a lock without image digests);
    None for a reference of another registry."""
    prefix = registry.rstrip("/") + "/"
    if not ref.startswith(prefix):
        return None
    name, _, digest = ref[len(prefix):].partition("@")
    tagged = ":" in name.rsplit("/", 1)[-1]
    repository = name.rsplit(":", 1)[0] if tagged else name
    if digest:
        return f"{repository}@{digest}"
    return name if tagged else f"{name}:latest"
