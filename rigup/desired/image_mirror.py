"""The fleet's image mirror: one host runs the distribution registry as a pull-through cache of
container_registry, and every rig that names it (image_mirror_host) pulls rigup's images through it.

Why a mirror: every rig pulling a ~30 GB vLLM image from Docker Hub reads it N times over the site's
uplink (and spends N times Docker Hub's anonymous pull allowance). Through the mirror the uplink
carries it once per fleet; the LAN carries the rest.

    resolve_mirrors(path, hosts)   the fleet file's check: the named host exists, one upstream per mirror;
                                   sets the derived `image_mirror` knob on each client
    pull_registry(host_data)       the registry prefix of rigup's images on this host
    daemon_settings(host_data)     what the host's daemon.json gains (insecure-registries, registry-mirrors)
    mirror_role(name, fleet)       on the mirror host: upstream, port, bound, and the pins to keep

The registry is the OS package (`docker-registry`: Debian's and Ubuntu's build of distribution 2.8),
run by its own unit with rigup's config (a drop-in names it; the package's conffile is left alone).
Its proxy mode is read-only (pushes are refused) and anonymous towards the upstream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rigup.desired.knobs import knob, url_host

CONFIG_FILE = "/etc/rigup/image-mirror.yml"
KEEP_FILE = "/etc/rigup/image-mirror-keep.json"  # the prune script's input: bound and the pins to keep
DROPIN_FILE = "/etc/systemd/system/docker-registry.service.d/rigup.conf"
UNIT = "docker-registry.service"
PACKAGE = "docker-registry"
BINARY = "/usr/bin/docker-registry"
STORAGE_DIR = "/var/lib/docker-registry"  # the package's storage directory, owned by its user
HELPER_NAME = "rigup-image-mirror"  # rigup/rig/imagemirror.py on the mirror host: check, warm, prune
PRUNE_NAME = "rigup-image-mirror-prune"
PRUNE_UNIT = f"{PRUNE_NAME}.service"
PRUNE_TIMER = f"{PRUNE_NAME}.timer"

# Docker Hub's names, and the endpoint its API is at (moby's registry package: DefaultNamespace "docker.io",
# IndexHostname "index.docker.io", DefaultV2Registry "https://registry-1.docker.io"). Docker applies
# `registry-mirrors` to the first two only (registry/service_v2.go lookupV2Endpoints).
DOCKER_HUB_NAMES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
MIRRORED_BY_DOCKER = frozenset({"docker.io", "index.docker.io"})
DOCKER_HUB_API = "https://registry-1.docker.io"


class MirrorError(ValueError):
    """A mirror setting rigup cannot use; the message names the host and the knob."""


@dataclass(frozen=True)
class MirrorRole:
    """What the mirror host runs: the distribution registry proxying `upstream` on `port`."""

    upstream: str  # the proxy's remoteurl, e.g. https://registry-1.docker.io
    port: int
    max_bytes: int
    clients: tuple[str, ...]
    keep: tuple[str, ...] = field(default=())  # repository@sha256:digest pinned by a client now
    storage: str = STORAGE_DIR

    def config_text(self) -> str:
        """The registry's config: filesystem storage in the package's directory, proxy mode, and the
        health check its unit's readiness is judged by. JSON is YAML, and needs no YAML writer."""
        config = {
            "version": 0.1,
            "log": {"fields": {"service": "rigup-image-mirror"}},
            "storage": {
                "filesystem": {"rootdirectory": self.storage},
                "cache": {"blobdescriptor": "inmemory"},
                # the prune script deletes manifests no client pins; garbage-collect then frees their blobs
                "delete": {"enabled": True},
            },
            "http": {"addr": f":{self.port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
            "proxy": {"remoteurl": self.upstream},
            "health": {"storagedriver": {"enabled": True, "interval": "10s", "threshold": 3}},
        }
        return json.dumps(config, indent=2, sort_keys=True) + "\n"

    def keep_text(self) -> str:
        doc = {"storage": self.storage, "config": CONFIG_FILE, "unit": UNIT, "binary": BINARY, "port": self.port,
               "upstream": self.upstream,
               "max_bytes": self.max_bytes, "keep": list(self.keep)}
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def dropin_text() -> str:
    return ("# rigup: run the registry on rigup's config (the package's own config.yml is left as shipped)\n"
            "[Service]\nExecStart=\n"
            f"ExecStart={BINARY} serve {CONFIG_FILE}\n"
            "Restart=on-failure\nRestartSec=2\n")


def prune_unit_text(script: str) -> str:
    return ("[Unit]\nDescription=rigup: keep the image mirror's cache under its bound\n\n"
            f"[Service]\nType=oneshot\nExecStart=/usr/bin/python3 {script} prune {KEEP_FILE}\n")


def prune_timer_text() -> str:
    return ("[Unit]\nDescription=rigup: prune the image mirror's cache daily\n\n"
            "[Timer]\nOnBootSec=15min\nOnUnitActiveSec=1d\nRandomizedDelaySec=1h\n\n"
            "[Install]\nWantedBy=timers.target\n")


def helper_path(install_root: str) -> str:
    return f"{install_root.rstrip('/')}/bin/{HELPER_NAME}"


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
        if mirror == "@local":
            raise MirrorError(f"{path}: host {name!r}: image_mirror_host '@local' has no address the rigs can "
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


def mirror_registry(host_data: Mapping[str, Any]) -> str | None:
    """`address:port` of the mirror this host pulls through; None without one."""
    mirror = knob(host_data, "image_mirror")
    if not mirror:
        return None
    return f"{url_host(str(mirror['address']))}:{int(mirror['port'])}"


def pull_registry(host_data: Mapping[str, Any]) -> str:
    """The registry prefix of rigup's images on this host: its mirror, else container_registry."""
    return mirror_registry(host_data) or str(knob(host_data, "container_registry"))


def daemon_settings(host_data: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(insecure-registries, registry-mirrors) this host's daemon.json must list. The mirror speaks plain
    HTTP, which Docker allows only for listed registries. When the mirror proxies Docker Hub it is also
    a registry-mirrors entry, the only registry that setting applies to: the user's own Docker Hub pulls
    on the rig go through it too (and fall back to Docker Hub when it is down)."""
    insecure = list(knob(host_data, "docker_insecure_registries") or [])
    mirror = mirror_registry(host_data)
    if mirror is None:
        return insecure, []
    if mirror not in insecure:
        insecure.append(mirror)
    hub = registry_host(str(knob(host_data, "container_registry"))) in MIRRORED_BY_DOCKER
    return insecure, [f"http://{mirror}"] if hub else []


def mirror_role(name: str, host_data: Mapping[str, Any], fleet: Iterable[tuple[str, Mapping[str, Any]]],
                pins: Mapping[str, Iterable[str]] | None = None) -> MirrorRole | None:
    """The mirror host's role; None when no host names it. `fleet` is (name, data) of every host; `pins`
    maps a client to the images it pins through the mirror (repository@digest), what pruning keeps."""
    clients = [(other, data) for other, data in fleet if (knob(data, "image_mirror") or {}).get("host") == name]
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
