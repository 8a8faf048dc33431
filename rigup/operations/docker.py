"""Docker operations: daemon.json merged (your keys kept) with the insecure registries, registry mirrors and
the nvidia runtime."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from io import StringIO
from typing import Any

from pyinfra import host, logger
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, operation

from rigup.facts.docker import DockerDaemonJson, DockerEngineInfo, ImageMirrorCache
from rigup.operations.live_output import streamed
from rigup.runstate import account

DAEMON_JSON = "/etc/docker/daemon.json"


def merged_daemon_config(
    current: Mapping[str, Any] | None, insecure_registries: list[str], registry_mirrors: Sequence[str] = ()
) -> dict[str, Any] | None:
    """`current` with the wanted list entries added (the user's keys and list entries kept); None when
    nothing is missing."""
    config = dict(current or {})
    changed = False
    for key, wanted in (("insecure-registries", insecure_registries), ("registry-mirrors", registry_mirrors)):
        have = list(config.get(key) or [])
        missing = [r for r in wanted if r not in have]
        if missing:
            config[key] = have + missing
            changed = True
    return config if changed else None


@operation()
def docker_daemon_config(insecure_registries: list[str] | None = None, registry_mirrors: list[str] | None = None):
    """
    Add settings to /etc/docker/daemon.json without touching the keys already there (the user's,
    the nvidia runtime ``nvidia-ctk`` adds). Restarting Docker is the caller's handler.

    + insecure_registries: ``host:port`` registries Docker may use over plain HTTP (a LAN mirror)
    + registry_mirrors: ``http://host:port`` mirrors Docker tries first for Docker Hub images

    **Example:**

    .. code:: python

        docker.docker_daemon_config(name="Let Docker pull from the LAN mirror",
                                     insecure_registries=["10.0.0.5:5000"],
                                     registry_mirrors=["http://10.0.0.5:5000"])
    """
    merged = merged_daemon_config(host.get_fact(DockerDaemonJson), list(insecure_registries or []),
                                  list(registry_mirrors or []))
    if merged is None:
        host.noop(f"{DAEMON_JSON} has every wanted setting")
        return
    text = json.dumps(merged, indent=4, sort_keys=True) + "\n"
    yield StringCommand("mkdir", "-p", "/etc/docker")
    yield FileUploadCommand(StringIO(text), DAEMON_JSON)
    yield StringCommand("chmod", "644", DAEMON_JSON)


@operation()
def docker_nvidia_runtime():
    """
    Register the ``nvidia`` runtime with Docker through ``nvidia-ctk runtime configure``, which
    merges it into /etc/docker/daemon.json and keeps every other key. Runs only when
    ``docker info`` does not list the runtime; restarting Docker is the caller's handler.

    **Example:**

    .. code:: python

        runtime = hostops.docker_nvidia_runtime(name="Register the nvidia runtime with Docker")
        systemd.service(name="Restart Docker after runtime change", service="docker.service",
                        restarted=True, _if=runtime.did_change)
    """
    info = host.get_fact(DockerEngineInfo)
    if info is not None and info.has_nvidia_runtime:
        host.noop("docker already lists the nvidia runtime")
        return
    yield StringCommand("nvidia-ctk", "runtime", "configure", "--runtime=docker")



@operation()
def image_mirror_cached(script: str, keep_file: str):
    """
    Put every image the fleet's rigs pin into the image mirror's cache before any rig pulls, each blob
    read from upstream once and checked by digest: the rigs' pulls are then cache hits, and the upstream
    serves the fleet one copy (a cold distribution 2.8 would read a missed blob twice, and again for each
    rig missing it at once; see rigup/rig/imagemirror.py). Runs only when the cache lacks a pinned image.

    + script: rigup-image-mirror on the mirror host
    + keep_file: its keep file (port, storage, pins)
    """
    cache = host.get_fact(ImageMirrorCache, script=script, keep_file=keep_file)
    if cache is not None and not cache["missing"]:
        host.noop("the image mirror holds every pinned image")
        return
    yield streamed(
        StringCommand("python3", QuoteString(script), "warm", QuoteString(keep_file)),
        lambda h, ok, output, s: account(h, f"image mirror cached the pinned images in {s:.0f} s" if ok
                                         else "image mirror failed to cache the pinned images"),
    )


@operation()
def image_mirror_pruned(script: str, keep_file: str):
    """
    Keep the image mirror's cache under its bound: when it holds more, drop the images no rig pins now,
    least recently cached first (the registry stops for the garbage collection). Runs only when over the
    bound with something to drop: pins alone over it leave nothing to do, and a warning says so. A
    relay's cache (pins_only) has no bound: anything its rig does not pin is dropped.

    + script: rigup-image-mirror on the mirror host
    + keep_file: its keep file (bound, pins)
    """
    cache = host.get_fact(ImageMirrorCache, script=script, keep_file=keep_file)
    if cache is not None and cache.get("pins_only") and not cache.get("unpinned"):
        host.noop("the relay's cache holds only what its rig pins")
        return
    if cache is not None and cache["bytes"] <= cache["max_bytes"] and not cache.get("pins_only"):
        host.noop(f"the image mirror's cache ({cache['bytes'] / 1e9:.2f} GB) is within its bound")
        return
    if cache is not None and not cache.get("unpinned"):
        over = (f"the image mirror's cache ({cache['bytes'] / 1e9:.2f} GB) is over its bound "
                f"({cache['max_bytes'] / 1e9:.2f} GB) with pinned images only: raise image_mirror_max_gb")
        host.log_styled(over, fg="yellow", log_func=logger.warning)
        host.noop(over)
        return
    yield StringCommand("python3", QuoteString(script), "prune", QuoteString(keep_file))
